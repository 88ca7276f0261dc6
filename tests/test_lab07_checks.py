"""Lab 07's checks accept the solution and reject typical wrong solutions with the right diagnosis.

Every mutant is the solution notebook's own code with one edit a learner might make (the test fails
if the edit no longer applies), run in-process through the same judges the grader uses, on the public
cases and the hidden cases of two seeds.
"""
from __future__ import annotations

import pytest
from labkit import LabChecks, Mutant, mutant_params

LAB = LabChecks("lab07", prelude="import torch\n\n")


@pytest.mark.parametrize("exercise", LAB.exercise_names)
def test_solution_passes_public_and_hidden_cases(exercise):
    LAB.assert_solution_passes(exercise, seeds=(3, 4, 5))


ACC = "acc = alpha[..., None] * acc + torch.matmul(p, v[b, g, j0:j1].float())"
ALPHA = "alpha = torch.exp(m - m_safe)"
CAUSAL = "s = s.masked_fill(cols > rows + seqlen_k - seqlen_q, float(\"-inf\"))"
POSITIONS = "rows, cols = torch.arange(i0, i1)[:, None], torch.arange(j0, j1)[None, :]"
KEYS = "j0, j1 = tile * block_k, min(tile * block_k + block_k, seqlen_k)"
LSE = "lse[b, members, i0:i1] = torch.where(l > 0, m + torch.log(l), float(\"-inf\"))"
OUT = "out[b, members, i0:i1] = acc / torch.where(l > 0, l, 1.0)[..., None]"
VIEW = "sums = padded.view(batch, heads, blocks, block, head_dim).sum(dim=3)"
DIVIDE = "return sums / counts[:, None]"
PAST = "past = torch.arange(pooled.shape[2])[None, :] < own[:, None]"
TOPK = "best = scores.masked_fill(~past, float(\"-inf\")).topk(top_k - 1, dim=-1)"
RETURN_GATE = "return torch.cat([own.expand(*q.shape[:2], seqlen)[..., None], chosen], dim=-1)"
MERGE_LSE = "lse = torch.logaddexp(lse_own, lse_past)  # finite: a query always sees itself"
W_OWN, W_PAST = "torch.exp(lse_own - lse)[..., None]", "torch.exp(lse_past - lse)[..., None]"
MERGE_OUT = ("out = (torch.exp(lse_own - lse)[..., None] * out_own.float()\n"
             "           + torch.exp(lse_past - lse)[..., None] * out_past.float())")
