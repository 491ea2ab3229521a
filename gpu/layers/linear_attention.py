"""Gated DeltaNet linear attention (Qwen3.5, Qwen3-Next), with a state per request.

A layer projects each token to queries and keys (``linear_num_key_heads`` heads),
values and an output gate ``z`` (``linear_num_value_heads`` heads), and per value
head a write strength ``b`` and a decay ``a``. Queries, keys and values go through
a causal depthwise conv1d (kernel ``linear_conv_kernel_dim``) and SiLU, then the
gated delta rule updates a recurrent state of [value heads, key dim, value dim]
token by token; its output is normed per head, gated by ``silu(z)``
(gpu/layers/norm.py's ``gated_rms_norm``) and projected back by ``out_proj``.

What a request carries from step to step lives in its slot of the layer's
StateCache: the conv's last ``kernel - 1`` inputs and the recurrent state
(float32). The layers' StateCaches are views of one StateStore, slot-major: a
slot's states over every layer are one block, copied whole. A sequence of the
step starts from zeros unless the step's metadata says it continues
(``AttentionMetadata.continues_state``: it has computed tokens before), and
leaves its slot holding the state after its last token.

The CPU math is transformers' torch fallback (``torch_recurrent_gated_delta_rule``,
``causal_conv1d_update``), computed one sequence and one token at a time in the
recurrent form (the token loop in one numba kernel: gpu/kernels/
cpu_linear_attention.py; elsewhere in torch operations). That form is what
makes it batch-invariant and chunk-invariant: the state after a token is the
same bits whoever shares the step and wherever the scheduler cut the prompt
into chunks, since no operation spans two tokens of a sequence otherwise than
through the state (a chunked form would sum over the chunk and change with the
cut). The GPU runs fla-core's chunked kernels instead.

Fused projection (``in_proj``), this rank's heads only: rows
``[q | k | v | z | b | a]``, q/k of this rank's key heads, the rest of its value
heads (a key head serves ``value heads / key heads`` consecutive value heads, so a
rank's value heads are those of its key heads). The conv weight's channels are
``[q | k | v]`` of the same heads. An FP8 checkpoint's layer on a device that keeps
FP8 weights (one rank) keeps ``[b | a]`` apart (``in_proj_ba``, in the model's dtype):
checkpoints leave those small projections unquantized, or quantize them in blocks
their rows do not fill, and in one fused layer that would keep the large q/k/v/z rows
from staying e4m3 (gpu/fp8_weights.py); apart, they cost a launch of their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from trio_llm.gpu.layers.attention import AttentionMetadata
from trio_llm.gpu.layers.exact import batch_invariant, sum_of_squares
from trio_llm.gpu.layers.linear import Linear
from trio_llm.gpu.layers.norm import RMSNorm, gated_rms_norm
from trio_llm.gpu.quantization import keeps_fp8_weights
from trio_llm.gpu.tensor_parallel import TensorParallel

if TYPE_CHECKING:
    from trio_llm.gpu.models.config import HybridConfig

KEY_HEADS = "the number of linear-attention key heads"
VALUE_HEADS = "the number of linear-attention value heads"
# transformers' (and fla-core's) l2norm epsilon for queries and keys
L2NORM_EPS = 1e-6


@dataclass(slots=True)
class StateCache:
    """One linear-attention layer's states, one slot per running request (or snapshot):
    ``conv`` [num_slots, conv channels, kernel - 1] in the model's dtype, ``recurrent``
    [num_slots, value heads, key dim, value dim] in float32 (this rank's heads). Views
    of a StateStore: each slot's states are contiguous, the slots themselves a whole
    StateStore slot apart (index by slot, or pass ``stride(0)``; never flatten)."""

    conv: torch.Tensor
    recurrent: torch.Tensor


@dataclass(slots=True)
class StateStore:
    """Every linear-attention layer's states, slot-major: ``conv`` [num_slots, layers,
    conv channels, kernel - 1] in the model's dtype, ``recurrent`` [num_slots, layers,
    value heads, key dim, value dim] in float32. A slot's states over all the layers
    are one contiguous block of each tensor, so copying a slot (a prefix-cache
    snapshot saved or restored) is one copy per tensor, one launch on CUDA, whatever
    the number of layers; each layer computes on its StateCache, views ``[:, layer]``."""

    conv: torch.Tensor
    recurrent: torch.Tensor

    @property
    def num_slots(self) -> int:
        return self.conv.shape[0]

    def layer_caches(self) -> list[StateCache]:
        """The StateCache of each linear-attention layer, in layer order (views)."""
        return [StateCache(conv=self.conv[:, index], recurrent=self.recurrent[:, index])
                for index in range(self.conv.shape[1])]

    def copy_slot(self, source: int, destination: int) -> None:
        """Slot ``source``'s states, every layer's, into slot ``destination``."""
        self.conv[destination].copy_(self.conv[source])
        self.recurrent[destination].copy_(self.recurrent[source])


@dataclass(frozen=True, slots=True)
class LinearAttentionShape:
    """One rank's linear-attention layer: its heads and their sizes."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel_size: int

    @property
    def key_size(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_size(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_size + self.value_size

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return (self.conv_channels, self.conv_kernel_size - 1)

    @property
    def recurrent_state_shape(self) -> tuple[int, int, int]:
        return (self.num_value_heads, self.key_head_dim, self.value_head_dim)

    def slot_bytes(self, dtype: torch.dtype) -> int:
        """Bytes one slot takes: the conv state in ``dtype``, the recurrent one in float32."""
        conv_entries = self.conv_channels * (self.conv_kernel_size - 1)
        recurrent_entries = self.num_value_heads * self.key_head_dim * self.value_head_dim
        return conv_entries * dtype.itemsize + recurrent_entries * 4

    def allocate(self, num_slots: int, num_layers: int, *, dtype: torch.dtype,
                 device: torch.device) -> StateStore:
        """A StateStore of ``num_slots`` slots for ``num_layers`` layers of this shape;
        zeroed, though no slot is read before a step writes it (a sequence starting
        from scratch reads zeros)."""
        return StateStore(
            conv=torch.zeros(num_slots, num_layers, *self.conv_state_shape, dtype=dtype,
                             device=device),
            recurrent=torch.zeros(num_slots, num_layers, *self.recurrent_state_shape,
                                  dtype=torch.float32, device=device))


def local_shape(config: HybridConfig, parallel: TensorParallel) -> LinearAttentionShape:
    """This rank's share of a linear-attention layer of ``config``."""
    return LinearAttentionShape(
        num_key_heads=parallel.split(config.linear_num_key_heads, KEY_HEADS)[1],
        num_value_heads=parallel.split(config.linear_num_value_heads, VALUE_HEADS)[1],
        key_head_dim=config.linear_key_head_dim, value_head_dim=config.linear_value_head_dim,
        conv_kernel_size=config.linear_conv_kernel_dim)


class GatedDeltaNet(nn.Module):
    """A Gated DeltaNet token mixer (this rank's heads; ``out_proj``'s partial sums
    reduced over the ranks)."""

    def __init__(self, config: HybridConfig, *, dtype: torch.dtype, device: torch.device,
                 parallel: TensorParallel) -> None:
        super().__init__()
        self.parallel = parallel
        shape = self.shape = local_shape(config, parallel)
        num_value_heads = shape.num_value_heads
        fused_rows = shape.conv_channels + shape.value_size
        self.in_proj_ba: Linear | None = None
        # an FP8 checkpoint where the weights stay e4m3: b and a apart (see the module)
        if config.quantization is not None and keeps_fp8_weights(device, parallel.is_parallel):
            self.in_proj_ba = Linear(config.hidden_size, 2 * num_value_heads, bias=False,
                                     dtype=dtype, device=device)
        else:
            fused_rows += 2 * num_value_heads
        self.in_proj = Linear(config.hidden_size, fused_rows, bias=False, dtype=dtype,
                              device=device)
        self.conv_weight = nn.Parameter(
            torch.empty(shape.conv_channels, 1, shape.conv_kernel_size, dtype=dtype,
                        device=device), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(num_value_heads, dtype=dtype, device=device),
                                  requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(num_value_heads, dtype=dtype, device=device),
                                    requires_grad=False)
        self.norm = RMSNorm(shape.value_head_dim, eps=config.rms_norm_eps, dtype=dtype,
                            device=device)
        self.out_proj = Linear(shape.value_size, config.hidden_size, bias=False, dtype=dtype,
                               device=device)

    def _log_decay(self, a: torch.Tensor) -> torch.Tensor:
        """The state's decay (log space) per token and value head: -exp(A_log) *
        softplus(a + dt_bias), in a's dtype."""
        return -self.A_log.to(a.dtype).exp() * F.softplus(a + self.dt_bias.to(a.dtype))

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(q/k/v, z, b, a) of every token: views of the projections' outputs."""
        shape = self.shape
        sizes = [shape.conv_channels, shape.value_size]
        ba_sizes = [shape.num_value_heads, shape.num_value_heads]
        if self.in_proj_ba is None:
            return tuple(self.in_proj(hidden).split(sizes + ba_sizes, dim=-1))
        return (*self.in_proj(hidden).split(sizes, dim=-1),
                *self.in_proj_ba(hidden).split(ba_sizes, dim=-1))

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, rotary: Any,
                cache: StateCache, metadata: AttentionMetadata, backend: Any) -> torch.Tensor:
        """The layer's output for every token of the step (``positions``, ``rotary`` and
        ``backend``, an attention layer's, are not used); each sequence's slot of
        ``cache`` ends holding its state after its last token."""
        shape = self.shape
        num_tokens = hidden.shape[0]
        mixed, z, b, a = self.project(hidden)
        beta = batch_invariant(torch.sigmoid, b)
        # in float32 at least: in half precision the decay could round to -inf
        decay = batch_invariant(self._log_decay, a.float())
        if metadata.state_slots is None or metadata.continues_state is None:
            raise ValueError("a linear-attention layer needs the step's state slots")
        starts = metadata.query_start_loc.tolist()
        outputs = []
        for index, (slot, continues) in enumerate(zip(metadata.state_slots,
                                                      metadata.continues_state, strict=True)):
            rows = slice(starts[index], starts[index + 1])
            if rows.start == rows.stop:
                continue
            convolved = causal_conv1d(mixed[rows], cache.conv[slot], self.conv_weight[:, 0],
                                      continues)
            query, key, value = convolved.split(
                [shape.key_size, shape.key_size, shape.value_size], dim=-1)
            outputs.append(gated_delta_rule(
                query.unflatten(-1, (shape.num_key_heads, shape.key_head_dim)),
                key.unflatten(-1, (shape.num_key_heads, shape.key_head_dim)),
                value.unflatten(-1, (shape.num_value_heads, shape.value_head_dim)),
                decay[rows], beta[rows], cache.recurrent[slot], continues))
        attended = torch.cat(outputs) if outputs else hidden.new_empty(
            0, shape.num_value_heads, shape.value_head_dim)
        normed = gated_rms_norm(attended, z.view(num_tokens, shape.num_value_heads, -1),
                                self.norm.weight, self.norm.eps)
        return self.parallel.reduce(self.out_proj(normed.reshape(num_tokens, -1)))


def causal_conv1d(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                  continues: bool) -> torch.Tensor:
    """SiLU of the causal depthwise conv of one sequence's ``x`` [tokens, channels] with
    ``weight`` [channels, kernel], after the ``kernel - 1`` inputs in ``conv_state``
    [channels, kernel - 1] (zeros unless ``continues``); ``conv_state`` is left holding
    the last ``kernel - 1`` inputs. Each output is the kernel's taps summed in one fixed
    order, whatever the number of tokens (F.conv1d's order may change with it)."""
    num_tokens = x.shape[0]
    kernel_size = weight.shape[1]
    previous = conv_state if continues else torch.zeros_like(conv_state)
    window = torch.cat([previous, x.t().to(weight.dtype)], dim=1)
    out = weight[:, :1] * window[:, :num_tokens]
    for tap in range(1, kernel_size):
        out = out + weight[:, tap:tap + 1] * window[:, tap:tap + num_tokens]
    conv_state.copy_(window[:, window.shape[1] - (kernel_size - 1):])
    return batch_invariant(F.silu, out).t().to(x.dtype)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(sum_of_squares(x) + L2NORM_EPS)


def gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     decay: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                     continues: bool) -> torch.Tensor:
    """One sequence's gated delta rule in the recurrent form: query/key [tokens, key
    heads, key dim], value [tokens, value heads, value dim], decay (log space) and beta
    [tokens, value heads]; ``state`` [value heads, key dim, value dim] float32, read
    where ``continues`` and left holding the state after the last token. Returns the
    output [tokens, value heads, value dim] in value's dtype.

    Per token, as transformers' ``torch_recurrent_gated_delta_rule``: queries and keys
    l2-normed, queries scaled by 1/sqrt(key dim); the state decays by exp(decay),
    the delta (value minus what the state recalls for the key, times beta) is written
    at the key, and the query reads the new state."""
    out_dtype = query.dtype
    group_size = value.shape[1] // key.shape[1]
    query = l2norm(query.float()).repeat_interleave(group_size, dim=1)
    key = l2norm(key.float()).repeat_interleave(group_size, dim=1)
    query = query / (query.shape[-1] ** 0.5)
    value, beta = value.float(), beta.float()
    decay = batch_invariant(torch.exp, decay.float())
    if not continues:
        state.zero_()
    if state.device.type == "cpu":
        from trio_llm.gpu.kernels.cpu_linear_attention import gated_delta_recurrence

        return gated_delta_recurrence(query, key, value, decay, beta, state).to(out_dtype)
    current = state.clone()
    out = torch.empty_like(value)
    for token in range(value.shape[0]):
        key_column = key[token].unsqueeze(-1)
        current = current * decay[token][:, None, None]
        recalled = (current * key_column).sum(dim=-2)
        delta = (value[token] - recalled) * beta[token].unsqueeze(-1)
        current = current + key_column * delta.unsqueeze(-2)
        out[token] = (current * query[token].unsqueeze(-1)).sum(dim=-2)
    state.copy_(current)
    return out.to(out_dtype)
