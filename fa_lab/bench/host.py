"""The host's time to issue a call: what an eager caller waits for when the GPU work is short."""
from __future__ import annotations

import time
from collections.abc import Callable


def host_us(call: Callable[[], object], calls: int = 100, rounds: int = 7, warmup: int = 10,
            synchronize: Callable[[], object] = lambda: None) -> tuple[float, float]:
    """(median, fastest) microseconds per call of ``call`` issued back to back, over ``rounds`` rounds of ``calls``
    calls after ``warmup`` calls; ``synchronize`` (``torch.cuda.synchronize`` on a GPU) runs after the warm-up and
    after each round, outside the timing, so that a round starts with an empty queue."""
    for _ in range(warmup):
        call()
    synchronize()
    per_call = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        per_call.append((time.perf_counter() - start) / calls * 1e6)
        synchronize()
    return sorted(per_call)[rounds // 2], min(per_call)
