"""The Gluon forward at chapter 05's soft-cap case (d = 128, 8K, batch 2 x 16 heads, bf16, no mask), with the cap or
without, called a few times for Nsight Compute to profile one launch: where a capped step's warps stall against an
uncapped step's (warp states, the MUFU pipe's load, issue slots), which the timed A/Bs could not show
(docs/experiments/interfaces.md, "Soft cap: ...").

On the device: ``bash benchmarks/run_device.sh softcap-profile $OUT`` runs it under ncu twice (softcap 0 and 30)
and writes $OUT/softcap_profile_<softcap>.ncu-rep and .csv (ncu's raw page: one row, the profiled launch).
"""
import argparse

CALLS = 4  # ncu skips the first launches (compilation, warm-up) and profiles the last


def main(softcap: float) -> None:
    import torch

    from fa_lab.kernels import load_triton
    from fa_lab.kernels.hopper.attention import HopperOptions, triton_hopper_attention

    load_triton()
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 16, 8192, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    given = dict(softcap=softcap) if softcap else {}
    with torch.no_grad():
        for _ in range(CALLS):
            triton_hopper_attention(q, k, v, False, None, options=HopperOptions(), **given)
    torch.cuda.synchronize()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--softcap", type=float, default=0.0)
    main(parser.parse_args().softcap)
