"""The MoE router's softmax and top-k in one Triton kernel (the CUDA path's routing).

transformers routes a token by ``softmax(logits, dtype=float32)``, ``torch.topk``,
a renormalising division where the family asks, and a cast of the weights to
the activations' dtype where it asks (layers/moe.py's ``torch_route`` is that
code, which the CPU keeps). In torch that is seven to nine small kernels a layer
(softmax, the top-k's select and sort, the sum, the division, casts in and
out); ``route_topk`` is one launch, with no host synchronisation (safe inside a
CUDA graph), writing exactly what ``fused_moe`` reads: float32 weights and
int32 expert ids.

Each program routes ``BLOCK_T`` tokens, a row of all the experts each:

- the logits are read in their own dtype and widened to float32, as
  ``F.softmax(..., dtype=float32)`` widens them; the softmax subtracts the row's
  maximum and divides each exponential by the row's sum with a correctly rounded
  division; compiled, the exponential is libdevice's ``expf`` (the one torch's
  CUDA softmax calls), not the approximate ``ex2`` that ``tl.exp`` lowers to;
- ``top_k`` rounds each take the largest remaining probability and, among equal
  ones, the lowest expert index: the set picked is ``torch.topk``'s on CUDA
  (its radix select keeps the lowest indices among values equal to the k-th),
  in descending order, equal values in index order. torch.topk on the CPU
  breaks exact ties at the k-th value its own way (the CPU path keeps it);
- the renormalising sum and division, and the rounding through the logits'
  dtype (the activations' dtype of the router's output), follow the flags;
- a stacked shared expert (layers/moe.py: its gate the row's last logit) is
  appended to every row, expert ``num_experts`` weighted by the sigmoid of that
  logit, rounded to the logits' dtype as torch's sigmoid of it is.

The probabilities can differ from torch's in the last bit (another order of the
row's sum), so two experts whose probabilities are within an ulp of each other
can be picked differently; exact ties cannot.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from trio_llm.gpu.kernels.pdl import pdl_launch, pdl_start

# Triton's interpreter (CI on the CPU) has no libdevice: there the exponential is numpy's.
_PRECISE_EXP = os.environ.get("TRITON_INTERPRET", "0") != "1"
# Tokens a program routes when there are many: a [16, experts] tile in four warps.
_MANY_TOKENS_BLOCK = 16


@triton.jit(do_not_specialize=["num_tokens"])
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_tokens, logits_row_stride,
                  NUM_EXPERTS: tl.constexpr, TOP_K: tl.constexpr, EXPERTS_PAD: tl.constexpr,
                  TOP_K_PAD: tl.constexpr, BLOCK_T: tl.constexpr, NORMALIZE: tl.constexpr,
                  ROUND_TO_INPUT: tl.constexpr, SHARED: tl.constexpr,
                  PRECISE_EXP: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)  # after the router's GEMV (gpu/kernels/pdl.py)
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, EXPERTS_PAD)
    token_mask = tokens < num_tokens
    is_expert = (experts < NUM_EXPERTS)[None, :]
    # Rows past the last token re-read it (never stored): no row of -inf, no NaN.
    rows = tl.minimum(tokens, num_tokens - 1).to(tl.int64)
    logits = tl.load(logits_ptr + rows[:, None] * logits_row_stride + experts[None, :],
                     mask=is_expert, other=float("-inf"))
    shifted = logits.to(tl.float32) - tl.max(logits.to(tl.float32), 1)[:, None]
    if PRECISE_EXP:
        exponentials = libdevice.exp(shifted)
    else:
        exponentials = tl.exp(shifted)
    probabilities = tl.math.div_rn(exponentials, tl.sum(exponentials, 1)[:, None])
    # Below every probability (all >= 0): the padding, and each expert once taken.
    probabilities = tl.where(is_expert, probabilities, -1.0)
    slots = tl.arange(0, TOP_K_PAD)[None, :]
    weights = tl.zeros([BLOCK_T, TOP_K_PAD], dtype=tl.float32)
    ids = tl.zeros([BLOCK_T, TOP_K_PAD], dtype=tl.int32)
    for slot in tl.static_range(TOP_K):
        best = tl.max(probabilities, 1)
        # The lowest index holding the largest value: ties go to the lower expert.
        best_id = tl.min(tl.where(probabilities == best[:, None], experts[None, :],
                                  EXPERTS_PAD), 1)
        weights = tl.where(slots == slot, best[:, None], weights)
        ids = tl.where(slots == slot, best_id[:, None], ids)
        probabilities = tl.where(experts[None, :] == best_id[:, None], -1.0, probabilities)
    if NORMALIZE:
        weights = tl.math.div_rn(weights, tl.sum(weights, 1)[:, None])
    if ROUND_TO_INPUT:
        weights = weights.to(logits_ptr.dtype.element_ty).to(tl.float32)
    if SHARED:
        gate = tl.load(logits_ptr + rows * logits_row_stride + NUM_EXPERTS).to(tl.float32)
        if PRECISE_EXP:
            shared = tl.math.div_rn(1.0, 1.0 + libdevice.exp(-gate))
        else:
            shared = tl.math.div_rn(1.0, 1.0 + tl.exp(-gate))
        shared = shared.to(logits_ptr.dtype.element_ty).to(tl.float32)
        weights = tl.where(slots == TOP_K, shared[:, None], weights)
        ids = tl.where(slots == TOP_K, NUM_EXPERTS, ids)
    NUM_PICKS: tl.constexpr = TOP_K + SHARED
    out_offsets = tokens.to(tl.int64)[:, None] * NUM_PICKS + slots
    out_mask = token_mask[:, None] & (slots < NUM_PICKS)
    tl.store(weights_ptr + out_offsets, weights, mask=out_mask)
    tl.store(ids_ptr + out_offsets, ids, mask=out_mask)


def route_topk(logits: torch.Tensor, top_k: int, *, normalize: bool, round_to_input: bool,
               shared: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, picks], expert ids int32 [T, picks]) for router ``logits``
    [T, experts]: softmax in float32, the ``top_k`` largest (ties to the lower expert),
    renormalised to sum to one if ``normalize``, rounded to ``logits``' dtype (and
    held in float32) if ``round_to_input``. ``shared``: the last logit is a stacked
    shared expert's gate, not a routed expert's; it is the last pick of every row
    (``top_k + 1`` picks), weighted by its sigmoid."""
    num_tokens, num_experts = logits.shape
    num_experts -= shared
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k {top_k} must be in [1, {num_experts}] (the experts)")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    num_picks = top_k + shared
    weights = torch.empty((num_tokens, num_picks), dtype=torch.float32, device=logits.device)
    ids = torch.empty((num_tokens, num_picks), dtype=torch.int32, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    # One token alone (single-stream decode) in one warp: its reductions need no barrier.
    block_t = 1 if num_tokens == 1 else _MANY_TOKENS_BLOCK
    experts_pad = triton.next_power_of_2(num_experts)
    pdl = pdl_launch(logits.device)
    _route_kernel[(triton.cdiv(num_tokens, block_t),)](
        logits, weights, ids, num_tokens, logits.stride(0), NUM_EXPERTS=num_experts,
        TOP_K=top_k, EXPERTS_PAD=experts_pad, TOP_K_PAD=triton.next_power_of_2(num_picks),
        BLOCK_T=block_t, NORMALIZE=normalize, ROUND_TO_INPUT=round_to_input, SHARED=shared,
        PRECISE_EXP=_PRECISE_EXP, num_warps=1 if block_t * experts_pad <= 512 else 4, **pdl)
    return weights, ids
