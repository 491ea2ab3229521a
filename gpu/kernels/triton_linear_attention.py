"""Triton kernels of the Gated DeltaNet layers (Qwen3.5, Qwen3-Next) on CUDA.

A linear-attention layer keeps two states per request in a slot of its state
cache (one slot per running request, given by the scheduler): the last
``kernel - 1`` inputs of its causal depthwise conv1d, ``[slots, channels,
kernel - 1]`` in the activations' dtype, and the recurrent state of the gated
delta rule, ``[slots, value heads, key dim, value dim]`` in float32. A sequence
starts from zeros when it has computed no token yet (its context length equals
its query length) and from its slot's states otherwise; a slot below zero is a
padding sequence's, read as zeros and never written. Each slot's states are
contiguous, but the slots need not be: a layer's state cache is a view of the
model's slot-major StateStore (gpu/layers/linear_attention.py), so every kernel
steps between slots by the cache's ``stride(0)``.

- ``causal_conv1d_varlen``: the conv1d with SiLU over a step's sequences (prefill
  chunks and decode rows packed by ``query_start_loc``), then each sequence's last
  inputs written back into its slot;
- ``causal_conv1d_decode``: the same for one token per sequence, the state
  shifted in place;
- ``gated_delta_rule_decode``: one token per sequence of the gated delta rule,
  the recurrent state updated in place in its slot (the gates computed inside:
  ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``); in its varlen
  mode, the one-token sequences of any step (its other sequences left to fla);
- ``gdn_gates``: those gates for a prefill step (fla's chunked kernel takes them);
- ``gather_states`` / ``scatter_states``: a step's recurrent states into a dense
  batch and back, for fla's chunked kernel (gpu/kernels/fla_gated_delta_rule.py);
- ``gated_rms_norm``: RMSNorm of the output times SiLU of the gate ``z``.

No kernel synchronises with the host and each grid depends on tensor shapes only,
so every one of them is captured in the executor's CUDA graphs. Each rounds
where transformers' torch code rounds (its ``causal_conv1d_fn`` /
``causal_conv1d_update``, ``Qwen3_5RMSNormGated``, the gates of
``Qwen3_5GatedDeltaNet.forward``), so the fused layer computes the same function
up to the order of float32 sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trio_llm.gpu.kernels.pdl import pdl_launch, pdl_start

CONV_BLOCK_TOKENS = 16
CONV_BLOCK_CHANNELS = 128
# value columns of the recurrent state per program of the decode kernel: at one
# stream, a layer of 32 value heads of 128 then runs 512 programs
DECODE_BLOCK_VALUES = 8
GATE_BLOCK = 256
# fla's l2norm epsilon (transformers' l2norm: x * rsqrt(sum(x * x) + 1e-6))
L2NORM_EPS = 1e-6


def _slots_are_contiguous(states: torch.Tensor) -> bool:
    """Whether each slot of ``states`` [slots, ...] is contiguous: the kernels index a
    slot as ``slot * stride(0)`` plus an offset within it (a StateStore's layer view
    has its slots a whole StateStore slot apart)."""
    return states[0].is_contiguous()


# -- causal depthwise conv1d -------------------------------------------------------------


@triton.jit
def _sequence_of_tokens(query_start_loc_ptr, tokens, num_seqs, num_search_steps):
    """For each token, the last sequence whose start is at or before it (a binary
    search over the sequences' starts; zero-length sequences are skipped over)."""
    low = tl.zeros_like(tokens)
    high = tl.zeros_like(tokens) + (num_seqs - 1)
    for _ in range(num_search_steps):
        middle = (low + high + 1) // 2
        start = tl.load(query_start_loc_ptr + middle)
        at_or_before = start <= tokens
        low = tl.where(at_or_before, middle, low)
        high = tl.where(at_or_before, high, middle - 1)
    return low


@triton.jit
def _conv_varlen_kernel(x_ptr, weight_ptr, bias_ptr, state_ptr, out_ptr, query_start_loc_ptr,
                        context_lens_ptr, slots_ptr, num_tokens, num_seqs, num_search_steps,
                        x_row_stride, state_slot_stride, state_channel_stride,
                        CHANNELS: tl.constexpr, WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr,
                        BLOCK_TOKENS: tl.constexpr, BLOCK_CHANNELS: tl.constexpr):
    tokens = tl.program_id(0) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
    channels = tl.program_id(1) * BLOCK_CHANNELS + tl.arange(0, BLOCK_CHANNELS)
    token_mask = tokens < num_tokens
    channel_mask = channels < CHANNELS
    sequences = _sequence_of_tokens(query_start_loc_ptr, tokens, num_seqs, num_search_steps)
    starts = tl.load(query_start_loc_ptr + sequences)
    ends = tl.load(query_start_loc_ptr + sequences + 1)
    # a sequence that computed tokens before this step continues from its slot
    num_computed = tl.load(context_lens_ptr + sequences) - (ends - starts)
    slots = tl.load(slots_ptr + sequences)
    from_state = (num_computed > 0) & (slots >= 0)
    acc = tl.zeros((BLOCK_TOKENS, BLOCK_CHANNELS), dtype=tl.float32)
    for tap in tl.static_range(WIDTH):
        sources = tokens - (WIDTH - 1) + tap
        in_step = sources >= starts
        x = tl.load(x_ptr + sources.to(tl.int64)[:, None] * x_row_stride + channels[None, :],
                    mask=(token_mask & in_step)[:, None] & channel_mask[None, :], other=0.0)
        # before the chunk's start: the (starts - sources)-th input back, in the state
        columns = (WIDTH - 1) - (starts - sources)
        state = tl.load(state_ptr + slots.to(tl.int64)[:, None] * state_slot_stride
                        + channels[None, :] * state_channel_stride + columns[:, None],
                        mask=(token_mask & ~in_step & from_state)[:, None]
                        & channel_mask[None, :], other=0.0)
        weight = tl.load(weight_ptr + channels * WIDTH + tap, mask=channel_mask, other=0.0)
        acc += weight.to(tl.float32)[None, :] * (x.to(tl.float32) + state.to(tl.float32))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + channels, mask=channel_mask, other=0.0).to(tl.float32)[None, :]
    # the conv's output rounds to the activations' dtype before the SiLU (as torch's do)
    conv = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
    out = conv * tl.sigmoid(conv)
    tl.store(out_ptr + tokens.to(tl.int64)[:, None] * CHANNELS + channels[None, :],
             out.to(out_ptr.dtype.element_ty), mask=token_mask[:, None] & channel_mask[None, :])


