"""Device time by CUDA events, for the GPU benchmarks (benchmarks/ is on sys.path when
one runs as a script: ``from cuda_timing import event_times_ms``)."""

from __future__ import annotations

import statistics
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


def graph_launch_us(launch: Callable[[], object], repeats: int = 20,
                    per_graph: int = 10) -> float:
    """Microseconds a launch, from replays of a CUDA graph of ``per_graph`` launches in a
    row (the median of ``repeats``): timed one by one, a launch of a few microseconds
    measured the host's Python launch path (about 100 us on an H100, whatever the
    kernel; 2026-12-06)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        launch()  # compiled outside the capture
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(per_graph):
                launch()
        return 1000 * statistics.median(event_times_ms(graph.replay, repeats)) / per_graph
