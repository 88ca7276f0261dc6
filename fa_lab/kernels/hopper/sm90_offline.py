"""Compile Gluon and Triton kernels for sm_90 on a machine without a GPU, and read what they need.

Triton's wheel ships ``ptxas`` and ``cuobjdump``, so the whole pipeline (Gluon ->
TTGIR -> LLVM IR -> PTX -> cubin -> SASS) runs on a laptop. The CPU tests use it to check
that every variant of the FA3 kernel (:mod:`.fa3_kernel`) compiles, fits in shared
memory, and how many registers it spills in its K/V loops (none in most builds; the tests
hold the exceptions); notebook 04 uses it to show the PTX the FA3
ideas turn into (``setmaxnreg``, ``wgmma.mma_async``, ``mbarrier``).

Under Triton's CPU interpreter (``TRITON_INTERPRET=1``, which ``import fa_lab`` sets on a
machine without a GPU) triton's own helper functions are replaced by interpreted ones
that the compiler cannot use, so the compilation then runs in another Python process
with the interpreter off (``python -m fa_lab.kernels.hopper.sm90_offline --serve``), started once and kept
for the later builds: each start costs a Python start and the imports of torch and Triton, seconds on a small
CPU, which the CPU tests' many builds would otherwise pay every time.
"""
from __future__ import annotations

import atexit
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import traceback
from collections import Counter
from dataclasses import asdict, dataclass
from functools import cached_property

import torch

SM90_SHARED_LIMIT = 232448  # bytes of shared memory one CTA may use on an H100/H200 (227 KiB)
SM90_SHARED_PER_SM = 233472  # bytes of shared memory an SM holds (228 KiB), for all its resident CTAs
SM90_SHARED_RESERVED = 1024  # bytes the hardware reserves per resident CTA on top of what the kernel asks


def ctas_per_sm(shared_bytes: int) -> int:
    """How many CTAs asking ``shared_bytes`` each an SM holds at once, as far as shared memory decides."""
    return SM90_SHARED_PER_SM // (shared_bytes + SM90_SHARED_RESERVED)
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8e4nv": torch.float8_e4m3fn, "fp32": torch.float32}


@dataclass
class Sm90Build:
    """A compiled kernel: its PTX, TTGIR and SASS text, shared memory (bytes), and ptxas's resource report."""

    ptx: str
    ttgir: str
    sass: str
    shared_bytes: int
    registers: int  # per thread at launch (setmaxnreg moves them between warpgroups afterwards)
    stack_bytes: int  # per thread; > 0 means ptxas spilled registers
    local_bytes: int

    @cached_property
    def loop_bodies(self) -> list[list[str]]:
        """The instructions of the K/V loops (:func:`wgmma_loop_bodies`), read out of the SASS once."""
        return wgmma_loop_bodies(self.sass)

    @property
    def kv_loop_spills(self) -> int:
        """Local-memory loads and stores (LDL/STL) inside the SASS loops that issue WGMMAs (:func:`kv_loop_spills`)."""
        return _spills(self.loop_bodies)

    def loop_instructions(self, opcode: str) -> int:
        """How many instructions of the K/V loops (:attr:`loop_bodies`) have this opcode (as "F2F.BF16.F32", or a
        prefix of it)."""
        return sum(1 for body in self.loop_bodies for text in body if sass_opcode(text).startswith(opcode))

    @cached_property
    def loop_census(self) -> list[dict]:
        """Each K/V loop's instructions by opcode (:func:`loop_census`)."""
        return loop_census(self.loop_bodies)

    @cached_property
    def named_barriers(self) -> list[list[tuple[int, str, int]]]:
        """Per K/V loop, its named-barrier instructions for two warpgroups (256 threads, ``0x100``) as (position in
        the loop, "SYNC" or "ARV", barrier id): the ping-pong turns and the backward's dS handover."""
        return [[(index, match.group(1), int(match.group(2), 16)) for index, text in enumerate(body)
                 if (match := NAMED_BARRIER_SASS.search(text.strip()))] for body in self.loop_bodies]

    @cached_property
    def ptxas_report(self) -> str:
        """What ``ptxas -v`` says while assembling this build's PTX again (:func:`ptxas_notes`; about a second)."""
        return ptxas_notes(self.ptx)

    @property
    def injected_waits(self) -> int:
        """WGMMA waits ptxas adds on its own (its note C7517, "warpgroup.wait is injected ... to allow use of registers
        defined by GMMA"): each makes a warpgroup wait for a product the source left in flight, so two products the
        kernel issues back to back run one after the other."""
        return self.ptxas_report.count("(C7517)")

    @property
    def serialized_wgmma(self) -> bool:
        """Whether ptxas gave up pipelining the WGMMAs (its note C7512, "wgmma.mma_async instructions are serialized
        due to insufficient register resources"): then every product waits for the one before it."""
        return "(C7512)" in self.ptxas_report