PASS_1 = "own_tiles, block, block, causal=True"
PASS_2 = "selected[..., 1:], 1, block, causal=False"
# (exercise, what the learner got wrong, edits of the solution, words the diagnosis must contain)
CASES = [
    ("block_sparse_forward", "no rescale of acc",
     [("block_sparse_forward", ACC, ACC.replace("alpha[..., None] * acc", "acc"))], "accumulator is not rescaled"),
    ("block_sparse_forward", "rescale with the wrong sign",
     [("block_sparse_forward", ALPHA, "alpha = torch.exp(m_safe - m)")], "wrong sign"),
    ("block_sparse_forward", "running max never updated",
     [("block_sparse_forward", "                    m = m_new\n", "")], "never updated"),
    ("block_sparse_forward", "causal mask in tile coordinates",
     [("block_sparse_forward", POSITIONS,
       "rows, cols = torch.arange(i1 - i0)[:, None], torch.arange(j1 - j0)[None, :]")], "positions inside the tile"),
    ("block_sparse_forward", "causal mask top-left",
     [("block_sparse_forward", CAUSAL, CAUSAL.replace("rows + seqlen_k - seqlen_q", "rows"))], "top-left"),
    ("block_sparse_forward", "causal mask off by one",
     [("block_sparse_forward", CAUSAL, CAUSAL.replace("cols > rows", "cols >= rows"))],
     "misses the key on its diagonal"),
    ("block_sparse_forward", "query heads h % heads_kv",
     [("block_sparse_forward", "members = slice(g * group, (g + 1) * group)", "members = slice(g, heads, heads_kv)")],
     "wrong KV head"),
    ("block_sparse_forward", "a tile index used as its first key",
     [("block_sparse_forward", KEYS, "j0, j1 = tile, min(tile + block_k, seqlen_k)")], "is read as keys t"),
    ("block_sparse_forward", "stops at the first unused slot",
     [("block_sparse_forward", "continue  # an unused slot", "break  # an unused slot")], "stops at the first -1"),
    ("block_sparse_forward", "lse is the running max",
     [("block_sparse_forward", LSE, LSE.replace("m + torch.log(l)", "m"))], "only the running max"),
    ("block_sparse_forward", "not normalized",
     [("block_sparse_forward", OUT, "out[b, members, i0:i1] = acc")], "not normalized"),
    ("block_sparse_forward", "a dense causal mask",
     [("block_sparse_forward", CAUSAL, "dense = torch.arange(seqlen_k)[None, :] <= torch.arange(seqlen_q)[:, None] + "
       "seqlen_k - seqlen_q\n                        s = s.masked_fill(~dense[i0:i1, j0:j1], float(\"-inf\"))")],
     "created a tensor of"),
    ("block_sparse_forward", "no guard for rows without keys",
     [("block_sparse_forward", "m_safe = torch.where(torch.isinf(m_new), 0.0, m_new)", "m_safe = m_new")], "NaN"),
    ("mean_pool_blocks", "pooled over the wrong axis",
     [("mean_pool_blocks", VIEW, "sums = padded.view(batch, heads, block, blocks, head_dim).sum(dim=2)")],
     "wrong tokens"),
    ("mean_pool_blocks", "padding counted in the last block's mean",
     [("mean_pool_blocks", DIVIDE, "return sums / block")], "counting the padding"),
    ("mean_pool_blocks", "last partial block dropped",
     [("mean_pool_blocks", "blocks = -(-seqlen // block)", "blocks = seqlen // block")], "partial block"),
    ("mean_pool_blocks", "averaged over head_dim",
     [("mean_pool_blocks", VIEW, VIEW.replace("sum(dim=3)", "sum(dim=-1)"))], "head_dim"),
    ("mean_pool_blocks", "the sum, not the mean", [("mean_pool_blocks", DIVIDE, "return sums")], "sum"),
    ("moba_gate", "own block not forced",
     [("moba_gate", PAST, PAST.replace("<", "<=")), ("moba_gate", TOPK, TOPK.replace("top_k - 1", "top_k")),
      ("moba_gate", RETURN_GATE, "return chosen")], "column 0 must be its own block"),
    ("moba_gate", "future blocks selectable", [("moba_gate", PAST, PAST.replace("<", "!="))], "after its own block"),
    ("moba_gate", "own block ranked among the past", [("moba_gate", PAST, PAST.replace("<", "<="))], "again"),
    ("moba_gate", "no -1 for the slots of -inf scores",
     [("moba_gate", "chosen = torch.where(torch.isinf(best.values), -1, best.indices)", "chosen = best.indices")],
     "Put -1"),
    ("moba_gate", "top_k past blocks besides the own one",
     [("moba_gate", TOPK, TOPK.replace("top_k - 1", "top_k"))], "counts the own block"),
    ("moba_gate", "mean keys pooled over the wrong axis",
     [("mean_pool_blocks", VIEW, "sums = padded.view(batch, heads, block, blocks, head_dim).sum(dim=2)")],
     "pooled over the wrong tokens"),
    ("moba_attention", "merge without subtracting the max",
     [("moba_attention", MERGE_LSE, "total = torch.exp(lse_own) + torch.exp(lse_past)\n    lse = torch.log(total)"),
      ("moba_attention", W_OWN, "(torch.exp(lse_own) / total)[..., None]"),
      ("moba_attention", W_PAST, "(torch.exp(lse_past) / total)[..., None]")], "without subtracting"),
    ("moba_attention", "merge weights not normalized",
     [("moba_attention", MERGE_LSE, MERGE_LSE + "\n    top = torch.maximum(lse_own, lse_past)"),
      ("moba_attention", W_OWN, W_OWN.replace("- lse)", "- top)")),
      ("moba_attention", W_PAST, W_PAST.replace("- lse)", "- top)"))], "not normalized"),
    ("moba_attention", "merged lse is the max",
     [("moba_attention", MERGE_LSE, "lse = torch.maximum(lse_own, lse_past)")], "larger of the two"),
    ("moba_attention", "both passes weigh the same",
     [("moba_attention", MERGE_OUT, "out = (out_own.float() + out_past.float()) / 2")], "weigh the same"),
    ("moba_attention", "own block not causal",
     [("moba_attention", PASS_1, PASS_1.replace("causal=True", "causal=False"))], "pass 1 is not causal"),
    ("moba_attention", "own block in pass 2 too",
     [("moba_attention", PASS_2, PASS_2.replace("selected[..., 1:]", "selected"))], "counted twice"),
]
MUTANTS = [Mutant(exercise, mistake, edits, words, seeds=(11, 12)) for exercise, mistake, edits, words in CASES]


@pytest.mark.parametrize("mutant", mutant_params(MUTANTS))
def test_mutant_fails_with_its_diagnosis(mutant):
    LAB.assert_mutant_diagnosed(mutant)