@triton.jit
def _conv_state_update_kernel(x_ptr, state_ptr, query_start_loc_ptr, context_lens_ptr,
                              slots_ptr, x_row_stride, state_slot_stride, state_channel_stride,
                              CHANNELS: tl.constexpr, WIDTH: tl.constexpr,
                              BLOCK_CHANNELS: tl.constexpr):
    """A sequence's last WIDTH - 1 inputs into its slot. Runs after the conv, which
    read the old state: each program reads its columns whole before it writes."""
    sequence = tl.program_id(0)
    channels = tl.program_id(1) * BLOCK_CHANNELS + tl.arange(0, BLOCK_CHANNELS)
    channel_mask = channels < CHANNELS
    slot = tl.load(slots_ptr + sequence).to(tl.int64)
    start = tl.load(query_start_loc_ptr + sequence)
    end = tl.load(query_start_loc_ptr + sequence + 1)
    if slot >= 0:
        num_computed = tl.load(context_lens_ptr + sequence) - (end - start)
        columns = tl.arange(0, 4)  # WIDTH - 1 <= 3: a power of two to hold them
        sources = end - (WIDTH - 1) + columns
        in_step = sources >= start
        column_mask = columns < WIDTH - 1
        x = tl.load(x_ptr + sources.to(tl.int64)[:, None] * x_row_stride + channels[None, :],
                    mask=(in_step & column_mask)[:, None] & channel_mask[None, :], other=0.0)
        old_columns = (WIDTH - 1) - (start - sources)
        state_row = state_ptr + slot * state_slot_stride + channels[None, :] * state_channel_stride
        old = tl.load(state_row + old_columns[:, None],
                      mask=(~in_step & column_mask & (num_computed > 0))[:, None]
                      & channel_mask[None, :], other=0.0)
        new = tl.where(in_step[:, None], x.to(state_ptr.dtype.element_ty),
                       old.to(state_ptr.dtype.element_ty))
        tl.debug_barrier()  # every old column is read before any is written
        tl.store(state_row + columns[:, None], new,
                 mask=column_mask[:, None] & channel_mask[None, :])


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         conv_state: torch.Tensor, query_start_loc: torch.Tensor,
                         context_lens: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """SiLU(causal depthwise conv1d) of ``x`` [tokens, channels] (rows may be strided)
    over the step's sequences (``query_start_loc`` [seqs + 1], ``context_lens`` and
    ``slots`` [seqs]); ``weight`` [channels, width]. Each sequence starts from its
    slot's state in ``conv_state`` [slots, channels, width - 1] (zeros when it has
    computed nothing yet) and leaves its last inputs there. -> [tokens, channels]."""
    num_tokens, channels = x.shape
    width = weight.shape[-1]
    assert 2 <= width <= 4 and x.stride(1) == 1 and conv_state.stride(2) == 1
    weight = weight.reshape(channels, width)
    out = torch.empty((num_tokens, channels), dtype=x.dtype, device=x.device)
    num_seqs = slots.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    num_search_steps = max(num_seqs - 1, 1).bit_length()
    grid = (triton.cdiv(num_tokens, CONV_BLOCK_TOKENS), triton.cdiv(channels, CONV_BLOCK_CHANNELS))
    _conv_varlen_kernel[grid](
        x, weight, bias if bias is not None else weight, conv_state, out, query_start_loc,
        context_lens, slots, num_tokens, num_seqs, num_search_steps, x.stride(0),
        conv_state.stride(0), conv_state.stride(1), CHANNELS=channels, WIDTH=width,
        HAS_BIAS=bias is not None, BLOCK_TOKENS=CONV_BLOCK_TOKENS,
        BLOCK_CHANNELS=CONV_BLOCK_CHANNELS)
    _conv_state_update_kernel[(num_seqs, triton.cdiv(channels, CONV_BLOCK_CHANNELS))](
        x, conv_state, query_start_loc, context_lens, slots, x.stride(0), conv_state.stride(0),
        conv_state.stride(1), CHANNELS=channels, WIDTH=width,
        BLOCK_CHANNELS=CONV_BLOCK_CHANNELS)
    return out