def descriptor_type(dtype: str, block: list[int]) -> str:
    """The signature string Triton gives a Gluon TMA descriptor argument of this dtype ("bf16", "fp16",
    "fp8e4nv") and block shape."""
    from ..common import shared_layout

    return f"tensordesc<{dtype}{block},{shared_layout(tuple(block), _DTYPES[dtype])!r}>"


def compile_for_sm90(kernel, signature: dict[str, str], constants: dict, num_warps: int = 4,
                     maxnreg: int | None = None, aligned: tuple[str, ...] = (), num_stages: int | None = None
                     ) -> Sm90Build:
    """Compile a Gluon or plain Triton kernel for sm_90a as a launch would, without a GPU.

    signature: every argument's Triton type ("i32", "*fp32", :func:`descriptor_type`); constants: the
    constexpr arguments; aligned: the arguments a launch would find divisible by 16 (its specialization
    hints: pointers from torch allocations, head_dim = 128, ...). Under the interpreter the kernel is
    compiled in a fresh process, which imports it by module and name (its module must be importable
    there from this process's sys.path).
    """
    return compile_all_for_sm90([dict(kernel=kernel, signature=signature, constants=constants, num_warps=num_warps,
                                      maxnreg=maxnreg, aligned=aligned, num_stages=num_stages)])[0]


def compile_all_for_sm90(jobs: list[dict]) -> list[Sm90Build]:
    """Several :func:`compile_for_sm90` jobs (dicts of its arguments): under the interpreter, in the compile
    process (:class:`_CompileProcess`), which imports each kernel's module once: a module edited on disk after
    its first build there is not read again."""
    from .. import interpreting

    args = [dict(module=job["kernel"].fn.__module__, name=job["kernel"].fn.__qualname__, signature=job["signature"],
                 constants=job["constants"], num_warps=job.get("num_warps", 4), maxnreg=job.get("maxnreg"),
                 aligned=list(job.get("aligned", ())), num_stages=job.get("num_stages")) for job in jobs]
    if interpreting():
        return [Sm90Build(**build) for build in _COMPILER.compile(args)]
    return [_compile(**arg) for arg in args]


