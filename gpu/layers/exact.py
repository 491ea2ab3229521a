"""Elementwise transcendental functions whose result never depends on the batch.

torch's CPU kernels compute exp, sigmoid, SiLU or softplus with SIMD code for most
of a tensor and scalar code for the tail of each contiguous run (and of each
thread's share): the two differ in the last bit, and which one an element gets
depends on where it sits in the tensor, so on how many tokens share the step.
``batch_invariant`` computes such a function in float64 and rounds the result:
the two codes' float64 results differ some 29 bits below float32's last bit, so
the rounded values agree but with probability ~1e-9 per value (the argument of
gpu/attention.py's float64 attention). Inputs of other dtypes, and CUDA
tensors, are computed as they are.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def batch_invariant(function: Callable[[torch.Tensor], torch.Tensor],
                    x: torch.Tensor) -> torch.Tensor:
    """``function(x)`` in x's dtype, through float64 for a float32 CPU tensor."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return function(x)
    return function(x.to(torch.float64)).to(torch.float32)


def sum_of_squares(x: torch.Tensor, *, mean: bool = False) -> torch.Tensor:
    """The sum (or ``mean``) of squares of float32 ``x`` over its last dimension, keepdim,
    in float32. Summed in float64, where the squares are exact and the order of the sum
    (which torch's reduction kernels choose by the tensor's shape: a row may be summed
    one way or another by where it sits) changes nothing that survives the rounding."""
    wide = x.to(torch.float64).square()
    total = wide.mean(-1, keepdim=True) if mean else wide.sum(-1, keepdim=True)
    return total.to(torch.float32)