@triton.jit
def _conv_decode_kernel(x_ptr, weight_ptr, bias_ptr, state_ptr, out_ptr, context_lens_ptr,
                        slots_ptr, x_row_stride, state_slot_stride, state_channel_stride,
                        CHANNELS: tl.constexpr, WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr,
                        BLOCK_CHANNELS: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)  # gpu/kernels/pdl.py
    row = tl.program_id(0).to(tl.int64)
    channels = tl.program_id(1) * BLOCK_CHANNELS + tl.arange(0, BLOCK_CHANNELS)
    channel_mask = channels < CHANNELS
    slot = tl.load(slots_ptr + row).to(tl.int64)
    # a one-token first chunk (context length 1) starts from zeros
    from_state = (tl.load(context_lens_ptr + row) > 1) & (slot >= 0)
    x = tl.load(x_ptr + row * x_row_stride + channels, mask=channel_mask, other=0.0)
    weight_row = weight_ptr + channels * WIDTH
    state_row = state_ptr + slot * state_slot_stride + channels * state_channel_stride
    state_mask = channel_mask & from_state
    # the state's columns, oldest first, kept to shift them after the sum; the taps
    # summed in the varlen kernel's order (the same bits for a decode row either way)
    column0 = tl.load(state_row, mask=state_mask, other=0.0)
    acc = tl.load(weight_row, mask=channel_mask, other=0.0).to(tl.float32) \
        * column0.to(tl.float32)
    column1 = column0
    column2 = column0
    if WIDTH > 2:
        column1 = tl.load(state_row + 1, mask=state_mask, other=0.0)
        acc += tl.load(weight_row + 1, mask=channel_mask, other=0.0).to(tl.float32) \
            * column1.to(tl.float32)
    if WIDTH > 3:
        column2 = tl.load(state_row + 2, mask=state_mask, other=0.0)
        acc += tl.load(weight_row + 2, mask=channel_mask, other=0.0).to(tl.float32) \
            * column2.to(tl.float32)
    acc += tl.load(weight_row + (WIDTH - 1), mask=channel_mask, other=0.0).to(tl.float32) \
        * x.to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + channels, mask=channel_mask, other=0.0).to(tl.float32)
    conv = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
    out = conv * tl.sigmoid(conv)
    tl.store(out_ptr + row * CHANNELS + channels, out.to(out_ptr.dtype.element_ty),
             mask=channel_mask)
    store_mask = channel_mask & (slot >= 0)
    new_last = x.to(state_ptr.dtype.element_ty)
    if WIDTH == 2:
        tl.store(state_row, new_last, mask=store_mask)
    elif WIDTH == 3:
        tl.store(state_row, column1, mask=store_mask)
        tl.store(state_row + 1, new_last, mask=store_mask)
    else:
        tl.store(state_row, column1, mask=store_mask)
        tl.store(state_row + 1, column2, mask=store_mask)
        tl.store(state_row + 2, new_last, mask=store_mask)