class _CompileProcess:
    """The Python process (interpreter off) that compiles for the interpreted one: started at the first build,
    then fed one JSON line of jobs per call (with this process's sys.path, so that modules added since are
    found) and answering one line; it ends when this process closes its stdin (at exit, or when it dies)."""

    def __init__(self):
        self.process, self.errors, self.lock = None, None, threading.Lock()

    def compile(self, jobs: list[dict]) -> list[dict]:
        with self.lock:
            if self.process is None or self.process.poll() is not None:
                self._start()
            try:
                self.process.stdin.write(json.dumps({"path": sys.path, "jobs": jobs}) + "\n")
                self.process.stdin.flush()
                line = self.process.stdout.readline()
            except BrokenPipeError:
                line = ""
            if not line:  # the process died (its stderr says why); the next call starts another
                self.errors.seek(0)
                raise RuntimeError(f"compiling for sm_90 failed:\n{self.errors.read()[-3000:]}")
            reply = json.loads(line)
            if "error" in reply:
                raise RuntimeError(f"compiling for sm_90 failed:\n{reply['error'][-3000:]}")
            return reply["builds"]

    def close(self):
        """End the process (at exit): it sees its stdin close and returns."""
        if self.process is not None and self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()

    def _start(self):
        env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join(sys.path)}
        if self.errors is not None:  # the stderr of a process that died
            self.errors.close()
        self.errors = tempfile.TemporaryFile("w+")  # a file, not a pipe: warnings cannot fill it and block
        self.process = subprocess.Popen([sys.executable, "-m", __name__, "--serve"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self.errors, text=True, env=env)


_COMPILER = _CompileProcess()
atexit.register(_COMPILER.close)


def _serve():
    """The compile process's loop: a line of jobs in, a line of builds (or the error's traceback) out. Whatever
    else writes to stdout (a tool the compiler runs, a warning) goes to stderr, off the replies' pipe."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for line in sys.stdin:
        request = json.loads(line)
        sys.path.extend(path for path in request["path"] if path not in sys.path)
        importlib.invalidate_caches()  # modules written since the last request
        try:
            reply = {"builds": [asdict(_compile(**job)) for job in request["jobs"]]}
        except Exception:
            reply = {"error": traceback.format_exc()}
        print(json.dumps(reply), file=replies, flush=True)


def compile_fa3_for_sm90(head_dim: int = 128, causal: bool = False, **switches) -> Sm90Build:
    """Compile :func:`.fa3_kernel.attention_fwd_fa3_kernel` for sm_90a as the launcher would, without a GPU
    (switches: :func:`fa3_forward_job`'s)."""
    return compile_all_for_sm90([fa3_forward_job(head_dim, causal, **switches)])[0]


def fa3_forward_job(head_dim: int = 128, causal: bool = False, fp8: bool = False, out_dtype: str = "bf16",
                    persistent: bool = False, window: bool = False, varlen: bool = False, softcap: bool = False,
                    alibi: bool = False, **switches) -> dict:
    """The :func:`compile_all_for_sm90` job of :func:`.fa3_kernel.attention_fwd_fa3_kernel` as the launcher builds
    it for a call of this kind with ``switches``, :class:`.attention.HopperOptions`' fields (consumers 2 and
    split_loops off unless given; the compile-time arguments are :func:`.attention.fa3_launch_constants`')."""
    from .attention import HopperOptions, fa3_launch_constants
    from .fa3_config import descriptor_blocks
    from .fa3_kernel import attention_fwd_fa3_kernel

    operand = "fp8e4nv" if fp8 else out_dtype
    blocks = descriptor_blocks(head_dim, fp8)
    signature = {
        **{f"{name}_desc": descriptor_type(operand, blocks[name]) for name in "qkv"},
        "o_desc": descriptor_type(out_dtype, blocks["o"]), "o_ptr": f"*{out_dtype}",
        **{name: "*fp32" for name in ("lse_ptr", "q_descale_ptr", "k_descale_ptr", "v_exponent_ptr",
                                      "v_descale_max_ptr", "slopes_ptr")},
        "heads": "i32", "group": "i32", "seqlen_q": "i32", "seqlen_k": "i32", "left": "i32", "right": "i32",
        "schedule_ptr": "*i32", "cu_seqlens_q": "*i32", "cu_seqlens_k": "*i32", "qk_scale": "fp32",
        "softcap_scale": "fp32",
    }
    options = HopperOptions(**{"consumers": 2, "split_loops": False, **switches})
    constants = dict(fa3_launch_constants(options, causal, window, persistent, softcap, alibi, fp8, varlen))
    return dict(kernel=attention_fwd_fa3_kernel, signature=signature, num_warps=constants.pop("num_warps"),
                maxnreg=constants.pop("maxnreg"), constants=constants)


def census_row_job(row: dict) -> dict:
    """The :func:`compile_all_for_sm90` job of one of our builds in benchmarks/sass_census_fa4.json: its kernel
    ("forward" or "backward"), head_dim, causal, case ("dense", "window" or "softcap") and the switches the
    launcher chose: for the forward consumers, persistent and split_loops, for the backward dq_mode."""
    if row["kernel"] == "backward":
        return fa3_backward_job(row["head_dim"], row["causal"], dq_mode=row["dq_mode"])
    return fa3_forward_job(row["head_dim"], row["causal"], consumers=row["consumers"], persistent=row["persistent"],
                           window=row["case"] == "window", softcap=row["case"] == "softcap",
                           split_loops=row["split_loops"])


def fa3_backward_job(head_dim: int = 128, causal: bool = False, dtype: str = "bf16", varlen: bool = False,
                     dq_mode: str | None = None, rows: int | None = None, rows_by_producer: bool = True,
                     rows_ahead: bool = False, kv_split: int = 1, window: bool = False) -> dict:
    """The :func:`compile_all_for_sm90` job of :func:`.fa3_backward.attention_bwd_fa3_kernel` as
    :func:`.attention.gluon_backward` (or, varlen, ``gluon_varlen_backward``) launches it with ``dq_mode`` (None:
    :func:`.attention.dq_mode_by_default`) and ``rows`` query rows per step (None: by head_dim),
    ``rows_by_producer`` (both launchers' default: True), ``rows_ahead``, ``kv_split`` (above 1: float32 dK, dV
    partials) and ``window`` (a band; ``causal`` must then be False, as the launcher folds it in)."""
    from .attention import dq_mode_by_default
    from .fa3_backward import BWD_CONSUMERS, DQ_SCHEMES, attention_bwd_fa3_kernel, backward_blocks
    from .fa3_config import launch_maxnreg

    scheme = DQ_SCHEMES[dq_mode or dq_mode_by_default(head_dim)]
    row_block, keys, dq_rows = backward_blocks(head_dim, scheme, rows)
    kv_out = "fp32" if kv_split > 1 else dtype
    signature = {"q_desc": descriptor_type(dtype, row_block), "k_desc": descriptor_type(dtype, keys),
                 "v_desc": descriptor_type(dtype, keys), "do_desc": descriptor_type(dtype, row_block),
                 "dq_desc": descriptor_type("fp32", dq_rows), "dk_ptr": f"*{kv_out}", "dv_ptr": f"*{kv_out}",
                 "lse2_ptr": "*fp32", "delta_ptr": "*fp32", "heads": "i32", "group": "i32", "seqlen_q": "i32",
                 "seqlen_k": "i32", "head_group": "i32", "window_left": "i32", "window_right": "i32",
                 "schedule_ptr": "*i32", "cu_seqlens_q": "*i32",
                 "cu_seqlens_k": "*i32", "qk_scale": "fp32", "scale": "fp32"}
    return dict(kernel=attention_bwd_fa3_kernel, signature=signature,
                constants=dict(CAUSAL=causal, STAGES=2, VARLEN=varlen, DQ_SCHEME=scheme,
                               ROWS_BY_PRODUCER=rows_by_producer, ROWS_AHEAD=rows_by_producer and rows_ahead,
                               WINDOW=window),
                num_warps=4, maxnreg=launch_maxnreg(BWD_CONSUMERS.value),
                aligned=("dk_ptr", "dv_ptr", "lse2_ptr", "delta_ptr"))


def fp8_quant_job(num_warps: int = 8, maxnreg: int | None = 128, head_dim: int = 128, stages: int = 1) -> dict:
    """The :func:`compile_all_for_sm90` job of :func:`.fp8_quant._quantize_qkv_kernel` as
    :func:`.fp8_quant.quantize_fp8_operands` launches it on bf16 operands with the rotation (its defaults)."""
    from .fp8_quant import _quantize_qkv_kernel

    pointers = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "q8_ptr": "*fp8e4nv", "k8_ptr": "*fp8e4nv",
                "vt8_ptr": "*fp8e4nv", "q_descale_ptr": "*fp32", "k_descale_ptr": "*fp32", "v_descale_ptr": "*fp32",
                "signs_ptr": "*fp32"}
    strides = ["stride_qbh", "stride_qn", "stride_kbh", "stride_kn", "stride_vbh", "stride_vn", "stride_q8bh",
               "stride_k8bh", "stride_vt8bh"]
    signature = {**pointers, "seqlen_q": "i32", "seqlen_k": "i32", "keys": "i32", "bh_count": "i32",
                 **dict.fromkeys(strides, "i32"), "rsqrt_d": "fp32"}
    return dict(kernel=_quantize_qkv_kernel, signature=signature,
                constants=dict(BLOCK=128, HEAD_DIM=head_dim, ROTATE=True, FLOAT32_DOT=False, STAGES=stages),
                num_warps=num_warps, maxnreg=maxnreg, aligned=(*pointers, *strides, "keys"))


def fp8_quant_gluon_job(head_dim: int = 128, dtype: str = "bf16") -> dict:
    """The :func:`compile_all_for_sm90` job of :func:`.fp8_quant_gluon.quantize_qkv_gluon_kernel` as
    :func:`.fp8_quant_gluon.launch_gluon_quantization` launches it."""
    from .fp8_quant_gluon import MAXNREG, NUM_WARPS, TILE_ROWS, quantize_qkv_gluon_kernel

    block = [1, 1, TILE_ROWS, head_dim]
    pointers = {"v_ptr": f"*{dtype}", "vt8_ptr": "*fp8e4nv", "q_descale_ptr": "*fp32", "k_descale_ptr": "*fp32",
                "v_descale_ptr": "*fp32", "signs_ptr": "*fp32"}
    strides = ["stride_vbh", "stride_vn", "stride_vt8bh"]
    signature = {"q_desc": descriptor_type(dtype, block), "k_desc": descriptor_type(dtype, block),
                 "q8_desc": descriptor_type("fp8e4nv", block), "k8_desc": descriptor_type("fp8e4nv", block),
                 **pointers, **dict.fromkeys(["seqlen_k", "keys", "bh_count", "q_tiles", "k_tiles", *strides], "i32"),
                 "rsqrt_d": "fp32"}
    return dict(kernel=quantize_qkv_gluon_kernel, signature=signature, constants={}, num_warps=NUM_WARPS,
                maxnreg=MAXNREG, aligned=(*pointers, *strides, "keys"))


def ctas_per_sm_by_registers(registers: int, num_warps: int) -> int:
    """How many CTAs of num_warps warps at ``registers`` a thread an SM holds at once, as far as registers decide."""
    from .fa3_config import SM90_REGISTERS_PER_SM

    return SM90_REGISTERS_PER_SM // (registers * 32 * num_warps)


def _compile(module, name, signature, constants, num_warps, maxnreg, aligned=(), num_stages=None) -> Sm90Build:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction

    kernel = getattr(importlib.import_module(module), name)
    full = {arg: signature.get(arg, "constexpr") for arg in kernel.arg_names if arg in signature or arg in constants}
    attrs = {(kernel.arg_names.index(arg),): [["tt.divisibility", 16]] for arg in aligned}
    source_type = GluonASTSource if isinstance(kernel, GluonJITFunction) else ASTSource
    source = source_type(kernel, full, constants, attrs)
    options = {"num_warps": num_warps, **({"maxnreg": maxnreg} if maxnreg else {}),
               **({"num_stages": num_stages} if num_stages else {})}
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    usage = _resource_usage(compiled.asm["cubin"])
    return Sm90Build(compiled.asm["ptx"], compiled.asm["ttgir"], _cuobjdump(compiled.asm["cubin"], "-sass"),
                     compiled.metadata.shared, usage["REG"], usage["STACK"], usage["LOCAL"])


def ptxas_notes(ptx: str) -> str:
    """What Triton's bundled ``ptxas -v`` reports while assembling ``ptx`` for sm_90a: the resource lines and its
    numbered notes, such as the waits it injects (C7517) or WGMMAs it serializes (C7512)."""
    return _run_bundled("ptxas", ptx, "kernel.ptx", "-v", "--gpu-name=sm_90a", output="kernel.cubin").stderr


def _cuobjdump(cubin: bytes, *flags: str) -> str:
    """What Triton's bundled ``cuobjdump`` prints for the cubin with these flags."""
    return _run_bundled("cuobjdump", cubin, "kernel.cubin", *flags).stdout


def _run_bundled(tool: str, contents: str | bytes, name: str, *flags: str,
                 output: str | None = None) -> subprocess.CompletedProcess:
    """Triton's bundled ``tool`` (ptxas, cuobjdump) run with flags on ``contents`` written to a temporary file
    ``name`` (then ``-o output`` beside it, if given)."""
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, name)
        with open(source, "wb" if isinstance(contents, bytes) else "w") as file:
            file.write(contents)
        command = [path, *flags, source] + (["-o", os.path.join(tmp, output)] if output else [])
        return subprocess.run(command, capture_output=True, text=True, check=True)


