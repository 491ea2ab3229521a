"""The Mixture-of-Experts feed-forward block: a router picks ``top_k`` of ``num_experts``
SwiGLU experts for each token, and their outputs are summed, each by its weight.

As transformers computes it (Qwen3-MoE, Qwen2-MoE, Mixtral): the router's logits
are softmaxed in float32, ``torch.topk`` picks the experts (ties resolve as it
resolves them), the picked probabilities are renormalised where the family asks
(``normalize``), and a token's expert outputs are added to zero in ascending
expert order. Qwen2-MoE adds a shared expert, gated by a sigmoid.

A shared expert as wide as a routed one (Qwen3.5/3.6-MoE, Qwen3-Next: both 512) is
stacked as one more expert, ``num_experts``, and its gate as one more router row:
routing then appends it to every token's picks with ``sigmoid(its logit)`` for a
weight, and the experts' pass computes it with the routed ones (on CUDA no launch of
its own: a decode step's shared expert cost seven small kernels a layer). It is the
highest index, so it is still added last, to the routed experts' sum, as
transformers adds it; the same products in the same order. A wider shared expert
(Qwen2-MoE: 20,480 against 2,560) keeps layers of its own.

Every expert's weights are stacked: ``experts_gate_up`` [experts, 2 * I, hidden]
(gate rows, then up rows) and ``experts_down`` [experts, hidden, I], the layout
of the fused MoE kernel. Under tensor parallelism each rank holds every
expert's slice of I, and the partial outputs (the shared expert's too) are
summed over the ranks once.

On the CPU each expert multiplies its tokens in fixed row chunks (as a
batch-invariant ``Linear`` does), so a token's output never depends on which
other tokens share the step or the expert. On CUDA the routing runs through the
kernel set's ``moe_route`` (one Triton kernel, gpu/kernels/moe_routing.py) and the
experts through its ``moe_experts`` (the fused MoE kernel); neither synchronises
with the host, so both are safe inside a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from trio_llm.gpu.layers.fused_ops import FusedOps
from trio_llm.gpu.layers.linear import Linear, chunked_linear
from trio_llm.gpu.layers.mlp import MLP, gate_up_silu, silu_and_mul
from trio_llm.gpu.quantization import Fp8Activation
from trio_llm.gpu.tensor_parallel import TensorParallel

if TYPE_CHECKING:
    from trio_llm.gpu.kernels.fused_moe import ExpertScales
    from trio_llm.gpu.models.config import MoeConfig

EXPERT_INTERMEDIATE = "the experts' intermediate size"
SHARED_INTERMEDIATE = "the shared expert's intermediate size"


def stacks_shared_expert(intermediate_size: int, shared_intermediate_size: int) -> bool:
    """Whether a shared expert of this size is stacked with the routed experts of
    ``intermediate_size`` (see the module): it exists and is as wide as one of them."""
    return 0 < shared_intermediate_size == intermediate_size


@dataclass(frozen=True, slots=True)
class MoeShape:
    """What one MoE block is: its experts and how the router weighs them."""

    hidden_size: int
    num_experts: int
    top_k: int
    intermediate_size: int
    # renormalise the top-k probabilities to sum to one
    normalize: bool
    # Mixtral keeps the weights in float32; the Qwen families round them to the
    # activations' dtype first
    weights_in_float32: bool = False
    # 0: no shared expert
    shared_intermediate_size: int = 0

    @property
    def stacks_shared_expert(self) -> bool:
        """Whether the shared expert is stacked as expert ``num_experts`` (see the module)."""
        return stacks_shared_expert(self.intermediate_size, self.shared_intermediate_size)

    @property
    def num_stacked_experts(self) -> int:
        """The experts the stacked weights hold: the routed ones, then a stacked shared one."""
        return self.num_experts + self.stacks_shared_expert


class SparseMoeBlock(nn.Module):
    """Routed SwiGLU experts (and a sigmoid-gated shared expert where the shape has one)."""

    def __init__(self, shape: MoeShape, *, dtype: torch.dtype, device: torch.device,
                 parallel: TensorParallel) -> None:
        super().__init__()
        self.shape = shape
        self.parallel = parallel
        hidden = shape.hidden_size
        local_size = parallel.split(shape.intermediate_size, EXPERT_INTERMEDIATE)[1]
        num_stacked = shape.num_stacked_experts
        # the router's rows (and a stacked shared expert's gate, the last row)
        self.gate = Linear(hidden, num_stacked, bias=False, dtype=dtype, device=device)
        self.experts_gate_up = nn.Parameter(
            torch.empty(num_stacked, 2 * local_size, hidden, dtype=dtype, device=device),
            requires_grad=False)
        self.experts_down = nn.Parameter(
            torch.empty(num_stacked, hidden, local_size, dtype=dtype, device=device),
            requires_grad=False)
        self.shared_expert_gate_up = self.shared_expert_down = None
        self.shared_expert_gate = None
        if shape.shared_intermediate_size and not shape.stacks_shared_expert:
            shared_size = parallel.split(shape.shared_intermediate_size, SHARED_INTERMEDIATE)[1]
            self.shared_expert_gate_up = Linear(hidden, 2 * shared_size, bias=False,
                                                dtype=dtype, device=device)
            self.shared_expert_down = Linear(shared_size, hidden, bias=False, dtype=dtype,
                                             device=device)
            self.shared_expert_gate = Linear(hidden, 1, bias=False, dtype=dtype, device=device)
        # 0: plain GEMMs; else each expert's rows in chunks of this many (batch-invariant)
        self.num_rows_per_chunk = 0
        # FP8 experts (gpu/fp8_weights.py): the e4m3 weights' scales, their block size
        self.experts_gate_up_scale: nn.Parameter | None = None
        self.experts_down_scale: nn.Parameter | None = None
        self.fp8_block_size: tuple[int, int] | None = None

    def keep_experts_fp8(self, block_size: tuple[int, int] | None) -> None:
        """Hold the stacked experts in e4m3 with one float32 scale per ``block_size`` block
        of each expert's weight (None: per row), empty until the loader fills them."""
        for name in ("experts_gate_up", "experts_down"):
            weight = getattr(self, name)
            num_experts, num_rows, depth = weight.shape
            rows, columns = block_size or (1, depth)
            setattr(self, name, nn.Parameter(torch.empty(
                weight.shape, dtype=torch.float8_e4m3fn, device=weight.device),
                requires_grad=False))
            setattr(self, name + "_scale", nn.Parameter(torch.ones(
                num_experts, -(-num_rows // rows), -(-depth // columns), dtype=torch.float32,
                device=weight.device), requires_grad=False))
        self.fp8_block_size = block_size

    def expert_scales(self) -> ExpertScales | None:
        """The FP8 experts' scales for the fused kernel; None for float experts."""
        if self.experts_gate_up_scale is None or self.experts_down_scale is None:
            return None
        from trio_llm.gpu.kernels.fused_moe import ExpertScales

        return ExpertScales(self.experts_gate_up_scale, self.experts_down_scale,
                            self.fp8_block_size)

    def float_experts(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up, down) in ``dtype``: FP8 experts dequantized (the torch path)."""
        scales = self.expert_scales()
        if scales is None:
            return self.experts_gate_up, self.experts_down
        from trio_llm.gpu.kernels.fused_moe import dequantized_experts

        return dequantized_experts(self.experts_gate_up, self.experts_down, scales, dtype)

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [tokens, picks], expert ids [tokens, picks]) as transformers picks them
        (``top_k``, and a stacked shared expert)."""
        return torch_route(self.gate(hidden), self.shape)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = self.route(hidden)
        gate_up, down = self.float_experts(hidden.dtype)
        routed = expert_loop(hidden, gate_up, down, weights, expert_ids, silu_and_mul,
                             self.num_rows_per_chunk)
        return self.parallel.reduce(self._with_shared_expert(hidden, routed, gate_up_silu))

    def fused(self, hidden: torch.Tensor, ops: FusedOps) -> torch.Tensor:
        """``forward`` with the routing, experts (and activations) through ``ops``' kernels."""
        weights, expert_ids = ops.moe_route(self.gate(hidden), self.shape)
        routed = ops.moe_experts(hidden, self.experts_gate_up, self.experts_down, weights,
                                 expert_ids, self.num_rows_per_chunk, self.expert_scales())
        return self.parallel.reduce(self._with_shared_expert(hidden, routed, ops.gate_up_silu))

    def _with_shared_expert(
            self, hidden: torch.Tensor, routed: torch.Tensor,
            gate_up_silu: Callable[[torch.Tensor, Linear], torch.Tensor | Fp8Activation]
    ) -> torch.Tensor:
        """The routed experts' (partial) output plus the gated shared expert's, if any
        (``gate_up_silu``: the SwiGLU of its gate/up projection, as mlp.py's)."""
        if (self.shared_expert_gate_up is None or self.shared_expert_down is None
                or self.shared_expert_gate is None):
            return routed
        shared = self.shared_expert_down(gate_up_silu(hidden, self.shared_expert_gate_up))
        return routed + torch.sigmoid(self.shared_expert_gate(hidden)) * shared


def torch_route(logits: torch.Tensor, shape: MoeShape) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' routing of router ``logits`` [tokens, stacked experts]: (weights,
    expert ids), each [tokens, top_k], and a stacked shared expert last in each row
    (``num_experts``, weighted by the sigmoid of its gate's logit, in the logits' dtype
    as transformers computes it)."""
    routed = logits[:, :shape.num_experts]
    probabilities = F.softmax(routed, dim=-1, dtype=torch.float32)
    weights, expert_ids = torch.topk(probabilities, shape.top_k, dim=-1)
    if shape.normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if not shape.weights_in_float32:
        weights = weights.to(logits.dtype)
    if shape.stacks_shared_expert:
        shared_weight = torch.sigmoid(logits[:, shape.num_experts:]).to(weights.dtype)
        weights = torch.cat([weights, shared_weight], dim=1)
        expert_ids = torch.cat([expert_ids, torch.full_like(expert_ids[:, :1],
                                                            shape.num_experts)], dim=1)
    return weights, expert_ids


def expert_loop(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                weights: torch.Tensor, expert_ids: torch.Tensor,
                activation: Callable[[torch.Tensor], torch.Tensor],
                num_rows_per_chunk: int) -> torch.Tensor:
    """The routed experts' output [tokens, hidden]: each expert that some token picked
    runs once over its tokens (in ascending expert order, so that a token's outputs are
    summed in transformers' order); ``num_rows_per_chunk`` as in ``Linear``."""
    out = torch.zeros_like(hidden)
    num_tokens, top_k = expert_ids.shape
    if num_tokens == 0:
        return out
    flat_ids = expert_ids.reshape(-1)
    # picks grouped by expert, each group in (token, rank) order
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=gate_up.shape[0]).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        picks = order[start:start + count]
        start += count
        token_ids = picks // top_k
        rows = _linear(hidden[token_ids], gate_up[expert], num_rows_per_chunk)
        rows = _linear(activation(rows), down[expert], num_rows_per_chunk)
        rows = rows * weights.reshape(-1)[picks].unsqueeze(-1)
        out.index_add_(0, token_ids, rows.to(out.dtype))
    return out


def _linear(x: torch.Tensor, weight: torch.Tensor, num_rows_per_chunk: int) -> torch.Tensor:
    if num_rows_per_chunk:
        return chunked_linear(x, weight, None, num_rows_per_chunk)
    return F.linear(x, weight)


def moe_or_mlp(config: MoeConfig, layer_index: int, *, dtype: torch.dtype,
               device: torch.device, parallel: TensorParallel) -> nn.Module:
    """Layer ``layer_index``'s feed-forward block in an MoE family: experts, or a dense
    MLP where the config says so (``MoeConfig.is_moe_layer``)."""
    if not config.is_moe_layer(layer_index):
        return MLP(config.hidden_size, config.intermediate_size, bias=False, dtype=dtype,
                   device=device, parallel=parallel)
    shape = MoeShape(hidden_size=config.hidden_size, num_experts=config.num_experts,
                     top_k=config.num_experts_per_tok,
                     intermediate_size=config.moe_intermediate_size,
                     normalize=config.norm_topk_prob,
                     weights_in_float32=config.router_weights_in_float32,
                     shared_intermediate_size=config.shared_expert_intermediate_size)
    return SparseMoeBlock(shape, dtype=dtype, device=device, parallel=parallel)
