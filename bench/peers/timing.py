"""Timing shared by the peer scripts: CUDA events, 3 warm-up calls, then the median of 20 (the same rule as
kernels/src/cuda/timing.rs, so peer and rewind rows compare)."""
import torch

WARMUP, REPS = 3, 20


def median_ms(fn):
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(REPS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[REPS // 2]
