#!/usr/bin/env bash
# What ran on an H200 machine (no network, no Jupyter) to produce the files in benchmarks/ and the gpu tests.
# Usage there, from the repository root:  bash benchmarks/run_device.sh STEP OUTDIR
#   tune   - time candidate tile configurations of the Triton kernels at 8K (h200_triton_tuning.json),
#            then the protocol with them; the winners go into fa_lab/kernels/portable/configs.py
#   bench  - the FA3-paper protocol with every peer and the committed tiles: h200_triton.json/.png
#   hopper - the Hopper kernel's variants (ablation), FP8 errors, and its protocol at d = 128 and 64 with peers
#            (fa4 too when installed first, as for interfaces): h200_hopper.json, h200_hopper.png,
#            h200_hopper_variants.json; arguments after OUTDIR go to the command (e.g. --head-dims 128). A run cut
#            short by the call's limit is finished by `fa-lab bench hopper --json FILE --resume` on its file
#   interfaces - chapter 05's cases (GQA, varlen, window, softcap, ALiBi) with the upstream kernels
#            (fa4, installed first as ../shared/peers/fetch_fa4_wheels.sh says): h200_interfaces.json/.png
#   decode - chapter 06's decode over dense and paged caches, the split sweep, chunked prefill, with
#            SDPA and fa4: h200_decode.json/.png
#   sparse - chapter 07's NSA selected-blocks branch with fla-core's kernel (its wheel carried as the
#            device README says, on PYTHONPATH) and dense attention: h200_sparse.json/.png
#   linear - chapter 08's chunkwise kernels with fla-core's (its wheel carried as for sparse) and softmax
#            attention: h200_linear.json/.png
#   ring   - chapter 09's ring steps timed on one GPU, shard copies, NCCL at world size 1, and the
#            modelled overlap for 2-8 GPUs (h200_ring_model.json)
#   ring-gpus - ring attention over every GPU of a multi-GPU host (positions per GPU: --tokens), as
#            fa_lab/bench/ring_gpus.py says (h200x{N}_ring.json); arguments after OUTDIR go to the command
#   decode-tma - batch 32 in one split over a dense cache: TMA reads at six configs against the shipped kernel and
#            SDPA, interleaved rounds (h200_decode_tma.json, by benchmarks/decode_tma_probe.py)
#   decode-tune - the decode kernel's candidate configs x split counts (h200_decode_tuning.json); the
#            winners go into fa_lab/kernels/portable/decode.py
#   fp8-quant - the FP8 quantization pass against a copy, at six launches (and an earlier kernel: --before FILE, whose
#            column notebook 04 reads), and FP8 end to end (benchmarks/fp8_quant_bandwidth.py): fp8_quant.json,
#            committed as h200_fp8_quant.json
#   training-memory - one training step's peak memory, 8K-64K, ours beside SDPA's and fa4 (installed as for
#            interfaces): h200_training_memory.json/.png (benchmarks/training_memory.py)
#   backward - the Gluon FA3 backward against the portable one, SDPA's and flash-attn-4's (installed first as for
#            interfaces): h200_backward.json/.png (benchmarks/fa3_backward.py)
#   backward-dq - the Gluon backward's dQ schemes (every DQ_MODES entry) against each other (h200_backward_dq.json, by
#            benchmarks/fa3_backward.py dq)
#   backward-rows - its steps of 64 and 128 query rows at d = 64 against each other (h200_backward_rows.json)
#   backward-row-vectors - its lse2 and D rows loaded by each consumer or brought by the producer
#            (h200_backward_row_vectors.json)
#   varlen-row-vectors - the same on the interfaces benchmark's packed batch (h200_varlen_row_vectors.json)
#   backward-head-groups - its causal CTAs head by head against in groups of heads, key tile by key tile
#            (h200_backward_head_groups.json)
#   backward-rows-ahead - its producer loading each step's lse2 and D one step ahead against after its wait for the
#            slot (h200_backward_rows_ahead.json)
#   backward-kv-split - chapter 05's grouped-query backward with its group split over 1, 2 and 4 CTAs
#            (h200_backward_kv_split.json)
#   three-consumers - the d = 64 forward with two consumer warpgroups against three (h200_three_consumers.json, by
#            benchmarks/three_consumers_ab.py)
#   persistent-bf16 - the bf16 Gluon forward, one CTA per work tile against the persistent kernel, on the protocol's
#            shapes, three rounds (h200_persistent_bf16.json, by benchmarks/persistent_bf16_ab.py)
#   split-loops - the bf16 Gluon forward, one K/V loop against three (HopperOptions(split_loops=True)), on the
#            protocol's shapes and the window (1024, 0) at 16K, three rounds (h200_split_loops.json, by
#            benchmarks/forward_switch_ab.py)
#   split-loops-fp8 - the same for the FP8 kernel alone, d = 128 and 64, 4K-16K (h200_split_loops_fp8.json)
#   fp8-loop-variants - the FP8 kernel alone with one loop and three, convert_p_late, rescale_early and the v_next
#            edit, d = 128 (<h100|h200>_fp8_loop_variants.json, by benchmarks/fp8_loop_variants_ab.py)
#   rescale-early, rescale-early-fp8 - the same two A/Bs for HopperOptions(rescale_early=True) against the default
#            (h200_rescale_early.json, h200_rescale_early_fp8.json)
#   persistent-host - the bf16 forward at 1K-4K one tile per CTA and persistent: do_bench's time, the kernel's and
#            the host's per call (h200_persistent_host_bound.log, by benchmarks/persistent_host_bound.py)
#   moba-gate - MoBA's gate, PyTorch's against the kernel's, and the kernel at two tile heights and warp counts
#            (h200_moba_gate.json, by benchmarks/moba_gate_variants.py)
#   nsa-dq-warps - NSA's selected-blocks backward with its dQ kernel at 8, 4 and 2 warps (h200_nsa_dq_warps.json,
#            by benchmarks/nsa_dq_warps.py)
#   nsa-importance - NSA's importance kernel at three packings of its tile, beside topk, the compressed branch and NSA's
#            forward (h200_nsa_importance.json, by benchmarks/nsa_importance_tiles.py)
#   nsa-importance-tiles - the importance kernel keeping its running top at other tiles, warps and stages
#            (h200_nsa_importance_tiles.json, by benchmarks/nsa_importance_tiles.py --tiles)
#   nsa-importance-full-steps - the importance kernel keeping its top with the steps every row of a tile sees unmasked
#            and masked, then NSA's forward both ways, in turn (<h100|h200>_nsa_importance_full_steps.json, by
#            benchmarks/nsa_importance_tiles.py --full-steps)
#   nsa-importance-registers - the importance kernel keeping its top at other register budgets and stages, then NSA's
#            forward with the settings for two and for three programs an SM, in turn (<h100|h200>_nsa_importance_registers.json, by
#            benchmarks/nsa_importance_tiles.py --registers; with -64k, the first and last settings and NSA's forward at 64K alone)
#   nsa-select-tiles - NSA's selected-blocks forward at other warps and stages (h200_nsa_select_tiles.json, by
#            benchmarks/nsa_select_tiles.py)
#   nsa-top - NSA's forward with its selection's top kept in the importance kernel against torch.topk, in turn, beside
#            dense attention (h200_nsa_top_ab.json, by benchmarks/nsa_top_ab.py)
#   nsa-read-probe - NSA's selected blocks read and summed by bare pointer loads and by TMA copies, beside the
#            selected-blocks forward, in TB/s (<h100|h200>_nsa_read_probe.json, by benchmarks/nsa_read_probe.py)
#   window-backward - a window's backward on the Gluon kernel against the portable one, the interfaces' window and
#            NSA's window branch, in turn (<h100|h200>_window_backward_ab.json, by benchmarks/window_backward_ab.py)
#   backward-breakdown - the backward's kernels one by one, triton_hopper against flash-attn-4 (installed first as for
#            interfaces), at the interfaces' MHA shapes, 16K causal and the protocol's 16 heads at 16K
#            (<h100|h200>_backward_breakdown.json, by benchmarks/backward_breakdown.py)
#   nsa-checks - NSA's forward (and backward) with its own selection checked as a caller's against passed on
#            unchecked, in turn (<h100|h200>_nsa_checks_ab.json, by benchmarks/nsa_checks_ab.py)
#   softcap-variants - the Gluon forward's soft cap before the row max (shipped), after it, with Q scaled before the
#            kernel, and both, beside the uncapped forward, in turn (<h100|h200>_softcap_variants.json, by
#            benchmarks/softcap_variants_ab.py)
#   ncu-profile - Nsight Compute on one call of a forward or backward per named profile (ours and flash-attn-4's, the
#            latter installed first as for interfaces): pipes, warp states and each SASS instruction's stall samples
#            (<profile>_raw.csv, <profile>_sass.csv in ncu_profiles.tgz, by benchmarks/kernel_profile.py); arguments
#            after OUTDIR name the profiles (default: every one)
#   exp2-on-fma - the Gluon forward with 0, 1 and 2 of every four exponentials on the FMA units instead of the MUFU:
#            bf16 d = 128 and 64, the soft cap, the FP8 kernel, in turn (<h100|h200>_exp2_on_fma.json, by
#            benchmarks/exp2_on_fma_ab.py)
#   nsa-overlap - NSA's window branch beside its selected branch on two streams, the window's persistent CTAs on
#            fewer SMs (<h100|h200>_nsa_overlap_probe.json, by benchmarks/nsa_overlap_probe.py)
#   nsa-compressed - NSA's compressed branch through residue views against the folded layout it replaced: two trees
#            of the code in alternating processes, two rounds (nsa_compressed_ab.json, by benchmarks/nsa_compressed_ab.py);
#            the argument after OUTDIR is the old tree, a directory holding `git archive 4a36a68 fa_lab` unpacked
#   decode-check-ab - the default call's value check read back first against decided on the device, and the
#            unchecked call (h200_decode_check_ab.json, by benchmarks/decode_check_ab.py)
#   gqa-mha-ab - grouped-query attention (32 / 8 heads) against MHA, triton_hopper forward and backward, in turn for
#            three rounds at the interfaces shapes (h200_gqa_mha_ab.json, by benchmarks/gqa_mha_ab.py)
#   window-variants - the window (1024, 0) at 16K through each switch of the Gluon forward, and dense
#            (h200_window_variants.json, by benchmarks/window_variants.py)
#   nsa-dkdv-variants - NSA's dK/dV gather at other tiles, warps and stages, fla's NSA backward kernel by kernel,
#            MoBA's forward wall time against its kernels' (h200_nsa_dkdv_variants.json, by
#            benchmarks/nsa_dkdv_variants.py; fla-core on PYTHONPATH as for sparse)
#   nsa-gather-order - the dK/dV gather's programs heads innermost against head row by head row
#            (h200_nsa_gather_order.json, by benchmarks/nsa_dkdv_variants.py --order)
#   sparse-bars - the sparse run's bar ratios alone (NSA and MoBA against dense attention at 64K, forward, in turn,
#            three rounds): <h100|h200>_sparse_bars_in_turn.json, by benchmarks/sparse_bars_in_turn.py
#   moba-gaps - MoBA's forward at 64K with its gate beside pass 1, on one stream and precomputed, pass 1 persistent
#            with SMs spare, beside dense; its idle GPU time and kernels (h200_moba_forward_gaps.json, by
#            benchmarks/moba_forward_gaps.py)
#   notebooks - notebooks 02-04's code cells as scripts (benchmarks/notebook_as_script.py: the machine has no Jupyter),
#            so their live branches run on the GPU: notebooks_on_gpu.log and the figures under OUTDIR/notebooks
#            (the arguments after OUTDIR: other notebooks instead)
#   tests  - the `gpu`-marked tests (correctness matrix, repeat test) with the committed tiles; on the
#            H200 they take about 11 minutes: `tests tests/test_hopper.py` and the like run a part (the
#            arguments after OUTDIR go to pytest)
# The machine has no `fa-lab` script installed: `python3 -m fa_lab.cli bench ...` is `fa-lab bench ...`.
#   breakdown - every kernel's time per call, forward and backward: ours and fla's linear cases at 4K (after
#            peers-warm on the same machine, or fla autotunes first), our NSA selection, NSA and MoBA at 64K
#            (arguments after OUTDIR: linear or sparse alone)
#   linear-tune - our linear kernels at 2, 4 and 8 warps, every launch's time at 4K (h200_linear_tuning.json);
#            the winners go into LAUNCH_WARPS in fa_lab/kernels/portable/linear_launch.py
#   gla-tiles - GLA's h pass and score kernel over tile widths, warps and stages (h200_gla_tile_sweep.json, by
#            benchmarks/gla_tile_sweep.py); the winners go into linear_launch.h_pass_tiles, SCORE_BLOCK_K,
#            LAUNCH_WARPS and LAUNCH_STAGES
#   linear-stages - the same at num_stages 1 to 4 and the committed warps (h200_linear_stages.json; arguments after
#            OUTDIR go to the command, e.g. --cases delta_rule); the winners go into LAUNCH_STAGES
#   linear-bwd-sweep - the tiles, warps and stages of the launches the linear backward spends its time in
#            (benchmarks/linear_bwd_sweep.py; arguments after OUTDIR: a time budget in seconds, then sweep names):
#            h200_linear_bwd_sweep.json; the winners go into linear_chunk's tables and tiles
#   peers-warm - fla-core's linear kernels autotuned (one process per case, at once) at the benchmark's 4K shape,
#            so that a later `linear` compiles one config per kernel instead of every candidate
# Triton's cache is .device/triton-cache (git-ignored): fla-core's kernels autotune for minutes on their first
# call (their choices do not depend on the sequence length) and store what they chose there, so each step
# packs those choices (*.autotune.json) into OUTDIR/triton-autotune.tgz, on exit and every minute while it
# runs; unpacked into a fresh machine's .device/triton-cache, they are reused there.
set -uo pipefail
step=$1; out=$2; shift 2
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.device/triton-cache}
mkdir -p "$TRITON_CACHE_DIR"
save_autotune() { (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | tar -czf "$out/triton-autotune.tgz.part" -T - \
                   && mv "$out/triton-autotune.tgz.part" "$out/triton-autotune.tgz"); }