def _resource_usage(cubin: bytes) -> dict:
    """REG, STACK, LOCAL, ... of the cubin's kernel, as ``cuobjdump --dump-resource-usage`` prints them."""
    report = _cuobjdump(cubin, "--dump-resource-usage")
    return {key: int(value) for key, value in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", report)}


def wgmma_loop_bodies(sass: str) -> list[list[str]]:
    """The instructions of each innermost SASS loop that issues WGMMAs (the K/V loops), one list per loop."""
    loops = loop_bodies_issuing(sass, "GMMA")
    if not loops:
        raise ValueError("no SASS loop issues a GMMA: is this the FA3 kernel?")
    return loops


def loop_bodies_issuing(sass: str, opcode: str) -> list[list[str]]:
    """The instructions of each innermost SASS loop that holds an instruction whose opcode contains ``opcode``
    ("GMMA": the consumers' K/V loops; "UTMALDG": a producer's TMA loads), one list per loop.

    A loop is a predicated backward branch (the unpredicated ones return from the out-of-line retry
    blocks of mbarrier waits); the innermost ones are the smallest holding such an instruction.
    """
    code = [(int(address, 16), text) for address, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = []
    for address, text in code:
        target = re.search(r"^@!?U?P\w*\s+BRA\b.*?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address:
            loops.append((int(target.group(1), 16), address))
    body = {loop: [text for address, text in code if loop[0] <= address <= loop[1]] for loop in loops}
    holding = [loop for loop in loops if any(opcode in sass_opcode(text) for text in body[loop])]
    innermost = [loop for loop in holding
                 if not any(other != loop and loop[0] <= other[0] and other[1] <= loop[1] for other in holding)]
    return [body[loop] for loop in innermost]


def loop_census(loop_bodies: list[list[str]]) -> list[dict]:
    """Per loop (:func:`wgmma_loop_bodies`): its instruction count, its opcodes (suffixes dropped) by count, the
    warpgroup barriers (``BAR.SYNC ..., 0x80``: 128 threads) it waits on, how many of its special-function
    instructions (MUFU: the exponentials) come before its first wait for every product in flight
    (``WARPGROUP.DEPBAR.LE gsb0, 0x0``; all of them if it has none): those may overlap the step's last product, and
    where in the loop its WGMMA instructions stand (``wgmma_at``, indices into the loop's instructions).
    Reads any sm_90 SASS, flash-attn-4's too (benchmarks/fa4_sass_census.py)."""
    census = []
    for body in loop_bodies:
        opcodes = Counter(sass_opcode(text).split(".")[0] for text in body)
        drain = next((i for i, text in enumerate(body) if "WARPGROUP.DEPBAR.LE gsb0, 0x0" in text), len(body))
        census.append({"instructions": len(body),
                       "warpgroup_barriers": sum(1 for text in body if "BAR.SYNC" in text and "0x80" in text),
                       "mufu_before_drain": sum(1 for text in body[:drain] if sass_opcode(text).startswith("MUFU")),
                       "wgmma_at": [i for i, text in enumerate(body) if "GMMA" in sass_opcode(text)],
                       "opcodes": dict(opcodes.most_common())})
    return census


# A bar.sync / bar.arrive of 256 threads in SASS: "BAR.SYNC.DEFER_BLOCKING 0xc, 0x100", "BAR.ARV 0xd, 0x100".
NAMED_BARRIER_SASS = re.compile(r"BAR\.(SYNC|ARV)\S* 0x([0-9a-f]+), 0x100$")


def sass_opcode(instruction: str) -> str:
    """The opcode of one SASS instruction's text, its predicate dropped: "@!P0 FSEL R1, ..." -> "FSEL"."""
    return re.sub(r"^@!?U?P\w+\s+", "", instruction.strip()).split()[0]


def kv_loop_spills(sass: str) -> int:
    """LDL/STL instructions inside the innermost SASS loops that issue WGMMAs (:func:`wgmma_loop_bodies`).
    Spills outside them (a few scalars reloaded once per work tile) cost next to nothing."""
    return _spills(wgmma_loop_bodies(sass))


def _spills(loop_bodies: list[list[str]]) -> int:
    """The LDL/STL instructions among these loops' instructions."""
    return sum(1 for body in loop_bodies for text in body if re.search(r"\b(LDL|STL)\b", text))


if __name__ == "__main__":  # python -m fa_lab.kernels.hopper.sm90_offline --serve (see _CompileProcess)
    _serve()