def causal_conv1d_decode(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         conv_state: torch.Tensor, context_lens: torch.Tensor,
                         slots: torch.Tensor) -> torch.Tensor:
    """The conv1d with SiLU of one token per sequence (``x`` [seqs, channels]), each
    sequence's state in ``conv_state`` shifted by its token in place. A sequence of
    context length 1 (a one-token first chunk) starts from zeros. -> [seqs, channels]."""
    num_seqs, channels = x.shape
    width = weight.shape[-1]
    assert 2 <= width <= 4 and x.stride(1) == 1 and conv_state.stride(2) == 1
    weight = weight.reshape(channels, width)
    out = torch.empty((num_seqs, channels), dtype=x.dtype, device=x.device)
    if num_seqs == 0:
        return out
    pdl = pdl_launch(x.device)
    _conv_decode_kernel[(num_seqs, triton.cdiv(channels, CONV_BLOCK_CHANNELS))](
        x, weight, bias if bias is not None else weight, conv_state, out, context_lens, slots,
        x.stride(0), conv_state.stride(0), conv_state.stride(1), CHANNELS=channels,
        WIDTH=width, HAS_BIAS=bias is not None, BLOCK_CHANNELS=CONV_BLOCK_CHANNELS,
        **pdl)
    return out


# -- gates -------------------------------------------------------------------------------


@triton.jit
def _softplus(x):
    # torch's softplus (beta 1, threshold 20)
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def _gates_kernel(a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, num_tokens,
                  a_row_stride, b_row_stride, HEADS: tl.constexpr, BLOCK: tl.constexpr):
    index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = index < num_tokens * HEADS
    tokens, heads = index // HEADS, index % HEADS
    a = tl.load(a_ptr + tokens * a_row_stride + heads, mask=mask, other=0.0)
    b = tl.load(b_ptr + tokens * b_row_stride + heads, mask=mask, other=0.0)
    a_log = tl.load(a_log_ptr + heads, mask=mask, other=0.0).to(tl.float32)
    # a + dt_bias in float32 (transformers: a.float() + dt_bias)
    shifted = a.to(tl.float32) + tl.load(dt_bias_ptr + heads, mask=mask, other=0.0).to(tl.float32)
    tl.store(g_ptr + index, -tl.exp(a_log) * _softplus(shifted), mask=mask)
    tl.store(beta_ptr + index, tl.sigmoid(b.to(tl.float32)).to(beta_ptr.dtype.element_ty),
             mask=mask)


