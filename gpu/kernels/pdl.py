"""Programmatic dependent launch (PDL), on by default on Hopper; ``TRIO_LLM_PDL=0`` turns it off.

On Hopper and later a kernel launched with PDL may start while the kernel before it on
the stream is still running; it must wait (``gdc_wait``) before it reads that kernel's
output or writes anything, and until then may only read what no earlier kernel writes.
The GEMVs use it to fetch their first weight tile while the kernel before them finishes
(the weights are constant), and the decode attention its first key and value tile where
that tile ends before the step's new position (earlier steps wrote it; only the KV write
just before writes the new one). The other kernels of a decode step's chain (the norms,
the q/k norm and KV write, the decode attention and its merge, the SwiGLU, the MoE
routing and the row-wise MoE kernels; the hybrid family's conv, recurrence, gated norm,
gated q/k kernel and output gate) start with ``pdl_start``: they let the next kernel
launch, then wait, so each launch overlaps the kernel before it. The next kernel
launches only once every program of this one has signalled (``gdc_launch_dependents``,
first thing) or exited, so its waiting programs never take the place of one of this
kernel's. A kernel launched without PDL waits for its predecessor as usual, so the two
kinds mix freely. On by default since the H100 measured it (docs/performance.md, "the
eighth session"): single-stream decode 7.5% faster for qwen3.5-35b-a3b, 3.7% for
qwen3-30b-a3b, 1.2% for FP8 qwen3-8b, 1.0% slower for bf16 qwen3-8b
(benchmarks/device_run.sh ``decode-nopdl-*`` beside ``decode-*``). Triton's interpreter
has no PDL, so it is always off there.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_PDL = True
except ImportError:  # a Triton without grid dependency control: PDL stays off
    HAS_PDL = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass

__all__ = ["gdc_launch_dependents", "gdc_wait", "pdl_enabled", "pdl_launch", "pdl_start"]


@triton.jit
def pdl_start(USE_PDL: tl.constexpr):
    """A PDL-launched kernel's first statement: the next kernel may launch, and this
    one waits for the kernel before it (whose outputs it reads)."""
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()


@functools.cache
def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL: not turned off, compiled, SM 9.0 or
    later."""
    setting = os.environ.get("TRIO_LLM_PDL", "1")
    if setting not in ("0", "1"):
        raise ValueError(f"TRIO_LLM_PDL={setting!r}: expected 1 (on, the default) or 0 (off)")
    if (setting == "0" or os.environ.get("TRITON_INTERPRET") == "1"
            or not HAS_PDL):
        return False
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def pdl_launch(device: torch.device) -> dict[str, bool]:
    """A chain kernel's launch keywords on ``device``: its ``USE_PDL`` constexpr, and
    ``launch_pdl`` where PDL is on."""
    on = pdl_enabled(device)
    return {"USE_PDL": on, "launch_pdl": True} if on else {"USE_PDL": False}
