"""Lab 01's checks accept the solution and reject typical wrong solutions with the right diagnosis.

Every mutant is the solution notebook's own code with one edit a learner might
make (the test fails if the edit no longer applies), run in-process through the
same judges the grader uses, on the public cases and the hidden cases of two seeds.
"""
from __future__ import annotations

import pytest
from labkit import LabChecks, Mutant, mutant_params

from fa_lab.grading.check import summary_hint

LAB = LabChecks("lab01", prelude="import torch\n")

KEY_END = "return max(0, min(seqlen_k, i1 + seqlen_k - seqlen_q))"
TILE_MASK = "return cols <= rows + (seqlen_k - seqlen_q)"
SOFTMAX_START = '    m = torch.full(score_blocks[0].shape[:-1], float("-inf"))\n'
CAT_AND_LOGSUMEXP = """\
    s = torch.cat(score_blocks, dim=-1)
    m = s.amax(dim=-1)
    return m, torch.exp(torch.logsumexp(s, dim=-1) - torch.where(torch.isinf(m), 0.0, m))
"""
TILE_BODY = ("    rows = torch.arange(i0, i1)[:, None]\n    cols = torch.arange(j0, j1)[None, :]\n"
             "    return cols <= rows + (seqlen_k - seqlen_q)\n")
WHOLE_MASK_SLICED = ("    rows = torch.arange(seqlen_q)[:, None]\n    cols = torch.arange(seqlen_k)[None, :]\n"
                     "    return (cols <= rows + (seqlen_k - seqlen_q))[i0:i1, j0:j1]\n")
NO_KEY = ("(acc / torch.where(l == 0, 1.0, l)[..., None])", "(acc / l[..., None])")
DS = "ds = p * (do_tile @ v_tile.transpose(-2, -1) - delta[..., i0:i1, None])"
DQ, DK = "dq[..., i0:i1, :] += ds @ k_tile * scale", "dk[..., j0:j1, :] += ds.transpose(-2, -1) @ q_tile * scale"
DV = "dv[..., j0:j1, :] += p.transpose(-2, -1) @ do_tile"
BACKWARD = "flash_backward(q, k, v, out, lse, dout, ctx.causal, ctx.scale)"
FORWARD = "out, lse = flash_forward(q, k, v, causal, scale)"
QUERY_LOOP = "for i0 in range(0, seqlen_q, block_q):"
KEY_LOOP = "for j0 in range(0, key_end(i1, seqlen_q, seqlen_k, causal), block_k):"