def gdn_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(g [tokens, heads] float32, beta [tokens, heads] in b's dtype) from the
    projections ``a`` and ``b`` [tokens, value heads] (rows may be strided):
    ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``."""
    num_tokens, heads = a.shape
    assert a.stride(1) == 1 and b.stride(1) == 1
    g = torch.empty((num_tokens, heads), dtype=torch.float32, device=a.device)
    beta = torch.empty((num_tokens, heads), dtype=b.dtype, device=b.device)
    if num_tokens:
        _gates_kernel[(triton.cdiv(num_tokens * heads, GATE_BLOCK),)](
            a, b, a_log, dt_bias, g, beta, num_tokens, a.stride(0), b.stride(0), HEADS=heads,
            BLOCK=GATE_BLOCK)
    return g, beta


# -- the gated delta rule, one token per sequence --------------------------------------


@triton.jit
def _gated_delta_rule_decode_kernel(
        q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, state_ptr, out_ptr,
        context_lens_ptr, slots_ptr, query_start_loc_ptr, scale, q_row_stride, k_row_stride,
        v_row_stride, a_row_stride, b_row_stride, state_slot_stride, KEY_HEADS: tl.constexpr,
        VALUE_HEADS: tl.constexpr, KEY_DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
        BLOCK_KEYS: tl.constexpr, BLOCK_VALUES: tl.constexpr, VARLEN: tl.constexpr,
        USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)  # gpu/kernels/pdl.py
    sequence_head = tl.program_id(0).to(tl.int64)
    sequence, value_head = sequence_head // VALUE_HEADS, sequence_head % VALUE_HEADS
    key_head = value_head // (VALUE_HEADS // KEY_HEADS)
    keys = tl.arange(0, BLOCK_KEYS)
    values = tl.program_id(1) * BLOCK_VALUES + tl.arange(0, BLOCK_VALUES)
    slot = tl.load(slots_ptr + sequence).to(tl.int64)
    if VARLEN:
        # the sequence's token is its first row; it runs only if it is its only one
        # and the sequence has a slot (the others: chunked, empty or padding)
        row = tl.load(query_start_loc_ptr + sequence).to(tl.int64)
        runs = (tl.load(query_start_loc_ptr + sequence + 1) - row == 1) & (slot >= 0)
    else:
        row = sequence
        runs = sequence >= 0  # every row runs (a padding row too: its state is not stored)
    key_mask, value_mask = (keys < KEY_DIM) & runs, (values < VALUE_DIM) & runs
    from_state = (tl.load(context_lens_ptr + sequence) > 1) & (slot >= 0)
    state_block = (state_ptr + slot * state_slot_stride + value_head * KEY_DIM * VALUE_DIM
                   + keys[:, None] * VALUE_DIM + values[None, :])
    block_mask = key_mask[:, None] & value_mask[None, :]
    state = tl.load(state_block, mask=block_mask & from_state, other=0.0).to(tl.float32)
    q = tl.load(q_ptr + row * q_row_stride + key_head * KEY_DIM + keys, mask=key_mask,
                other=0.0).to(tl.float32)
    k = tl.load(k_ptr + row * k_row_stride + key_head * KEY_DIM + keys, mask=key_mask,
                other=0.0).to(tl.float32)
    v = tl.load(v_ptr + row * v_row_stride + value_head * VALUE_DIM + values, mask=value_mask,
                other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
    a = tl.load(a_ptr + row * a_row_stride + value_head, mask=runs, other=0.0).to(tl.float32)
    shifted = a + tl.load(dt_bias_ptr + value_head).to(tl.float32)
    g = -tl.exp(tl.load(a_log_ptr + value_head).to(tl.float32)) * _softplus(shifted)
    b = tl.load(b_ptr + row * b_row_stride + value_head, mask=runs, other=0.0)
    beta = tl.sigmoid(b.to(tl.float32)).to(b.dtype).to(tl.float32)  # rounds as torch's
    state = state * tl.exp(g)
    delta = (v - tl.sum(state * k[:, None], 0)) * beta
    state = state + k[:, None] * delta[None, :]
    out = tl.sum(state * q[:, None], 0)
    tl.store(out_ptr + (row * VALUE_HEADS + value_head) * VALUE_DIM + values,
             out.to(out_ptr.dtype.element_ty), mask=value_mask)
    tl.store(state_block, state, mask=block_mask & (slot >= 0))


def gated_delta_rule_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                            b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                            recurrent_state: torch.Tensor, context_lens: torch.Tensor,
                            slots: torch.Tensor, scale: float,
                            query_start_loc: torch.Tensor | None = None) -> torch.Tensor:
    """One token per sequence of the gated delta rule, q and k l2-normalised (as
    transformers' ``use_qk_l2norm_in_kernel``): ``q``, ``k`` [rows, key heads, key dim],
    ``v`` [rows, value heads, value dim] (each may be a strided view of the conv's
    output), ``a``, ``b`` [rows, value heads]; each sequence's state in
    ``recurrent_state`` [slots, value heads, key dim, value dim] float32, updated in
    place (zeros where the context length is 1). -> [rows, value heads, value dim].

    Without ``query_start_loc`` row i is sequence i's token. With it (a step of any
    layout, ``context_lens`` and ``slots`` one per sequence) each sequence of exactly
    one token and a slot runs from its row there; the other rows of the output are
    zeros and the other sequences' states are untouched (their tokens are another
    kernel's: fla_gated_delta_rule.py)."""
    num_rows, key_heads, key_dim = q.shape
    _, value_heads, value_dim = v.shape
    assert recurrent_state.dtype == torch.float32 and _slots_are_contiguous(recurrent_state)
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
    assert q.stride(1) == key_dim and k.stride(1) == key_dim and v.stride(1) == value_dim
    varlen = query_start_loc is not None
    out = (torch.zeros if varlen else torch.empty)(
        (num_rows, value_heads, value_dim), dtype=v.dtype, device=v.device)
    num_seqs = slots.shape[0]
    if num_rows == 0 or num_seqs == 0:
        return out
    block_values = min(DECODE_BLOCK_VALUES, triton.next_power_of_2(value_dim))
    grid = (num_seqs * value_heads, triton.cdiv(value_dim, block_values))
    pdl = pdl_launch(q.device)
    _gated_delta_rule_decode_kernel[grid](
        q, k, v, a, b, a_log, dt_bias, recurrent_state, out, context_lens, slots,
        query_start_loc if varlen else slots, scale, q.stride(0), k.stride(0), v.stride(0),
        a.stride(0), b.stride(0), recurrent_state.stride(0), KEY_HEADS=key_heads,
        VALUE_HEADS=value_heads, KEY_DIM=key_dim, VALUE_DIM=value_dim,
        BLOCK_KEYS=triton.next_power_of_2(key_dim), BLOCK_VALUES=block_values, VARLEN=varlen,
        num_warps=1, **pdl)
    return out


# -- states in and out of a dense batch --------------------------------------------------


@triton.jit
def _gather_states_kernel(state_ptr, dense_ptr, query_start_loc_ptr, context_lens_ptr,
                          slots_ptr, state_slot_stride, SLOT_SIZE: tl.constexpr,
                          BLOCK: tl.constexpr):
    sequence = tl.program_id(0).to(tl.int64)
    index = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = index < SLOT_SIZE
    slot = tl.load(slots_ptr + sequence).to(tl.int64)
    query_len = tl.load(query_start_loc_ptr + sequence + 1) - tl.load(query_start_loc_ptr
                                                                       + sequence)
    from_state = (tl.load(context_lens_ptr + sequence) > query_len) & (slot >= 0)
    state = tl.load(state_ptr + slot * state_slot_stride + index, mask=mask & from_state,
                    other=0.0)
    tl.store(dense_ptr + sequence * SLOT_SIZE + index, state, mask=mask)


@triton.jit
def _scatter_states_kernel(dense_ptr, state_ptr, slots_ptr, state_slot_stride,
                           SLOT_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    sequence = tl.program_id(0).to(tl.int64)
    index = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slots_ptr + sequence).to(tl.int64)
    mask = (index < SLOT_SIZE) & (slot >= 0)
    state = tl.load(dense_ptr + sequence * SLOT_SIZE + index, mask=mask)
    tl.store(state_ptr + slot * state_slot_stride + index, state, mask=mask)


STATE_BLOCK = 1024


def gather_states(states: torch.Tensor, query_start_loc: torch.Tensor,
                  context_lens: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The step's sequences' states [seqs, ...] from their slots of ``states``
    [slots, ...]: zeros for a sequence that computed nothing yet, or a padding one."""
    num_seqs = slots.shape[0]
    slot_size = states[0].numel()
    assert _slots_are_contiguous(states)
    dense = torch.empty((num_seqs, *states.shape[1:]), dtype=states.dtype, device=states.device)
    if num_seqs:
        _gather_states_kernel[(num_seqs, triton.cdiv(slot_size, STATE_BLOCK))](
            states, dense, query_start_loc, context_lens, slots, states.stride(0),
            SLOT_SIZE=slot_size, BLOCK=STATE_BLOCK)
    return dense


def scatter_states(dense: torch.Tensor, states: torch.Tensor, slots: torch.Tensor) -> None:
    """Each sequence's state of ``dense`` into its slot of ``states`` (padding
    sequences, slot < 0, write nothing)."""
    num_seqs = slots.shape[0]
    slot_size = states[0].numel()
    assert _slots_are_contiguous(states) and dense.is_contiguous()
    if num_seqs:
        _scatter_states_kernel[(num_seqs, triton.cdiv(slot_size, STATE_BLOCK))](
            dense, states, slots, states.stride(0), SLOT_SIZE=slot_size, BLOCK=STATE_BLOCK)


# -- gated RMSNorm -----------------------------------------------------------------------


@triton.jit
def _gated_rms_norm_kernel(x_ptr, z_ptr, weight_ptr, out_ptr, eps, x_token_stride,
                           x_head_stride, z_token_stride, z_head_stride, HEADS: tl.constexpr,
                           DIM: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)  # gpu/kernels/pdl.py
    row = tl.program_id(0).to(tl.int64)
    token, head = row // HEADS, row % HEADS
    columns = tl.arange(0, BLOCK)
    mask = columns < DIM
    x = tl.load(x_ptr + token * x_token_stride + head * x_head_stride + columns, mask=mask,
                other=0.0)
    z = tl.load(z_ptr + token * z_token_stride + head * z_head_stride + columns, mask=mask,
                other=0.0).to(tl.float32)
    x32 = x.to(tl.float32)
    normed = (x32 * tl.rsqrt(tl.sum(x32 * x32, 0) / DIM + eps)).to(x.dtype)
    weight = tl.load(weight_ptr + columns, mask=mask, other=0.0)
    # weight * normed in the activations' dtype, then times SiLU(z) in float32
    scaled = (weight.to(tl.float32) * normed.to(tl.float32)).to(x.dtype).to(tl.float32)
    out = scaled * (z * tl.sigmoid(z))
    tl.store(out_ptr + row * DIM + columns, out.to(out_ptr.dtype.element_ty), mask=mask)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
                   ) -> torch.Tensor:
    """RMSNorm of each head of ``x`` [tokens, heads, dim] times SiLU(``z``) (same shape;
    either may be a strided view) -> [tokens, heads, dim], contiguous."""
    num_tokens, heads, dim = x.shape
    assert x.stride(2) == 1 and z.stride(2) == 1 and z.shape == x.shape
    out = torch.empty((num_tokens, heads, dim), dtype=x.dtype, device=x.device)
    if num_tokens:
        pdl = pdl_launch(x.device)
        _gated_rms_norm_kernel[(num_tokens * heads,)](
            x, z, weight, out, eps, x.stride(0), x.stride(1), z.stride(0), z.stride(1),
            HEADS=heads, DIM=dim, BLOCK=triton.next_power_of_2(dim), **pdl)
    return out
