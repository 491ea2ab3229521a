"""Device time by CUDA events, for the GPU benchmarks (benchmarks/ is on sys.path when
one runs as a script: ``from cuda_timing import event_times_ms``)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def event_times_ms(run: Callable[[], object], repeats: int) -> list[float]:
    """The device time in milliseconds of each of ``repeats`` calls of ``run`` on the
    current stream, each between its own pair of CUDA events and waited for before the
    next call starts."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times
