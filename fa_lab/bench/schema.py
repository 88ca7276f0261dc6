"""The results schema: the one place it is written down, and the functions that build, check and store it.

Every results file in ``benchmarks/*.json`` (and every run of ``fa-lab bench``) is one JSON object::

    {"device": str, "torch": str, "triton": str | null, "date": "YYYY-MM-DD", "rows": [row, ...]}

where ``device`` names the machine (``"NVIDIA H200"``, ``"CPU: <model>, 2 threads"``), ``torch`` and
``triton`` are the versions that ran (triton null when absent) and ``date`` the day of the run. Each row
is one implementation at one shape, with exactly these keys (a figure that was not measured is null):

- ``impl``: ``naive``, ``torch``, ``sdpa`` (CPU); ``triton``, ``triton_hopper``, ``triton_hopper_fp8``,
  ``triton_hopper_fp8_quant`` (the FP8 quantization alone), ``triton_hopper_fp8_end_to_end`` (the FP8 forward
  from bf16 inputs, quantization included, one call), ``sdpa_flash``, ``sdpa_cudnn``,
  ``sdpa_efficient``, ``sdpa_math``, ``flex`` (new ones in the same style);
- ``dtype``: input precision, ``fp32``, ``bf16`` or ``fp16``; ``head_dim``: d; ``causal``: bool
  (bottom-right aligned mask);
- ``seqlen_q``, ``seqlen_k``: q is (batch, heads, seqlen_q, head_dim), k and v (batch, heads, seqlen_k,
  head_dim); ``batch``, ``heads``;
- ``fwd_ms``, ``bwd_ms``: medians (``triton.testing.do_bench`` on a GPU, wall clock on a CPU);
- ``fwd_tflops``, ``bwd_tflops``: FLOPs over time, by :func:`fa_lab.iomodel.attention_flops` (forward
  4·B·H·seqlen_q·seqlen_k·d, halved for causal; the backward counts 2.5x the forward);
- ``fwd_peak_bytes``: peak extra memory of the forward; ``fwd_peak_source``: ``"measured"``, or
  ``"model"`` when it comes from :mod:`fa_lab.iomodel`;
- memory-bound rows (decode): ``bytes``, the HBM bytes of K and V the call reads; ``tbps``, bytes over
  fwd_ms in TB/s; ``copy_tbps``, the copy bandwidth measured on the same device in the same run, TB/s.

``tbps`` is only a result next to its peer: a row that has it also has ``bytes`` and ``copy_tbps``.

Rows of the interfaces benchmark (:mod:`.interfaces`) carry these keys too, and no other rows do:

- ``case``: ``mha``, ``gqa``, ``varlen``, ``dense_same_tokens``, ``window``, ``softcap``, ``alibi``;
- ``heads_kv``: the key/value heads (``heads`` counts the query heads); ``window``: ``[left, right]``
  (-1 unbounded); ``softcap``: 0.0 when off; ``alibi``: bool; ``lengths``: the sequence lengths of a
  packed (varlen) batch, else null (``batch`` and ``seqlen_q`` then give the sequence count and the
  longest). There the TFLOP/s count the (query, key) pairs each sequence's mask keeps
  (:meth:`fa_lab.block_info.BlockInfo.visible_pairs`).

Rows of the decode benchmark (:mod:`.decode`) carry ``heads_kv`` (as above), ``page_size`` (null for a
dense cache), ``num_splits`` (the count the call used; null when the impl chooses it out of sight) and
``timer`` (``"cuda_graph"`` or ``"eager"``, :mod:`.decode` says how each times a call), and no other
rows do; ``seqlen_k`` is the cache length, ``seqlen_q`` the new queries per sequence, and a memory-bound
row's ``bytes`` counts the K and V it reads.

Rows of the sparse benchmark (:mod:`.sparse`) carry ``case`` (``nsa_select``, ``nsa``, ``moba``, or ``dense`` for
the dense reference at a case's shape), ``heads_kv``, ``block_k`` (keys per selected block) and
``selected`` (blocks per query; MoBA's top-k), and no other rows do; their TFLOP/s count the pairs the
selection keeps.

Rows of the linear-attention benchmark (:mod:`.linear`) carry ``case`` (``simple_gla``, ``gla``,
``delta_rule``, or ``softmax`` for softmax attention at the same shape) and ``chunk_size`` (tokens per
chunk; null for softmax), and no other rows do; linear rows leave the TFLOP/s null (times only). Their
peers are ``fla_chunk`` (flash-linear-attention's chunk kernels), as the sparse rows' are ``fla_nsa`` and
``fla_moba``.

Rows of the multi-GPU ring benchmark (:mod:`.ring_gpus`, ``benchmarks/h200x{N}_ring.json``) carry
``world_size``, ``layout``, ``seqlen`` (the whole sequence; ``seqlen_q``/``seqlen_k`` are the positions per
rank), ``fwd_tflops_per_gpu``, ``bwd_tflops_per_gpu`` and ``efficiency_per_gpu`` (forward-plus-backward
throughput per GPU over one GPU's at the same positions per GPU), and no other rows do; their
``fwd_peak_bytes`` is the largest rank's peak allocation over a forward and backward.
"""
from __future__ import annotations

import datetime
import importlib.metadata
import json
import platform

