"""Any family's model on CUDA: its fused forward through the Triton kernels.

``fuse_model(model)`` makes a loaded CausalLM run ``fused_forward`` with
gpu/kernels/triton_layers.py's kernels and the Triton attention backend,
keeping its weights; on CUDA its linear layers take one or two rows (decode of
one or two streams) through gpu/kernels/triton_gemv.py's ``gemv``, which streams
the weights faster than cuBLAS does at that size (FP8 layers do the same by
themselves: gpu/layers/fp8_linear.py). Each kernel rounds where the
torch model rounds, so the fused model computes the same function up to the
order of float32 sums.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trio_llm.gpu.attention import AttentionBackend
from trio_llm.gpu.kernels import triton_attention, triton_gemv, triton_layers
from trio_llm.gpu.kernels.moe_routing import route_topk
from trio_llm.gpu.kernels.triton_gemv import gemv
from trio_llm.gpu.layers.attention import AttentionMetadata
from trio_llm.gpu.layers.fp8_linear import Fp8Linear
from trio_llm.gpu.layers.linear import Linear
from trio_llm.gpu.layers.moe import MoeShape
from trio_llm.gpu.models.base import CausalLM
from trio_llm.gpu.models.cuda_hybrid import hybrid_forward, is_hybrid
from trio_llm.gpu.quantization import Fp8Activation, KVScales


class TritonOps:
    """gpu/kernels/triton_layers.py's kernels as the FusedOps a model's fused forward
    calls (gpu/layers/fused_ops.py); attention through the model's backend (Triton's once
    fused), ``step`` its metadata."""

    rms_norm = staticmethod(triton_layers.rms_norm)
    add_rms_norm = staticmethod(triton_layers.add_rms_norm)
    rms_norm_fp8 = staticmethod(triton_layers.rms_norm_fp8)
    qk_norm_rope_write_kv = staticmethod(triton_layers.qk_norm_rope_write_kv)

    @staticmethod
    def gate_up_silu(hidden: torch.Tensor | Fp8Activation, gate_up_proj: Linear, *,
                     quantize: bool = False) -> torch.Tensor | Fp8Activation:
        """Decode rows that the projection multiplies with ``gemv`` take the SwiGLU in the
        same launch (one kernel fewer a layer, bitwise the same); others the SwiGLU kernel
        after the projection, which also quantizes (``quantize``: one kernel fewer)."""
        if (isinstance(hidden, torch.Tensor) and isinstance(gate_up_proj, (GemvLinear, Fp8Linear))
                and gate_up_proj.takes_gemv(hidden)):
            assert not quantize  # decode rows stay unrounded (Fp8Linear.takes_fp8_rows)
            return gate_up_proj.gemv_rows(hidden, swiglu=True)
        if quantize:
            return triton_layers.silu_and_mul_fp8(gate_up_proj(hidden))
        return triton_layers.silu_and_mul(gate_up_proj(hidden))

    @staticmethod
    def attend(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, step: Any,
               scale: float, backend: Any, kv_scales: KVScales) -> torch.Tensor:
        return backend.paged_attention(query, k_cache, v_cache, step.block_tables,
                                       step.context_lens, step.query_start_loc, scale,
                                       k_scale=kv_scales.k_scale, v_scale=kv_scales.v_scale)

    @staticmethod
    def moe_route(logits: torch.Tensor, shape: MoeShape) -> tuple[torch.Tensor, torch.Tensor]:
        """The routing kernel (gpu/kernels/moe_routing.py): one launch, float32 weights and
        int32 ids, the dtypes the fused MoE kernel reads (no casts between them)."""
        return route_topk(logits, shape.top_k, normalize=shape.normalize,
                          round_to_input=not shape.weights_in_float32,
                          shared=shape.stacks_shared_expert)

    @staticmethod
    def moe_experts(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                    weights: torch.Tensor, expert_ids: torch.Tensor,
                    num_rows_per_chunk: int, scales: Any = None) -> torch.Tensor:
        """The fused MoE kernel (gpu/kernels/fused_moe.py): no host synchronisation, so
        a step with MoE layers is captured in CUDA graphs like any other (FP8 experts
        too: ``scales``)."""
        from trio_llm.gpu.kernels.fused_moe import fused_moe

        return fused_moe(hidden, gate_up, down, weights.to(torch.float32),
                         expert_ids.to(torch.int32), scales=scales)


TRITON_OPS = TritonOps()


class FusedCausalLM(CausalLM):
    """A CausalLM whose forward runs through the Triton kernels; see ``fuse_model``."""

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[Any], metadata: AttentionMetadata) -> torch.Tensor:
        return self.fused_forward(TRITON_OPS, token_ids, positions, kv_caches, metadata)


class FusedHybridLM(CausalLM):
    """A CausalLM of the hybrid family (linear-attention layers, gated attention) whose
    forward runs through gpu/models/cuda_hybrid.py's kernels; see ``fuse_model``."""

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[Any], metadata: AttentionMetadata) -> torch.Tensor:
        return hybrid_forward(self, TRITON_OPS, token_ids, positions, kv_caches, metadata)


class GemvLinear(Linear):
    """A Linear that multiplies at most GEMV_ROWS rows (gpu/kernels/triton_gemv.py) with
    ``gemv``; larger batches, and row-chunked (batch-invariant) layers, go through
    ``Linear``."""

    def takes_gemv(self, x: torch.Tensor) -> bool:
        return (x.dim() == 2 and x.shape[0] <= triton_gemv.GEMV_ROWS
                and not self.num_rows_per_chunk)

    def gemv_rows(self, x: torch.Tensor, *, swiglu: bool = False) -> torch.Tensor:
        """``x``'s rows through ``gemv`` (``swiglu``: with the SwiGLU of the product)."""
        return gemv(x, self.weight, self.bias, swiglu=swiglu)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.takes_gemv(x):
            return self.gemv_rows(x)
        return super().forward(x)


def use_gemv(module: nn.Module) -> None:
    """Make every Linear in ``module`` (itself included) a GemvLinear, in place."""
    for submodule in module.modules():
        if type(submodule) is Linear:
            submodule.__class__ = GemvLinear


def fuse_model(model: CausalLM) -> CausalLM:
    """Run ``model`` through the fused kernels and Triton attention, in place; returns it.

    Its weights, caches layout and outputs stay as they were: only the forward
    changes. On CUDA its linear layers (the lm_head too) take small batches through
    ``gemv``. Batch-invariant (row-chunked) linears are left as configured.
    """
    model.__class__ = FusedHybridLM if is_hybrid(model) else FusedCausalLM
    model.attention_backend = AttentionBackend(
        "triton", triton_attention.write_kv_cache, triton_attention.paged_attention)
    if model.device.type == "cuda":
        use_gemv(model)
    return model
