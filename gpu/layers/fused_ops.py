"""The kernels a fused forward calls: one interface, Triton's and numba's behind it.

A model's fused forward (models/base.py) is written once against this
interface; gpu/models/cuda_fused.py implements it with the Triton kernels and
gpu/models/cpu_fused.py with the numba ones (float32, batch-invariant). ``step`` is
what the attention kernels read a step's layout from: the AttentionMetadata on
CUDA, the CPU attention kernel's checked StepPlan on the CPU; both carry
``slot_mapping``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

from trio_llm.gpu.quantization import Fp8Activation, KVScales

if TYPE_CHECKING:
    from trio_llm.gpu.layers.linear import Linear
    from trio_llm.gpu.layers.moe import MoeShape


class FusedOps(Protocol):
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dimension."""
        ...

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm of ``residual + x``, ``residual + x``)."""
        ...

    def rms_norm_fp8(self, x: torch.Tensor, residual: torch.Tensor | None,
                     weight: torch.Tensor, eps: float) -> tuple[Fp8Activation, torch.Tensor]:
        """``rms_norm`` (``residual`` None) or ``add_rms_norm``, the normed rows in e4m3
        with one scale per row (for a per-channel FP8 layer), and the residual stream."""
        ...

    def gate_up_silu(self, hidden: torch.Tensor | Fp8Activation, gate_up_proj: Linear, *,
                     quantize: bool = False) -> torch.Tensor | Fp8Activation:
        """SwiGLU of a gate/up projection (layers/mlp.py's ``gate_up_silu``): the first
        half of each output row gates the second half. ``quantize``: in e4m3 with one
        scale per row (for a per-channel FP8 down projection, as ``rms_norm_fp8``)."""
        ...

    def qk_norm_rope_write_kv(self, qkv: torch.Tensor, positions: torch.Tensor,
                              cos: torch.Tensor, sin: torch.Tensor,
                              q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                              eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              slot_mapping: torch.Tensor, *, num_heads: int,
                              num_kv_heads: int, head_dim: int,
                              kv_scales: KVScales) -> torch.Tensor:
        """Normed, rotated queries [tokens, heads, head_dim] from the fused qkv output;
        keys and values go to the cache (divided by ``kv_scales`` in an FP8 cache)."""
        ...

    def attend(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               step: Any, scale: float, backend: Any, kv_scales: KVScales) -> torch.Tensor:
        """Paged attention of ``query`` over the cache -> [tokens, heads, head_dim];
        ``backend`` the model's AttentionBackend (a kernel set may use its own)."""
        ...

    def moe_route(self, logits: torch.Tensor, shape: MoeShape
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, expert ids), each [tokens, top_k], for router ``logits``
        [tokens, experts] (layers/moe.py's ``torch_route`` computes them)."""
        ...

    def moe_experts(self, hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                    weights: torch.Tensor, expert_ids: torch.Tensor,
                    num_rows_per_chunk: int, scales: Any = None) -> torch.Tensor:
        """The routed experts' output [tokens, hidden] (layers/moe.py's ``expert_loop``
        computes it): ``gate_up`` [experts, 2 I, hidden], ``down`` [experts, hidden, I],
        ``weights`` and ``expert_ids`` [tokens, top_k]; ``scales`` (an ExpertScales): the
        experts are e4m3."""
        ...
