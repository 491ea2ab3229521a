"""Streams and events of the pipelined executor: torch runs kernels on a stream, CuPy
records and waits for events on it.

torch owns the streams; CuPy wraps them as external streams for its events (a
CuPy-owned stream destroyed before the tensors allocated on it crashes torch's
allocator). On the CPU a lane has no stream and its events are always done, which
is how the executor's bookkeeping is tested without a GPU.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Protocol

import torch

# cudaMemcpyDefault: the runtime infers the direction from the pointers (unified addressing)
MEMCPY_DEFAULT = 4


class Event(Protocol):
    """A point in a stream's work: CuPy's event, or one that is always done (CPU)."""

    @property
    def done(self) -> bool: ...

    def synchronize(self) -> None: ...


class DoneEvent:
    """The CPU's event: work runs inline, so it is done as soon as it is recorded."""

    done = True

    def synchronize(self) -> None:
        pass


class Lane:
    """One stream: torch runs kernels on it, CuPy records and waits for events on it."""

    def __init__(self, device: torch.device) -> None:
        self.torch_stream: torch.cuda.Stream | None = None
        self._cupy_stream: Any = None
        if device.type == "cuda":
            import cupy

            self._cupy = cupy
            self.torch_stream = torch.cuda.Stream(device)
            self._cupy_stream = cupy.cuda.ExternalStream(self.torch_stream.cuda_stream,
                                                         device.index or 0)

    def context(self) -> Any:
        """Make this the current torch stream (a no-op on the CPU)."""
        return torch.cuda.stream(self.torch_stream) if self.torch_stream else nullcontext()

    def record(self, *, timing: bool = False, blocking: bool = False) -> Event:
        """``blocking``: a host thread waiting for it sleeps instead of spinning on a
        core (measured in workload (a): 9.1 -> 6.1 ms of process CPU per step)."""
        if self._cupy_stream is None:
            return DoneEvent()
        event = self._cupy.cuda.Event(block=blocking, disable_timing=not timing)
        event.record(self._cupy_stream)
        return event

    def elapsed_seconds(self, start: Event, end: Event) -> float:
        """Device time between two timing events, both complete."""
        if self._cupy_stream is None:
            return 0.0
        return float(self._cupy.cuda.get_elapsed_time(start, end)) / 1000.0

    def copy(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """Copy ``source`` into ``target`` (contiguous, same size; one of them pinned host
        memory or both on the device) on this stream, without making it torch's current
        stream: one runtime call, where torch's ``copy_`` under a stream context costs
        several times the host's time."""
        if self._cupy_stream is None:
            target.copy_(source)
            return
        assert target.is_contiguous() and source.is_contiguous()
        num_bytes = source.numel() * source.element_size()
        assert target.numel() * target.element_size() == num_bytes
        self._cupy.cuda.runtime.memcpyAsync(target.data_ptr(), source.data_ptr(), num_bytes,
                                            MEMCPY_DEFAULT, self._cupy_stream.ptr)

    def wait(self, event: Event | None) -> None:
        """Later work on this stream waits for ``event`` (without blocking the host)."""
        if event is not None and self._cupy_stream is not None and not isinstance(event,
                                                                                  DoneEvent):
            self._cupy_stream.wait_event(event)