MUTANTS = [
    Mutant("online_softmax", "l not rescaled", [("l = torch.exp(m - m_safe) * l + ", "l = l + ")],
           "l is not rescaled"),
    Mutant("online_softmax", "rescale with the wrong sign",
           [("torch.exp(m - m_safe) * l", "torch.exp(m_safe - m) * l")], "exp(m_new - m_old)"),
    Mutant("online_softmax", "no max subtraction",
           [("l = torch.exp(m - m_safe) * l + torch.exp(block - m_safe[..., None]).sum(dim=-1)",
             "l = l + torch.exp(block).sum(dim=-1)")], "subtract"),
    Mutant("online_softmax", "m is the block max",
           [("m_new = torch.maximum(m, block.amax(dim=-1))", "m_new = block.amax(dim=-1)")], "running max"),
    Mutant("online_softmax", "no guard for a max of -inf",
           [("m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)", "m_safe = m_new")],
           "-inf"),
    Mutant("online_softmax", "the whole row: torch.cat and logsumexp", [(SOFTMAX_START, CAT_AND_LOGSUMEXP)],
           "never the whole row of scores"),
    Mutant("online_softmax", "m starts at 0",
           [(SOFTMAX_START, "    m = torch.zeros(score_blocks[0].shape[:-1])\n")], "m starts at 0"),
    Mutant("online_softmax", "the block's terms against the old max",
           [("torch.exp(block - m_safe[..., None])",
             "torch.exp(block - torch.where(torch.isinf(m), 0.0, m)[..., None])")], "against the old max"),
    Mutant("online_softmax", "returns the lse as l", [("    return m, l", "    return m, m + torch.log(l)")],
           "in place of l"),
    Mutant("causal_tile_mask", "tile mask: one key too many", [(TILE_MASK, TILE_MASK + " + 1")],
           "one key past its diagonal"),
    Mutant("causal_tile_mask", "tile mask misses the diagonal",
           [(TILE_MASK, "return cols < rows + (seqlen_k - seqlen_q)")], "hides the key on each query's diagonal"),
    Mutant("causal_tile_mask", "tile mask aligned top-left", [(TILE_MASK, "return cols <= rows")], "top-left"),
    Mutant("causal_tile_mask", "tile mask offset with the wrong sign",
           [(TILE_MASK, "return cols <= rows + (seqlen_q - seqlen_k)")], "the offset has the wrong sign"),
    Mutant("causal_tile_mask", "tile mask in tile coordinates",
           [("rows = torch.arange(i0, i1)", "rows = torch.arange(i1 - i0)"),
            ("cols = torch.arange(j0, j1)", "cols = torch.arange(j1 - j0)")], "positions inside the tile"),
    Mutant("causal_tile_mask", "tile mask True where hidden",
           [(TILE_MASK, "return cols > rows + (seqlen_k - seqlen_q)")], "True where the key is hidden"),
    Mutant("causal_tile_mask", "tile mask transposed",
           [("rows = torch.arange(i0, i1)[:, None]", "rows = torch.arange(i0, i1)[None, :]"),
            ("cols = torch.arange(j0, j1)[None, :]", "cols = torch.arange(j0, j1)[:, None]")],
           "rows are the queries [i0, i1), columns the keys"),
    Mutant("causal_tile_mask", "tile mask as floats", [(TILE_MASK, f"return ({TILE_MASK[7:]}).float()")],
           "expected torch.bool"),
    Mutant("causal_tile_mask", "tile mask sliced from fa_lab's",
           [("    rows = torch.arange(i0, i1)[:, None]\n", "    from fa_lab.reference import causal_mask\n"
             "    return causal_mask(seqlen_q, seqlen_k)[i0:i1, j0:j1]\n")], "fa_lab.reference.causal_mask"),
    Mutant("key_end", "key_end one too far", [(KEY_END, KEY_END[:-2] + " + 1))")], "one too far"),
    Mutant("key_end", "key_end one short", [(KEY_END, KEY_END[:-2] + " - 1))")], "one short"),
    Mutant("key_end", "key_end aligned top-left", [(KEY_END, "return min(seqlen_k, i1)")], "top-left"),
    Mutant("key_end", "key_end not clamped at 0", [(KEY_END, "return min(seqlen_k, i1 + seqlen_k - seqlen_q)")],
           "not clamped to 0"),
    Mutant("key_end", "key_end ignores causal", [("    if not causal:\n        return seqlen_k\n    " + KEY_END,
                                                  "    return seqlen_k")], "the loop may stop at"),
    Mutant("key_end", "key_end causal even without causal", [("    if not causal:\n        return seqlen_k\n", "")],
           "with causal=False every query sees every key"),
    Mutant("key_end", "key_end from fa_lab's BlockInfo",
           [("    if not causal:\n", "    from fa_lab.block_info import BlockInfo\n"
             "    return BlockInfo(seqlen_q, seqlen_k, causal).key_end(i1 - 1)\n    if not causal:\n")],
           "your function called fa_lab.block_info"),
    Mutant("key_end", "key_end as a float", [(KEY_END, f"return float({KEY_END[7:]})")], "expected an int"),
    Mutant("flash_forward", "accumulator not rescaled", [("acc = alpha[..., None] * acc + ", "acc = acc + ")],
           "accumulator is not rescaled"),
    Mutant("flash_forward", "l not rescaled", [("l = alpha * l + p.sum(dim=-1)", "l = l + p.sum(dim=-1)")],
           "l is not rescaled"),
    Mutant("flash_forward", "rescale with the wrong sign",
           [("alpha = torch.exp(m - m_safe)", "alpha = torch.exp(m_safe - m)")], "wrong sign"),
    Mutant("flash_forward", "no max subtraction, so large scores overflow",
           [("p = torch.exp(s - m_safe[..., None])", "p = torch.exp(s)"),
            ("alpha = torch.exp(m - m_safe)", "alpha = torch.ones_like(m)"),
            ("lse[..., i0:i1] = m + torch.log(l)", "lse[..., i0:i1] = torch.log(l)")], "overflow"),
    Mutant("flash_forward", "lse in log2",
           [("lse[..., i0:i1] = m + torch.log(l)", "lse[..., i0:i1] = (m + torch.log(l)) / math.log(2)"),
            ("def flash_forward(", "import math\n\n\ndef flash_forward(")], "log base 2"),
    Mutant("flash_forward", "causal mask off by one",
           [("causal_tile_mask", TILE_MASK, TILE_MASK + " + 1"), ("key_end", KEY_END, KEY_END[:-2] + " + 1))")],
           "off by one"),
    Mutant("flash_forward", "causal mask misses the diagonal",
           [("causal_tile_mask", TILE_MASK, "return cols < rows + (seqlen_k - seqlen_q)")], "off by one"),
    Mutant("flash_forward", "causal mask aligned top-left",
           [("causal_tile_mask", TILE_MASK, "return cols <= rows"), ("key_end", KEY_END, "return min(seqlen_k, i1)")],
           "top-left"),
    Mutant("flash_forward", "tile mask aligned top-left, key loop right",
           [("causal_tile_mask", TILE_MASK, "return cols <= rows")], "top-left"),
    Mutant("flash_forward", "tile mask in tile coordinates",
           [("causal_tile_mask", "rows = torch.arange(i0, i1)", "rows = torch.arange(i1 - i0)"),
            ("causal_tile_mask", "cols = torch.arange(j0, j1)", "cols = torch.arange(j1 - j0)")],
           "positions inside the tile"),
    Mutant("flash_forward", "key loop one key short", [("key_end", KEY_END, KEY_END[:-2] + " - 1))")],
           "one key too early", never=("the last key block is ignored",)),
    Mutant("flash_forward", "key loop ends with the first row's keys",
           [(KEY_LOOP, KEY_LOOP.replace("key_end(i1", "key_end(i0"))], "first row's keys",
           never=("the last query block",)),
    Mutant("flash_forward", "last, shorter key block skipped",
           [(KEY_LOOP, KEY_LOOP.replace("causal), block_k)", "causal) - block_k + 1, block_k)"))],
           "shorter than block_k"),
    Mutant("flash_forward", "last, shorter query block skipped",
           [(QUERY_LOOP, "for i0 in range(0, seqlen_q - block_q + 1, block_q):")], "is never computed"),
    Mutant("flash_forward", "last query block skipped, out and lse left empty",
           [(QUERY_LOOP, "for i0 in range(0, seqlen_q - block_q + 1, block_q):"),
            ("out = torch.zeros(q.shape, dtype=q.dtype)", "out = torch.empty(q.shape, dtype=q.dtype)"),
            ("lse = torch.zeros(q.shape[:-1])", "lse = torch.empty(q.shape[:-1])")],
           "Largest error", never=("exp overflowed", "only the last query block")),
    Mutant("flash_forward", "running max never updated", [("            m = m_new\n", "")], "never updated"),
    Mutant("flash_forward", "scale applied twice",
           [("s = q_tile @ k[..., j0:j1, :].float().transpose(-2, -1)",
             "s = q_tile @ k[..., j0:j1, :].float().transpose(-2, -1) * scale")], "scale is applied twice"),
    Mutant("flash_forward", "no guard for queries that see no key", [NO_KEY], "see no key",
           never=("Every failing case is causal",)),
    Mutant("flash_forward", "out not normalized", [(NO_KEY[0], "acc")], "not normalized"),
    Mutant("flash_forward", "the whole score matrix at once",
           [(QUERY_LOOP, "block_q = block_k = max(seqlen_q, seqlen_k)\n    " + QUERY_LOOP)], "tile"),
    Mutant("flash_backward", "D term missing", [(DS, "ds = p * (do_tile @ v_tile.transpose(-2, -1))")],
           "D term is missing"),
    Mutant("flash_backward", "D summed per key tile",
           [(DS, "dp = do_tile @ v_tile.transpose(-2, -1)\n"
                 "            ds = p * (dp - (p * dp).sum(dim=-1, keepdim=True))")], "each key tile only",
           never=("only the last query block",)),
    Mutant("flash_backward", "D = rowsum(dO)",
           [("delta = (dout.float() * out.float()).sum(dim=-1)", "delta = dout.float().sum(dim=-1)")], "without O"),
    Mutant("flash_backward", "dS with the wrong sign",
           [(DS, "ds = p * (delta[..., i0:i1, None] - do_tile @ v_tile.transpose(-2, -1))")],
           "dS has the wrong sign"),
    Mutant("flash_backward", "dP from K instead of V", [(DS, DS.replace("v_tile.transpose", "k_tile.transpose"))],
           "dv is right, so your P is right"),
    Mutant("flash_backward", "scale missing in dq and dk",
           [(DQ, DQ.replace(" * scale", "")), (DK, DK.replace(" * scale", ""))], "miss the softmax scale"),
    Mutant("flash_backward", "scale missing in dk", [(DK, DK.replace(" * scale", ""))], "look at dk = scale"),
    Mutant("flash_backward", "scale applied to dv too", [(DV, DV + " * scale")], "dq and dk are right but dv"),
    Mutant("flash_backward", "scale applied twice when recomputing S",
           [("s = (q_tile @ k_tile.transpose(-2, -1)) * scale",
             "s = (q_tile * scale @ k_tile.transpose(-2, -1)) * scale")], "scale is applied twice"),
    Mutant("flash_backward", "causal mask forgotten in the backward",
           [("            if causal:\n                s = s.masked_fill("
             "~causal_tile_mask(i0, i1, j0, j1, seqlen_q, seqlen_k), float(\"-inf\"))\n"
             "            p = torch.exp(s - lse", "            p = torch.exp(s - lse")], "causal"),
    Mutant("flash_backward", "no guard for an lse of -inf",
           [('lse = torch.where(torch.isinf(lse), float("inf"), lse)', "")], "+inf in place of an lse of -inf",
           never=("Every failing case is causal",)),
    Mutant("flash_backward", "dq overwritten", [(DQ, DQ.replace("+=", "="))], "dq is overwritten"),
    Mutant("flash_backward", "dk overwritten", [(DK, DK.replace("+=", "="))], "dk is overwritten"),
    Mutant("flash_backward", "dv overwritten", [(DV, DV.replace("+=", "="))], "dv is overwritten"),
    Mutant("flash_backward", "last, shorter query block skipped",
           [(QUERY_LOOP, "for i0 in range(0, seqlen_q - block_q + 1, block_q):")], "is never computed",
           never=("only the last query block is wrong",)),
    Mutant("flash_backward", "key loop one key short", [("key_end", KEY_END, KEY_END[:-2] + " - 1))")],
           "one key too early"),
    Mutant("autograd_function", "gradients in the wrong order",
           [("return dq, dk, dv, None, None", "return dk, dq, dv, None, None")], "order"),
    Mutant("autograd_function", "too few gradients", [("return dq, dk, dv, None, None", "return dq, dk, dv")],
           "None for each non-tensor input"),
    Mutant("autograd_function", "causal not passed to the backward",
           [(BACKWARD, BACKWARD.replace("ctx.causal", "False"))], "backward does not get causal",
           never=("Every failing case is causal",)),
    Mutant("autograd_function", "causal not passed to the forward", [(FORWARD, FORWARD.replace("causal", "False"))],
           "forward does not pass causal"),
    Mutant("autograd_function", "causal passed to neither",
           [(FORWARD, FORWARD.replace("causal", "False")), (BACKWARD, BACKWARD.replace("ctx.causal", "False"))],
           "causal is ignored"),
    Mutant("autograd_function", "scale not passed to the backward",
           [(BACKWARD, BACKWARD.replace(", ctx.scale", ""))], "backward does not get the scale",
           never=("Every failing case is causal",)),
    Mutant("autograd_function", "scale not passed to the forward", [(FORWARD, FORWARD.replace(", scale", ""))],
           "forward does not pass the scale", never=("Every failing case is causal",)),
    Mutant("autograd_function", "grad_out ignored",
           [(BACKWARD, BACKWARD.replace("lse, dout", "lse, torch.ones_like(dout)"))], "grad_out"),
]