from ..iomodel import AttentionShape, precision_name

TOP_KEYS = ("device", "torch", "triton", "date", "rows")
_FIGURE = (int, float, type(None))  # a figure is null when it was not measured
ROW_TYPES = {"impl": str, "dtype": str, "head_dim": int, "causal": bool, "seqlen_q": int, "seqlen_k": int,
             "batch": int, "heads": int, "fwd_ms": _FIGURE, "bwd_ms": _FIGURE, "fwd_tflops": _FIGURE,
             "bwd_tflops": _FIGURE, "fwd_peak_bytes": _FIGURE, "fwd_peak_source": (str, type(None)),
             "bytes": _FIGURE, "tbps": _FIGURE, "copy_tbps": _FIGURE}
ROW_KEYS = tuple(ROW_TYPES)
INTERFACE_TYPES = {"case": str, "heads_kv": int, "window": list, "softcap": float, "alibi": bool,
                   "lengths": (list, type(None))}
DECODE_TYPES = {"heads_kv": int, "page_size": (int, type(None)), "num_splits": (int, type(None)), "timer": str}
SPARSE_TYPES = {"case": str, "heads_kv": int, "block_k": int, "selected": int}
LINEAR_TYPES = {"case": str, "chunk_size": (int, type(None))}
RING_TYPES = {"world_size": int, "layout": str, "seqlen": int, "fwd_tflops_per_gpu": _FIGURE,
              "bwd_tflops_per_gpu": _FIGURE, "efficiency_per_gpu": _FIGURE}
# The optional key groups: a row has ROW_KEYS and exactly one of these, or none.
OPTIONAL_GROUPS = (INTERFACE_TYPES, DECODE_TYPES, SPARSE_TYPES, LINEAR_TYPES, RING_TYPES)


def empty_row(impl: str, shape: AttentionShape) -> dict:
    """A row for ``impl`` at ``shape``, every figure null."""
    row = dict.fromkeys(ROW_KEYS)
    row.update(impl=impl, dtype=precision_name(shape.dtype), head_dim=shape.head_dim, causal=shape.causal,
               seqlen_q=shape.seqlen_q, seqlen_k=shape.seqlen_k, batch=shape.batch, heads=shape.heads)
    return row


def environment(device: str) -> dict:
    """The header of a results file for a run on ``device`` ("cpu" or "cuda"): names, versions, today."""
    import torch

    if device == "cpu":
        device_name = f"CPU: {_cpu_model()}, {torch.get_num_threads()} threads"
    else:
        device_name = torch.cuda.get_device_name()
    try:
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = None
    return {"device": device_name, "torch": torch.__version__, "triton": triton_version,
            "date": datetime.date.today().isoformat()}


def device_prefix(device: str) -> str:
    """The file-name prefix of a device machine's results: "h100" for an H100 run (named in ``device``, a header's
    device field), else "h200" (the machine the bars are set on)."""
    return "h100" if "H100" in device else "h200"


def _cpu_model() -> str:
    """The CPU's model name: from /proc/cpuinfo on Linux, else whatever ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def validate_results(results: dict) -> dict:
    """Check ``results`` against the schema; return it, or raise ValueError naming what is wrong."""
    if not isinstance(results, dict):
        raise ValueError(f"results must be a JSON object, got {type(results).__name__}")
    missing = [key for key in TOP_KEYS if key not in results]
    if missing:
        raise ValueError(f"results lack the keys {missing}; the schema needs {list(TOP_KEYS)}")
    if not isinstance(results["rows"], list):
        raise ValueError("results['rows'] must be a list of rows")
    for index, row in enumerate(results["rows"]):
        extra = set(row) - set(ROW_KEYS) if isinstance(row, dict) else set()
        group = next((types for types in OPTIONAL_GROUPS if set(types) == extra), {})
        if not isinstance(row, dict) or set(row) != set(ROW_KEYS) | set(group):
            got = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise ValueError(f"row {index} has keys {got}; every row needs exactly {list(ROW_KEYS)}, an "
                             f"interfaces row also {list(INTERFACE_TYPES)}, a decode row {list(DECODE_TYPES)}, "
                             f"a sparse row {list(SPARSE_TYPES)}, a linear row {list(LINEAR_TYPES)}, "
                             f"a ring row {list(RING_TYPES)}")
        for key, types in {**ROW_TYPES, **group}.items():
            if not isinstance(row[key], types) or (isinstance(row[key], bool) and types is not bool):
                raise ValueError(f"row {index}: {key} is {row[key]!r}, which is not a valid {key}")
        if row["tbps"] is not None and (row["bytes"] is None or row["copy_tbps"] is None):
            raise ValueError(f"row {index}: tbps needs bytes and copy_tbps (the copy bandwidth of the same run)")
    return results


def write_log(log: dict, path) -> None:
    """Write a results file or a log (a tuning or model log: the schema's header and its own keys) as
    indented JSON."""
    with open(path, "w") as out:
        json.dump(log, out, indent=1)
        out.write("\n")


def save_results(results: dict, path) -> None:
    """Write schema-valid ``results`` as indented JSON."""
    write_log(validate_results(results), path)


def load_results(path) -> dict:
    """Read and validate a results file (``benchmarks/*.json``)."""
    with open(path) as source:
        return validate_results(json.load(source))