( while sleep 60; do save_autotune; done ) & saver=$!
trap 'kill $saver 2>/dev/null; save_autotune' EXIT
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee -a "$out/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/device.txt"
bench="python3 -m fa_lab.cli bench"
case "$step" in
  tune)  $bench gpu --tune "$out/h200_triton_tuning.json" --json "$out/h200_triton.json" \
           --plot "$out/h200_triton.png" 2>&1 | tee "$out/tune.log" | grep -v "^bench" ;;
  bench) $bench gpu --json "$out/h200_triton.json" --plot "$out/h200_triton.png" \
           2>&1 | tee "$out/bench.log" | grep -v "^bench" ;;
  hopper) $bench hopper --json "$out/h200_hopper.json" --plot "$out/h200_hopper.png" \
           --log "$out/h200_hopper_variants.json" "$@" 2>&1 | tee "$out/hopper.log" | grep -v "^bench" ;;
  interfaces) $bench interfaces --json "$out/h200_interfaces.json" --plot "$out/h200_interfaces.png" \
           2>&1 | tee "$out/interfaces.log" | grep -v "^bench" ;;
  sparse) $bench sparse --json "$out/h200_sparse.json" --plot "$out/h200_sparse.png" "$@" \
           2>&1 | tee "$out/sparse.log" | grep -v "^bench" ;;
  linear) $bench linear --json "$out/h200_linear.json" --plot "$out/h200_linear.png" "$@" \
           2>&1 | tee "$out/linear.log" | grep -v "^bench" ;;
  linear-tune) $bench linear --tune "$out/h200_linear_tuning.json" 2>&1 | tee "$out/linear_tune.log" ;;
  linear-stages) $bench linear --tune "$out/h200_linear_stages.json" --stages 1 2 3 4 "$@" 2>&1 | tee "$out/linear_stages.log" ;;
  breakdown) parts=("$@"); [ ${#parts[@]} -gt 0 ] || parts=(linear sparse)
         for part in "${parts[@]}"; do $bench "$part" --breakdown 2>&1 | tee "$out/${part}_breakdown.log"; done ;;
  gla-tiles) python3 benchmarks/gla_tile_sweep.py "$out/h200_gla_tile_sweep.json" 2>&1 | tee "$out/gla_tiles.log" ;;
  linear-bwd-sweep) python3 benchmarks/linear_bwd_sweep.py "$out/h200_linear_bwd_sweep.json" "$@" 2>&1 \
           | tee "$out/linear_bwd_sweep.log" ;;
  peers-warm) for case in simple_gla gla delta_rule; do
           $bench linear --cases $case --seqlens 4096 > "$out/peers_warm_$case.log" 2>&1 & done; wait ;;
  ring) NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
           $bench ring --json "$out/h200_ring_model.json" 2>&1 | tee "$out/ring.log" | grep -v "^bench" ;;
  ring-gpus) gpus=$(nvidia-smi --list-gpus | wc -l)
         NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
           $bench ring --gpus "$gpus" --json "$out/h200x${gpus}_ring.json" "$@" 2>&1 | tee "$out/ring_gpus.log" ;;
  decode-tune) $bench decode --tune "$out/h200_decode_tuning.json" 2>&1 | tee "$out/decode_tune.log" | grep -v "^bench" ;;
  decode) $bench decode --json "$out/h200_decode.json" --plot "$out/h200_decode.png" \
           2>&1 | tee "$out/decode.log" | grep -v "^bench" ;;
  decode-tma) python3 benchmarks/decode_tma_probe.py "$out/h200_decode_tma.json" ;;
  fp8-quant) OUT="$out" python3 benchmarks/fp8_quant_bandwidth.py "$@" 2>&1 | tee "$out/fp8_quant.log" ;;
  training-memory) python3 benchmarks/training_memory.py run "$out" 2>&1 | tee "$out/training_memory.log"
         python3 benchmarks/training_memory.py plot "$out/h200_training_memory.json" "$out/h200_training_memory.png" ;;
  backward-dq) python3 benchmarks/fa3_backward.py dq "$out" 2>&1 | tee "$out/backward_dq.log" ;;
  backward-rows) python3 benchmarks/fa3_backward.py rows "$out" 2>&1 | tee "$out/backward_rows.log" ;;
  backward-row-vectors) python3 benchmarks/fa3_backward.py row-vectors "$out" 2>&1 | tee "$out/backward_row_vectors.log" ;;
  backward-head-groups) python3 benchmarks/fa3_backward.py head-groups "$out" 2>&1 | tee "$out/backward_head_groups.log" ;;
  backward-rows-ahead) python3 benchmarks/fa3_backward.py rows-ahead "$out" 2>&1 | tee "$out/backward_rows_ahead.log" ;;
  backward-kv-split) python3 benchmarks/fa3_backward.py kv-split "$out" 2>&1 | tee "$out/backward_kv_split.log" ;;
  varlen-row-vectors) python3 benchmarks/fa3_backward.py varlen-row-vectors "$out" 2>&1 \
           | tee "$out/varlen_row_vectors.log" ;;
  backward) python3 benchmarks/fa3_backward.py run "$out" 2>&1 | tee "$out/backward.log"
         python3 benchmarks/fa3_backward.py plot "$out/h200_backward.json" "$out/h200_backward.png" ;;
  persistent-bf16) python3 benchmarks/persistent_bf16_ab.py "$out" 2>&1 | tee "$out/persistent_bf16.log" ;;
  split-loops) python3 benchmarks/forward_switch_ab.py "$out" 2>&1 | tee "$out/split_loops.log" ;;
  split-loops-fp8) python3 benchmarks/forward_switch_ab.py "$out" --fp8 2>&1 | tee "$out/split_loops_fp8.log" ;;
  rescale-early) python3 benchmarks/forward_switch_ab.py "$out" --switch rescale_early 2>&1 | tee "$out/rescale_early.log" ;;
  fp8-loop-variants) python3 benchmarks/fp8_loop_variants_ab.py "$out" ;;
  rescale-early-fp8) python3 benchmarks/forward_switch_ab.py "$out" --fp8 --switch rescale_early 2>&1 \
           | tee "$out/rescale_early_fp8.log" ;;
  persistent-host) python3 benchmarks/persistent_host_bound.py 2>&1 | tee "$out/h200_persistent_host_bound.log" ;;
  moba-gate) python3 benchmarks/moba_gate_variants.py "$out/h200_moba_gate.json" ;;
  nsa-importance) python3 benchmarks/nsa_importance_tiles.py "$out" 2>&1 | tee "$out/nsa_importance.log" ;;
  nsa-importance-tiles) python3 benchmarks/nsa_importance_tiles.py --tiles "$out" 2>&1 | tee "$out/nsa_importance_tiles.log" ;;
  nsa-importance-full-steps) python3 benchmarks/nsa_importance_tiles.py --full-steps "$out" 2>&1 \
           | tee "$out/nsa_importance_full_steps.log" ;;
  nsa-importance-registers) python3 benchmarks/nsa_importance_tiles.py --registers "$out" 2>&1 \
           | tee "$out/nsa_importance_registers.log" ;;
  nsa-importance-registers-64k) python3 benchmarks/nsa_importance_tiles.py --registers-64k "$out" 2>&1 \
           | tee "$out/nsa_importance_registers_64k.log" ;;
  nsa-select-tiles) python3 benchmarks/nsa_select_tiles.py "$out" "$@" 2>&1 | tee "$out/nsa_select_tiles.log" ;;
  nsa-top) python3 benchmarks/nsa_top_ab.py "$out" 2>&1 | tee "$out/nsa_top_ab.log" ;;
  window-backward) python3 benchmarks/window_backward_ab.py "$out" 2>&1 | tee "$out/window_backward_ab.log" ;;
  nsa-compressed) for round in 1 2; do for tree in "$1" .; do
                    PYTHONPATH="$tree:$PYTHONPATH" python3 benchmarks/nsa_compressed_ab.py "$out"; done; done \
                  2>&1 | tee "$out/nsa_compressed_ab.log" ;;
  backward-breakdown) python3 benchmarks/backward_breakdown.py "$out" "$@" 2>&1 | tee "$out/backward_breakdown.log" ;;
  nsa-checks) python3 benchmarks/nsa_checks_ab.py "$out" 2>&1 | tee "$out/nsa_checks_ab.log" ;;
  softcap-variants) python3 benchmarks/softcap_variants_ab.py "$out" "$@" 2>&1 | tee "$out/softcap_variants.log" ;;
  ncu-profile) rm -rf /tmp/ncu && mkdir -p /tmp/ncu  # (this call's pages only)
               for name in ${@:-$(python3 benchmarks/kernel_profile.py --list)}; do
                 ncu --clock-control none --profile-from-start off --section SpeedOfLight \
                     --section WarpStateStats --section SchedulerStats --section InstructionStats \
                     --section ComputeWorkloadAnalysis --section SourceCounters -f -o "/tmp/ncu/$name" \
                     python3 benchmarks/kernel_profile.py "$name" | grep -v "^==PROF== Profiling"
                 ncu -i "/tmp/ncu/$name.ncu-rep" --csv --page raw > "/tmp/ncu/${name}_raw.csv"
                 ncu -i "/tmp/ncu/$name.ncu-rep" --csv --page source --print-source sass > "/tmp/ncu/${name}_sass.csv"
               done 2>&1 | tail -40
               tar -C /tmp/ncu -czf "$out/ncu_profiles.tgz" $(cd /tmp/ncu && ls *.csv) ;;
  exp2-on-fma) python3 benchmarks/exp2_on_fma_ab.py "$out" "$@" 2>&1 | tee "$out/exp2_on_fma.log" ;;
  nsa-overlap) python3 benchmarks/nsa_overlap_probe.py "$out" 2>&1 | tee "$out/nsa_overlap_probe.log" ;;
  nsa-read-probe) python3 benchmarks/nsa_read_probe.py "$out" 2>&1 | tee "$out/nsa_read_probe.log" ;;
  nsa-dq-warps) python3 benchmarks/nsa_dq_warps.py "$out" 2>&1 | tee "$out/nsa_dq_warps.log" ;;
  decode-check-ab) python3 benchmarks/decode_check_ab.py "$out" 2>&1 | tee "$out/decode_check_ab.log" ;;
  window-variants) python3 benchmarks/window_variants.py "$out" 2>&1 | tee "$out/window_variants.log" ;;
  gqa-mha-ab) OUT="$out" python3 benchmarks/gqa_mha_ab.py 2>&1 | tee "$out/gqa_mha_ab.log" ;;
  three-consumers) python3 benchmarks/three_consumers_ab.py "$out" 2>&1 | tee "$out/three_consumers.log" ;;
  moba-gaps) python3 benchmarks/moba_forward_gaps.py "$out" 2>&1 | tee "$out/moba_forward_gaps.log" ;;
  sparse-bars) python3 benchmarks/sparse_bars_in_turn.py "$out" 2>&1 | tee "$out/sparse_bars_in_turn.log" ;;
  notebooks) books=("$@"); [ ${#books[@]} -gt 0 ] || books=(notebooks/0[234]_*.ipynb)
         python3 benchmarks/notebook_as_script.py "$out/notebooks" "${books[@]}" 2>&1 | tee "$out/notebooks_on_gpu.log" ;;
  nsa-dkdv-variants) python3 benchmarks/nsa_dkdv_variants.py "$out" 2>&1 | tee "$out/nsa_dkdv_variants.log" ;;
  nsa-gather-order) python3 benchmarks/nsa_dkdv_variants.py --order "$out" 2>&1 | tee "$out/nsa_gather_order.log" ;;
  tests) targets=("$@"); [ ${#targets[@]} -gt 0 ] || targets=(tests)
         for arg in "${targets[@]}"; do  # -q would cancel -v, and a run cut by the call's limit would name nothing
           case "$arg" in -q|--quiet) echo "run_device.sh tests: drop $arg (results are named one per line)" >&2; exit 2 ;; esac
         done
         # -v names each result as it comes (a run cut by the call's limit keeps them); the log keeps the failures
         tests=(python3 -m pytest -v -rfE -m gpu -p no:cacheprovider --maxfail=30 "${targets[@]}")
         { echo "# $(date -u +%F), $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)," \
             "$(python3 -c "import torch, triton; print('torch', torch.__version__, '+ triton', triton.__version__)"): ${tests[*]}"
           "${tests[@]}" 2>&1; } | tee "$out/gpu_tests_verbose.log" | grep --line-buffered -vE "^[^ ]+::[^ ]+ $| (PASSED|SKIPPED) " \
           | tee "$out/gpu_tests.log" | tail -30 ;;
  *) echo "usage: bash benchmarks/run_device.sh tune|bench|hopper|interfaces|decode|decode-tma|decode-tune|fp8-quant|training-memory|backward|backward-dq|backward-rows|backward-row-vectors|varlen-row-vectors|backward-head-groups|backward-rows-ahead|backward-kv-split|persistent-bf16|split-loops|split-loops-fp8|rescale-early|rescale-early-fp8|fp8-loop-variants|persistent-host|moba-gate|nsa-importance|nsa-importance-full-steps|nsa-importance-registers|nsa-importance-registers-64k|nsa-top|nsa-compressed|nsa-checks|nsa-overlap|nsa-read-probe|window-backward|backward-breakdown|nsa-dq-warps|decode-check-ab|window-variants|gqa-mha-ab|three-consumers|nsa-dkdv-variants|nsa-gather-order|moba-gaps|sparse-bars|notebooks|sparse|linear|linear-tune|linear-stages|gla-tiles|linear-bwd-sweep|breakdown|peers-warm|ring|ring-gpus|tests OUTDIR" >&2; exit 2 ;;
esac
