"""The Gated DeltaNet kernels (gpu/kernels/triton_linear_attention.py) against torch
references written from transformers' Qwen3.5 code.

Interpreter mode on the CPU (float32, small shapes), compiled in bf16 on CUDA.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

HAS_CUDA = torch.cuda.is_available()  # without it, conftest.py runs Triton's interpreter

from trio_llm.gpu.kernels import triton_linear_attention as kernels  # noqa: E402

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
DTYPE = torch.bfloat16 if HAS_CUDA else torch.float32


# float32 results (states, gates) against torch's: other sum orders and, on CUDA, the
# GPU's exp and rsqrt
FLOAT32_TOLERANCE = 1e-4 if HAS_CUDA else 1e-5


def close(out, expected, tolerance=None):
    """Relative error under one bf16 rounding on CUDA, float32 sums otherwise."""
    tolerance = tolerance or (1e-2 if HAS_CUDA else 1e-5)
    error = ((out.double() - expected.double()).norm() / expected.double().norm()).item()
    return error < tolerance


def random(*shape, seed=0, dtype=None):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(dtype or DTYPE).to(DEVICE)


def ints(values):
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


# -- references ----------------------------------------------------------------------------


def reference_conv(x, weight, bias, initial):
    """transformers' causal_conv1d: one sequence ``x`` [tokens, channels] after the
    inputs ``initial`` [channels, width - 1] -> (SiLU(conv), its last width - 1 inputs)."""
    width = weight.shape[-1]
    full = torch.cat([initial.to(x.dtype), x.t()], dim=-1)  # [channels, width - 1 + tokens]
    out = F.conv1d(full[None].to(weight.dtype), weight[:, None, :], bias, groups=x.shape[1])
    return F.silu(out[0].t()).to(x.dtype), full[:, -(width - 1):]


def reference_gated_delta_rule(q, k, v, g, beta, state):
    """transformers' torch_recurrent_gated_delta_rule on one sequence: q, k [tokens,
    heads, K], v [tokens, value heads, V], g, beta [tokens, value heads], state
    [value heads, K, V] -> (out, final state), float32."""
    repeat = v.shape[1] // q.shape[1]
    q = q.float() * torch.rsqrt((q.float() ** 2).sum(-1, keepdim=True) + 1e-6)
    k = k.float() * torch.rsqrt((k.float() ** 2).sum(-1, keepdim=True) + 1e-6)
    q, k = q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)
    q = q / q.shape[-1] ** 0.5
    state = state.clone().float()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for t in range(v.shape[0]):
        state = state * g[t].float().exp()[:, None, None]
        memory = (state * k[t][:, :, None]).sum(1)
        delta = (v[t].float() - memory) * beta[t].float()[:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out[t] = (state * q[t][:, :, None]).sum(1)
    return out, state


def reference_gates(a, b, a_log, dt_bias):
    return -a_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid()


# -- conv1d --------------------------------------------------------------------------------


CHANNELS, WIDTH = 200, 4  # more channels than one block


@pytest.mark.parametrize("has_bias", [False, True])
def test_varlen_conv_continues_each_sequence_from_its_slot(has_bias):
    """Three sequences (a long prefill from zeros, a chunk continuing its slot's state,
    a one-token decode row) and a padding sequence: outputs and new states match the
    reference; the untouched slot keeps its state."""
    lengths, computed, slots = [21, 5, 1, 3], [0, 7, 12, 0], [2, 0, 3, -1]
    num_tokens = sum(lengths)
    x = random(num_tokens, CHANNELS, seed=1)
    weight = random(CHANNELS, WIDTH, seed=2)
    bias = random(CHANNELS, seed=3) if has_bias else None
    state = random(5, CHANNELS, WIDTH - 1, seed=4)
    before = state.clone()
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    out = kernels.causal_conv1d_varlen(
        x, weight, bias, state, ints(starts),
        ints([c + n for c, n in zip(computed, lengths, strict=True)]), ints(slots))
    for index, (slot, num_computed) in enumerate(zip(slots, computed, strict=True)):
        if slot < 0:
            continue
        initial = before[slot] if num_computed else torch.zeros_like(before[slot])
        expected, final = reference_conv(x[starts[index]:starts[index + 1]], weight, bias,
                                         initial)
        assert close(out[starts[index]:starts[index + 1]], expected)
        assert torch.equal(state[slot], final)
    assert torch.equal(state[1], before[1]) and torch.equal(state[4], before[4])


def test_varlen_conv_reads_strided_rows():
    """x may be a column slice of a wider projection (its row stride larger)."""
    wide = random(6, CHANNELS + 40, seed=5)
    x = wide[:, 40:]
    weight = random(CHANNELS, WIDTH, seed=6)
    state = random(2, CHANNELS, WIDTH - 1, seed=7)
    expected_state = state.clone()
    out = kernels.causal_conv1d_varlen(x, weight, None, state, ints([0, 6]), ints([6]), ints([1]))
    expected, final = reference_conv(x.contiguous(), weight, None,
                                     torch.zeros(CHANNELS, WIDTH - 1, device=DEVICE))
    expected_state[1] = final
    assert close(out, expected) and torch.equal(state, expected_state)


def test_decode_conv_equals_the_varlen_conv_token_by_token():
    """Decode rows (one of them a one-token first chunk, one padding) shift their state
    in place exactly as the varlen kernel leaves it."""
    weight = random(CHANNELS, WIDTH, seed=8)
    bias = random(CHANNELS, seed=9)
    state = random(4, CHANNELS, WIDTH - 1, seed=10)
    twin = state.clone()
    x = random(3, CHANNELS, seed=11)
    context_lens, slots = ints([9, 1, 4]), ints([1, 3, -1])
    out = kernels.causal_conv1d_decode(x, weight, bias, state, context_lens, slots)
    expected = kernels.causal_conv1d_varlen(x, weight, bias, twin, ints([0, 1, 2, 3]),
                                            context_lens, slots)
    assert torch.equal(out[:2], expected[:2])
    assert torch.equal(state, twin)
    initial = torch.zeros(CHANNELS, WIDTH - 1, device=DEVICE)
    reference, final = reference_conv(x[1:2], weight, bias, initial)
    assert close(out[1:2], reference) and torch.equal(state[3], final)


# -- gates and the gated delta rule ---------------------------------------------------------


def test_gates_match_the_layer():
    a, b = random(7, 6, seed=12), random(7, 6, seed=13)
    a[0, 0] = 30.0  # softplus's linear branch
    a_log = random(6, seed=14, dtype=torch.float32)
    dt_bias = random(6, seed=15, dtype=torch.float32)
    g, beta = kernels.gdn_gates(a, b, a_log, dt_bias)
    expected_g, expected_beta = reference_gates(a, b, a_log, dt_bias)
    assert close(g, expected_g, FLOAT32_TOLERANCE) and close(beta, expected_beta)


KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM = 2, 4, 16, 24


def decode_inputs(num_seqs, seed):
    q = random(num_seqs, KEY_HEADS, KEY_DIM, seed=seed)
    k = random(num_seqs, KEY_HEADS, KEY_DIM, seed=seed + 1)
    v = random(num_seqs, VALUE_HEADS, VALUE_DIM, seed=seed + 2)
    a = random(num_seqs, VALUE_HEADS, seed=seed + 3)
    b = random(num_seqs, VALUE_HEADS, seed=seed + 4)
    return q, k, v, a, b


def test_decode_gated_delta_rule_updates_each_slot_in_place():
    """Four rows (two continuing their slots, a one-token first chunk, a padding row):
    outputs and states match the recurrence; other slots are untouched."""
    q, k, v, a, b = decode_inputs(4, seed=20)
    a_log = random(VALUE_HEADS, seed=30, dtype=torch.float32)
    dt_bias = random(VALUE_HEADS, seed=31, dtype=torch.float32)
    state = random(6, VALUE_HEADS, KEY_DIM, VALUE_DIM, seed=32, dtype=torch.float32)
    before = state.clone()
    context_lens, slots = ints([5, 1, 3, 2]), ints([4, 0, 2, -1])
    scale = KEY_DIM ** -0.5
    out = kernels.gated_delta_rule_decode(q, k, v, a, b, a_log, dt_bias, state, context_lens,
                                          slots, scale)
    g, beta = reference_gates(a, b, a_log, dt_bias)
    for row, slot in enumerate([4, 0, 2]):
        initial = before[slot] if context_lens[row] > 1 else torch.zeros_like(before[slot])
        expected, final = reference_gated_delta_rule(q[row:row + 1], k[row:row + 1],
                                                     v[row:row + 1], g[row:row + 1],
                                                     beta[row:row + 1], initial)
        assert close(out[row:row + 1], expected)
        assert close(state[slot], final, FLOAT32_TOLERANCE)
    for slot in (1, 3, 5):
        assert torch.equal(state[slot], before[slot])


def test_varlen_decode_runs_only_the_one_token_sequences():
    """In its varlen mode the decode kernel finds each sequence's row by
    query_start_loc and runs the one-token sequences with a slot only (a decode row, a
    one-token first chunk, a one-token chunk continuing its slot), with the bits the
    row-per-sequence mode gives them; chunks of two tokens or more, an empty sequence and
    padding sequences (slot -1, of one token and of three) leave zeros in the output and
    their slots untouched."""
    lengths = [1, 3, 1, 0, 1, 1, 2, 3]
    contexts = [7, 3, 1, 0, 5, 1, 9, 0]
    slots = [4, 0, 2, 1, 5, -1, 3, -1]
    num_tokens = sum(lengths)
    q, k, v, a, b = decode_inputs(num_tokens, seed=100)
    a_log = random(VALUE_HEADS, seed=110, dtype=torch.float32)
    dt_bias = random(VALUE_HEADS, seed=111, dtype=torch.float32)
    state = random(7, VALUE_HEADS, KEY_DIM, VALUE_DIM, seed=112, dtype=torch.float32)
    twin = state.clone()
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    scale = KEY_DIM ** -0.5
    out = kernels.gated_delta_rule_decode(q, k, v, a, b, a_log, dt_bias, state, ints(contexts),
                                          ints(slots), scale, query_start_loc=ints(starts))
    runs = [index for index, length in enumerate(lengths) if length == 1 and slots[index] >= 0]
    rows = [starts[index] for index in runs]
    expected = kernels.gated_delta_rule_decode(
        q[rows], k[rows], v[rows], a[rows], b[rows], a_log, dt_bias, twin,
        ints([contexts[index] for index in runs]), ints([slots[index] for index in runs]), scale)
    assert torch.equal(out[rows], expected) and torch.equal(state, twin)
    others = [row for row in range(num_tokens) if row not in rows]
    assert not out[others].any()
    assert torch.equal(state[[0, 1, 3, 6]], random(7, VALUE_HEADS, KEY_DIM, VALUE_DIM, seed=112,
                                                   dtype=torch.float32)[[0, 1, 3, 6]])


def test_decode_gated_delta_rule_reads_the_conv_output_in_place():
    """q, k and v as strided views of one [seqs, 2 K + V] row (the conv's output)."""
    key_width, value_width = KEY_HEADS * KEY_DIM, VALUE_HEADS * VALUE_DIM
    mixed = random(2, 2 * key_width + value_width, seed=40)
    q = mixed[:, :key_width].unflatten(1, (KEY_HEADS, KEY_DIM))
    k = mixed[:, key_width:2 * key_width].unflatten(1, (KEY_HEADS, KEY_DIM))
    v = mixed[:, 2 * key_width:].unflatten(1, (VALUE_HEADS, VALUE_DIM))
    a, b = random(2, VALUE_HEADS, seed=41), random(2, VALUE_HEADS, seed=42)
    a_log = random(VALUE_HEADS, seed=43, dtype=torch.float32)
    dt_bias = random(VALUE_HEADS, seed=44, dtype=torch.float32)
    state = random(2, VALUE_HEADS, KEY_DIM, VALUE_DIM, seed=45, dtype=torch.float32)
    twin = state.clone()
    args = (a_log, dt_bias)
    out = kernels.gated_delta_rule_decode(q, k, v, a, b, *args, state, ints([3, 3]),
                                          ints([1, 0]), 0.25)
    expected = kernels.gated_delta_rule_decode(q.contiguous(), k.contiguous(), v.contiguous(),
                                               a, b, *args, twin, ints([3, 3]), ints([1, 0]),
                                               0.25)
    assert torch.equal(out, expected) and torch.equal(state, twin)


def test_states_gather_and_scatter_by_slot():
    states = random(5, 3, 4, 8, seed=50, dtype=torch.float32)
    query_start_loc, context_lens, slots = ints([0, 4, 5, 9]), ints([10, 1, 4]), ints([3, 1, -1])
    dense = kernels.gather_states(states, query_start_loc, context_lens, slots)
    assert torch.equal(dense[0], states[3])
    assert not dense[1].any() and not dense[2].any()  # no initial state, padding
    written = states.clone()
    new = random(3, 3, 4, 8, seed=51, dtype=torch.float32)
    kernels.scatter_states(new, written, slots)
    expected = states.clone()
    expected[3], expected[1] = new[0], new[1]
    assert torch.equal(written, expected)


# -- gated RMSNorm -------------------------------------------------------------------------


def test_gated_rms_norm_matches_the_layer():
    """transformers' Qwen3_5RMSNormGated: weight * norm(x) in x's dtype, times SiLU(z)
    in float32; x and z may be views of wider rows."""
    heads, dim, eps = 3, 48, 1e-6
    x = random(5, heads, dim, seed=60)
    z = random(5, heads * dim + 16, seed=61)[:, 16:].unflatten(1, (heads, dim))
    weight = random(dim, seed=62)
    out = kernels.gated_rms_norm(x, z, weight, eps)
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    expected = ((weight * normed) * F.silu(z.float())).to(x.dtype)
    assert close(out, expected)


# -- the chunked gated delta rule (fla-core, on CUDA) ---------------------------------------


def test_chunk_index_enumerates_chunks_then_runs_past_the_last_sequence():
    """What fla computes with a host synchronisation, built on the device at a fixed
    size: (sequence, chunk) per chunk in order, zero-length sequences skipped, then rows
    past the last sequence's end (which fla's kernels read as empty)."""
    from trio_llm.gpu.kernels.fla_gated_delta_rule import chunk_index, max_num_chunks

    lengths = [130, 0, 1, 64, 65, 3]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    expected = [(sequence, chunk) for sequence, length in enumerate(lengths)
                for chunk in range(-(-length // 64))]
    num_rows = max_num_chunks(sum(lengths), len(lengths))
    index = chunk_index(cu_seqlens, num_rows).tolist()
    assert num_rows > len(expected)
    assert [tuple(row) for row in index[:len(expected)]] == expected
    last_chunks = -(-lengths[-1] // 64)
    assert index[len(expected):] == [[len(lengths) - 1, last_chunks + extra]
                                     for extra in range(num_rows - len(expected))]


def host_seats(lengths, contexts, slots, num_seats):
    """What chunked_seats computes, on the host: the sequences of two tokens or more
    with a slot, in order, then empty seats."""
    chunked = [index for index, length in enumerate(lengths)
               if length >= 2 and slots[index] >= 0][:num_seats]
    empty = num_seats - len(chunked)
    seat_lengths = [lengths[index] for index in chunked] + [0] * empty
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    source_rows = [row for index in chunked for row in range(starts[index], starts[index + 1])]
    return dict(cu_seqlens=[0, *torch.tensor(seat_lengths).cumsum(0).tolist()],
                context_lens=[contexts[index] for index in chunked] + [0] * empty,
                slots=[slots[index] for index in chunked] + [-1] * empty,
                source_rows=source_rows + [0] * (sum(lengths) - len(source_rows)),
                compact_rows=[source_rows.index(row) if row in source_rows else 0
                              for row in range(sum(lengths))],
                is_chunked_row=[row in source_rows for row in range(sum(lengths))])


# step layouts: decode rows, one-token first and continuing chunks, an empty sequence and
# a padding sequence (slot -1) around 0, 1 or MAX_CHUNKED_SEQS chunks of two tokens or more
MIXED_LAYOUTS = {
    0: ([1, 1, 0, 1, 3], [7, 1, 0, 4, 0], [2, 0, 5, 1, -1]),
    1: ([1, 5, 1, 1, 0, 2], [6, 5, 1, 3, 0, 0], [3, 1, 0, 4, 2, -1]),
    8: ([2, 1, 4, 3, 1, 2, 0, 5, 2, 1, 3, 2, 4],
        [2, 9, 6, 3, 1, 12, 0, 5, 7, 4, 3, 8, 0],
        [0, 9, 1, 2, 10, 3, 11, 4, 5, 12, 6, 7, -1]),
}


@pytest.mark.parametrize("num_chunked", sorted(MIXED_LAYOUTS))
def test_chunked_seats_compact_the_sequences_of_two_tokens_or_more(num_chunked):
    """0, 1 and MAX_CHUNKED_SEQS chunks of two tokens or more (and, with MAX_CHUNKED_SEQS
    seats, as many; with fewer seats, the first ones): their seats, their rows both ways,
    against the host's reading of the layout."""
    from trio_llm.actors.config import MAX_CHUNKED_SEQS
    from trio_llm.gpu.kernels.fla_gated_delta_rule import chunked_seats

    lengths, contexts, slots = MIXED_LAYOUTS[num_chunked]
    assert sum(length >= 2 and slot >= 0 for length, slot in zip(lengths, slots, strict=True)) \
        == min(num_chunked, MAX_CHUNKED_SEQS)
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    for num_seats in {MAX_CHUNKED_SEQS, max(num_chunked, 1)}:
        seats = chunked_seats(ints(starts), ints(contexts), ints(slots), sum(lengths), num_seats)
        expected = host_seats(lengths, contexts, slots, num_seats)
        assert {name: getattr(seats, name).tolist() for name in expected} == expected


def test_mixed_step_matches_the_recurrence_and_the_uncompacted_step():
    """A mixed step (decode rows, one-token first and continuing chunks, chunks of two
    tokens or more from zeros and from their slots, an empty sequence, padding) through
    mixed_gated_delta_rule with MAX_CHUNKED_SEQS seats: outputs and states match the
    float32 recurrence sequence by sequence, and the chunks of two tokens or more give
    what the whole step through the chunked path gives (the same bits on the CPU);
    padding rows are zeros and slots of no sequence untouched."""
    from trio_llm.actors.config import MAX_CHUNKED_SEQS
    from trio_llm.gpu.kernels.fla_gated_delta_rule import (
        chunked_gated_delta_rule,
        mixed_gated_delta_rule,
    )

    heads, value_heads, key_dim, value_dim = ((2, 4, 128, 128) if HAS_CUDA
                                              else (KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM))
    lengths = [1, 70, 1, 1, 0, 5, 1, 2, 4]
    contexts = [9, 70, 1, 6, 0, 12, 3, 2, 0]
    slots = [3, 0, 5, 1, 6, 2, -1, 7, -1]
    num_tokens, starts = sum(lengths), [0, *torch.tensor(lengths).cumsum(0).tolist()]
    q = random(num_tokens, heads, key_dim, seed=120)
    k = random(num_tokens, heads, key_dim, seed=121)
    v = random(num_tokens, value_heads, value_dim, seed=122)
    a, b = random(num_tokens, value_heads, seed=123), random(num_tokens, value_heads, seed=124)
    a_log = random(value_heads, seed=125, dtype=torch.float32)
    dt_bias = random(value_heads, seed=126, dtype=torch.float32)
    state = random(9, value_heads, key_dim, value_dim, seed=127, dtype=torch.float32) * 0.1
    before, whole = state.clone(), state.clone()
    layout = (ints(starts), ints(contexts), ints(slots))
    out = mixed_gated_delta_rule(q, k, v, a, b, a_log, dt_bias, state, *layout,
                                 key_dim ** -0.5, MAX_CHUNKED_SEQS)
    g, beta = kernels.gdn_gates(a, b, a_log, dt_bias)
    uncompacted = chunked_gated_delta_rule(q, k, v, g, beta, whole, *layout, key_dim ** -0.5)
    tolerance = (2e-2, 2e-2) if HAS_CUDA else (1e-5, FLOAT32_TOLERANCE)
    for index, slot in enumerate(slots):
        rows = slice(starts[index], starts[index + 1])
        if slot < 0 or not lengths[index]:
            assert not out[rows].any()
            continue
        continues = contexts[index] > lengths[index]
        initial = before[slot] if continues else torch.zeros_like(before[slot])
        expected, final = reference_gated_delta_rule(q[rows], k[rows], v[rows], g[rows],
                                                     beta[rows], initial)
        assert close(out[rows], expected, tolerance[0])
        assert close(state[slot], final, tolerance[1])
        if lengths[index] >= 2 and not HAS_CUDA:
            assert torch.equal(out[rows], uncompacted[rows])
            assert torch.equal(state[slot], whole[slot])
    assert torch.equal(state[[4, 6, 8]], before[[4, 6, 8]])


@pytest.mark.gpu
def test_mixed_step_replays_from_a_cuda_graph():
    """Captured once (MAX_CHUNKED_SEQS seats), replayed with layouts of 0, 1 and
    MAX_CHUNKED_SEQS chunks of two tokens or more in the same static buffers: the same
    outputs and states as the eager call."""
    from trio_llm.actors.config import MAX_CHUNKED_SEQS
    from trio_llm.gpu.kernels.fla_gated_delta_rule import mixed_gated_delta_rule

    heads, value_heads, dim, num_tokens, num_seqs = 2, 4, 128, 160, 14
    q = random(num_tokens, heads, dim, seed=130)
    k = random(num_tokens, heads, dim, seed=131)
    v = random(num_tokens, value_heads, dim, seed=132)
    a, b = random(num_tokens, value_heads, seed=133), random(num_tokens, value_heads, seed=134)
    a_log = random(value_heads, seed=135, dtype=torch.float32)
    dt_bias = random(value_heads, seed=136, dtype=torch.float32)
    state = random(16, value_heads, dim, dim, seed=137, dtype=torch.float32) * 0.1
    layouts = []
    for lengths, contexts, slots in MIXED_LAYOUTS.values():
        # padded to the graph's sequence count (empty padding sequences) and token count
        num_padding = num_seqs - len(lengths)
        lengths = [*lengths[:-1], num_tokens - sum(lengths[:-1]), *[0] * num_padding]
        layouts.append(([0, *torch.tensor(lengths).cumsum(0).tolist()],
                        [*contexts[:-1], 0, *[0] * num_padding],
                        [*slots[:-1], -1, *[-1] * num_padding]))
    query_start_loc, context_lens, slots = (ints(values) for values in layouts[0])

    def step():
        return mixed_gated_delta_rule(q, k, v, a, b, a_log, dt_bias, state, query_start_loc,
                                      context_lens, slots, dim ** -0.5, MAX_CHUNKED_SEQS)

    assert_replays_as_eager(step, state, (query_start_loc, context_lens, slots), layouts)


def assert_replays_as_eager(step, state, buffers, layouts):
    """``step`` captured once in a CUDA graph, then for each layout (values for the
    static ``buffers``, in order) replayed from the same ``state``: the output and the
    state the eager call gives."""
    saved = state.clone()
    step()  # compiles and autotunes outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for layout in layouts:
        for buffer, values in zip(buffers, layout, strict=True):
            buffer.copy_(ints(values))
        state.copy_(saved)
        graph.replay()
        replayed, replayed_state = out.clone(), state.clone()
        state.copy_(saved)
        eager = step()
        assert torch.equal(replayed, eager) and torch.equal(replayed_state, state)


@pytest.mark.gpu
def test_chunked_gated_delta_rule_continues_each_slot():
    """fla's varlen chunked kernel through the slots: sequences from zeros and from their
    slots, a padding sequence, against the float32 recurrence; untouched slots kept."""
    from trio_llm.gpu.kernels.fla_gated_delta_rule import chunked_gated_delta_rule

    heads, value_heads, key_dim, value_dim = 2, 4, 128, 128
    lengths, computed, slots = [150, 1, 64, 7], [0, 9, 3, 0], [3, 0, 1, -1]
    num_tokens = sum(lengths)
    q = random(num_tokens, heads, key_dim, seed=70)
    k = random(num_tokens, heads, key_dim, seed=71)
    v = random(num_tokens, value_heads, value_dim, seed=72)
    a, b = random(num_tokens, value_heads, seed=73), random(num_tokens, value_heads, seed=74)
    g, beta = reference_gates(a, b, random(value_heads, seed=75, dtype=torch.float32),
                              random(value_heads, seed=76, dtype=torch.float32))
    state = random(5, value_heads, key_dim, value_dim, seed=77, dtype=torch.float32) * 0.1
    before = state.clone()
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    out = chunked_gated_delta_rule(
        q, k, v, g, beta, state, ints(starts),
        ints([c + n for c, n in zip(computed, lengths, strict=True)]), ints(slots),
        key_dim ** -0.5)
    for index, slot in enumerate(slots[:3]):
        rows = slice(starts[index], starts[index + 1])
        initial = before[slot] if computed[index] else torch.zeros_like(before[slot])
        expected, final = reference_gated_delta_rule(q[rows], k[rows], v[rows], g[rows],
                                                     beta[rows], initial)
        assert close(out[rows], expected, 2e-2)
        assert close(state[slot], final, 2e-2)
    assert torch.equal(state[2], before[2]) and torch.equal(state[4], before[4])


@pytest.mark.gpu
def test_chunked_gated_delta_rule_replays_from_a_cuda_graph():
    """Captured once, replayed with other lengths in the same static buffers: the same
    outputs and states as the eager call (no host synchronisation, no stale index)."""
    from trio_llm.gpu.kernels.fla_gated_delta_rule import chunked_gated_delta_rule

    heads, value_heads, dim, num_tokens = 2, 4, 128, 256
    q = random(num_tokens, heads, dim, seed=80)
    k = random(num_tokens, heads, dim, seed=81)
    v = random(num_tokens, value_heads, dim, seed=82)
    g = -torch.rand(num_tokens, value_heads, device=DEVICE)
    beta = torch.rand(num_tokens, value_heads, device=DEVICE).to(DTYPE)
    state = random(4, value_heads, dim, dim, seed=83, dtype=torch.float32) * 0.1
    query_start_loc, context_lens, slots = ints([0, 100, 256, 256]), ints([100, 156, 0]), \
        ints([0, 1, -1])

    def step():
        return chunked_gated_delta_rule(q, k, v, g, beta, state, query_start_loc,
                                        context_lens, slots, dim ** -0.5)

    assert_replays_as_eager(step, state, (query_start_loc, context_lens), [
        ([0, 5, 200, 256], [5, 200, 56]), ([0, 1, 2, 256], [4, 1, 254])])


def test_decode_kernel_agrees_with_fla_fused_recurrent():
    """The in-place decode kernel and fla-core's fused recurrent kernel (states gathered
    by slot and scattered back) compute the same step, and fla's agrees with the float32
    recurrence: the same conventions (state [value heads, K, V], value head h served by
    key head h // (value heads / key heads), g in log space, beta after the sigmoid).
    fla's kernel runs in Triton's interpreter too (it needs no autotuning).

    fla 0.6.0's signature is (q, k, v, g, gk, gv, beta, ...): g and beta go by keyword
    (beta given fifth lands in gk, a per-key log decay, and beta defaults to ones)."""
    fla = pytest.importorskip("fla.ops.gated_delta_rule")

    heads, value_heads, num_seqs = (4, 8, 6) if HAS_CUDA else (KEY_HEADS, VALUE_HEADS, 3)
    key_dim, value_dim = (128, 128) if HAS_CUDA else (KEY_DIM, VALUE_DIM)
    q = random(num_seqs, heads, key_dim, seed=90)
    k = random(num_seqs, heads, key_dim, seed=91)
    v = random(num_seqs, value_heads, value_dim, seed=92)
    a, b = random(num_seqs, value_heads, seed=93), random(num_seqs, value_heads, seed=94)
    a_log = random(value_heads, seed=95, dtype=torch.float32)
    dt_bias = random(value_heads, seed=96, dtype=torch.float32)
    states = random(9, value_heads, key_dim, value_dim, seed=97, dtype=torch.float32) * 0.1
    before = states.clone()
    slots = ints([7, 0, 3, 5, 1, 8][:num_seqs])
    theirs_states = states.clone()
    scale = key_dim ** -0.5
    out = kernels.gated_delta_rule_decode(q, k, v, a, b, a_log, dt_bias, states,
                                          ints([9] * num_seqs), slots, scale)
    g, beta = kernels.gdn_gates(a, b, a_log, dt_bias)
    expected, final = fla.fused_recurrent_gated_delta_rule(
        q[:, None], k[:, None], v[:, None], g=g[:, None], beta=beta[:, None], scale=scale,
        initial_state=theirs_states.index_select(0, slots), output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    theirs_states.index_copy_(0, slots, final)
    assert close(out, expected[:, 0]) and close(states, theirs_states, FLOAT32_TOLERANCE)
    for row, slot in enumerate(slots.tolist()):
        reference, reference_final = reference_gated_delta_rule(
            q[row:row + 1], k[row:row + 1], v[row:row + 1], g[row:row + 1],
            beta[row:row + 1], before[slot])
        assert close(expected[row], reference)
        assert close(final[row], reference_final, FLOAT32_TOLERANCE)