@pytest.mark.parametrize("exercise", LAB.exercise_names)
def test_solution_passes_public_and_hidden_cases(exercise):
    LAB.assert_solution_passes(exercise)


@pytest.mark.parametrize("mutant", mutant_params(MUTANTS))
def test_mutant_fails_with_its_diagnosis(mutant):
    LAB.assert_mutant_diagnosed(mutant)


def test_the_causal_hint_comes_only_when_no_cause_was_found():
    """A causal mask no known mistake explains gets the hint "look at your causal mask"."""
    exercise = LAB.exercise("flash_forward")
    odd_mask = "return (cols <= rows + (seqlen_k - seqlen_q)) | ((rows + cols) % 7 == 0)"
    namespace = LAB.namespace([("causal_tile_mask", TILE_MASK, odd_mask)])
    results = LAB.results("flash_forward", namespace)
    failing = [verdict for _, verdict in results if not verdict.passed]
    assert failing and not any(verdict.explained for verdict in failing)
    assert "look at your causal mask" in summary_hint(exercise, results)


def test_the_autograd_cases_are_named_without_block_sizes():
    """FlashAttentionFunction.apply takes no block sizes, so its cases name none, nor any tiles."""
    names = [case.name for case in LAB.exercise("autograd_function").cases(seed=3)]
    assert names and not any("blocks" in name or "tile" in name for name in names)
    assert all("blocks" in case.name for case in LAB.exercise("flash_forward").cases())


def test_a_whole_causal_mask_breaks_the_tile_limit():
    """A tile mask sliced from the whole (Nq, Nk) mask builds a tensor as large as the score matrix."""
    LAB.assert_mutant_diagnosed(Mutant("flash_forward", "the whole causal mask, sliced",
                                       [("causal_tile_mask", TILE_BODY, WHOLE_MASK_SLICED)], "tile by tile"))
