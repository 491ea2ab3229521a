"""The Triton paged-attention kernels against the torch reference, on random inputs.

On CUDA they run compiled, in bf16; elsewhere in Triton's interpreter
(TRITON_INTERPRET=1, set before triton is imported) on small float32 shapes,
so CI checks the kernels' logic too.
"""

from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()  # without it, conftest.py runs Triton's interpreter

from trio_llm.gpu.attention import paged_attention as reference_attention  # noqa: E402
from trio_llm.gpu.kernels import triton_attention  # noqa: E402
from trio_llm.gpu.quantization import E4M3  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"
DTYPE = torch.bfloat16 if HAS_CUDA else torch.float32
# bf16 operands: relative error between 1e-3 and 1e-2; float32 in the interpreter is exact-ish.
TOLERANCE = 2e-2 if HAS_CUDA else 1e-4


def naive_paged_attention(query, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                          scale):
    """Float64 attention, one sequence at a time, gathering each sequence's cache rows."""
    num_heads = query.shape[1]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group_size = num_heads // num_kv_heads
    out = torch.zeros_like(query, dtype=torch.float64)
    for seq in range(block_tables.shape[0]):
        start, end = int(query_start_loc[seq]), int(query_start_loc[seq + 1])
        context_len, query_len = int(context_lens[seq]), end - start
        positions = torch.arange(context_len, device=query.device)
        blocks = block_tables[seq, positions // block_size].long()
        slots = blocks * block_size + positions % block_size
        keys = k_cache.flatten(0, 1)[slots].double().repeat_interleave(group_size, dim=1)
        values = v_cache.flatten(0, 1)[slots].double().repeat_interleave(group_size, dim=1)
        queries = query[start:end].double()
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale
        query_positions = context_len - query_len + torch.arange(query_len, device=query.device)
        hidden = positions[None, :] > query_positions[:, None]
        scores = scores.masked_fill(hidden[None], float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    return out


def random_batch(generator, *, query_lens, context_lens, num_heads, num_kv_heads, head_dim,
                 block_size):
    """Random query and caches, and block tables that scatter each sequence over shuffled blocks."""
    num_seqs = len(query_lens)
    max_blocks = max(-(-c // block_size) for c in context_lens)
    num_blocks = num_seqs * max_blocks + 3
    permutation = torch.randperm(num_blocks, generator=generator)
    block_tables = permutation[: num_seqs * max_blocks].reshape(num_seqs, max_blocks)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=generator)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    as_device = {"device": DEVICE}
    return (query.to(DTYPE).to(**as_device), k_cache.to(DTYPE).to(**as_device),
            v_cache.to(DTYPE).to(**as_device), block_tables.to(torch.int32).to(**as_device),
            torch.tensor(context_lens, dtype=torch.int32, device=DEVICE),
            query_start_loc.to(torch.int32).to(**as_device))


def relative_error(out, expected):
    assert not out.isnan().any()
    return ((out.double() - expected).norm() / expected.norm()).item()


VARLEN_16 = triton_attention.VarlenConfig(block_m=16)

SHAPES = [
    # (num_heads, num_kv_heads, head_dim, block_size)
    (4, 2, 32, 16),
    (6, 6, 16, 8),
    (8, 1, 64, 32),
    (6, 2, 256, 16),  # the hybrid family's wide heads: tiles of their own
]
if HAS_CUDA:
    SHAPES += [(16, 8, 128, 16), (32, 8, 128, 16)]


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"), SHAPES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_reference(num_heads, num_kv_heads, head_dim, block_size, num_splits):
    generator = torch.Generator().manual_seed(num_heads * 100 + head_dim + num_splits)
    # whole KV tiles only (128, 256), a partial tile only, both
    context_lens = [1, 37, 130, 64, 128, 256]
    batch = random_batch(generator, query_lens=[1] * 6, context_lens=context_lens,
                         num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         block_size=block_size)
    scale = head_dim**-0.5
    out = triton_attention.paged_attention(*batch, scale, num_splits=num_splits)
    assert relative_error(out, naive_paged_attention(*batch, scale)) < TOLERANCE


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"), SHAPES)
def test_prefill_and_mixed_match_reference(num_heads, num_kv_heads, head_dim, block_size):
    generator = torch.Generator().manual_seed(num_heads * 10 + head_dim)
    # a whole prompt, a chunk continuing a prompt, a decode token, a prompt spanning query tiles
    query_lens = [20, 9, 1, 70]
    context_lens = [20, 41, 33, 70]
    batch = random_batch(generator, query_lens=query_lens, context_lens=context_lens,
                         num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         block_size=block_size)
    scale = head_dim**-0.5
    expected = naive_paged_attention(*batch, scale)
    # several query blocks per sequence, and a block per group (the KV tile as wide); then
    # the tile the code picks (for heads of 256 narrower than it is tall)
    for varlen in (triton_attention.VarlenConfig(block_m=16, block_n=16),
                   triton_attention.VarlenConfig(block_m=64, block_n=64), None):
        out = triton_attention.paged_attention(*batch, scale, varlen=varlen)
        assert relative_error(out, expected) < TOLERANCE


def test_varlen_grid_depends_on_counts_only():
    """Query lengths change which program owns which tokens, never how many programs
    there are: the same launch serves any step of that many tokens and sequences."""
    for group_size in (1, 2, 3, 4, 8, 32):
        block_m, block_q = triton_attention.varlen_tiling(group_size, 64)
        assert block_m & (block_m - 1) == 0 and block_q * group_size <= block_m
    # every split of 40 tokens over 3 sequences fits num_tokens // block_q + num_seqs blocks
    block_q = 8
    for first in range(41):
        for second in range(41 - first):
            lens = [first, second, 40 - first - second]
            starts = [0, first, first + second]
            last_block = [start // block_q + seq + -(-length // block_q)
                          for seq, (start, length) in enumerate(zip(starts, lens, strict=True))]
            assert max(last_block) <= 40 // block_q + 3
            firsts = [start // block_q + seq for seq, start in enumerate(starts)]
            assert all(end <= following for end, following in zip(last_block[:-1], firsts[1:],
                                                                  strict=True))


@pytest.mark.parametrize("num_padded", [32, 160])
def test_varlen_padding_sequence_owns_padding_tokens_and_gives_zeros(num_padded):
    """A CUDA graph's layout: real sequences, empty padding sequences, and a last padding
    sequence (context 0) that owns the padding tokens, over several query blocks (it
    must read nothing: its positions are negative); real rows match the unpadded step."""
    generator = torch.Generator().manual_seed(5)
    query_lens, context_lens = [7, 1, 12, 1], [19, 40, 12, 3]
    batch = random_batch(generator, query_lens=query_lens, context_lens=context_lens,
                         num_heads=4, num_kv_heads=2, head_dim=32, block_size=8)
    query, k_cache, v_cache, block_tables, lens, starts = batch
    expected = triton_attention.paged_attention(*batch, 0.2)
    num_real, num_seqs = sum(query_lens), 7
    padded_query = torch.randn(num_padded, 4, 32, generator=generator).to(DTYPE).to(DEVICE)
    padded_query[:num_real] = query
    padded_tables = torch.zeros((num_seqs, block_tables.shape[1]), dtype=torch.int32,
                                device=DEVICE)
    padded_tables[:4] = block_tables
    padded_lens = torch.zeros(num_seqs, dtype=torch.int32, device=DEVICE)
    padded_lens[:4] = lens
    padded_starts = torch.full((num_seqs + 1,), num_real, dtype=torch.int32, device=DEVICE)
    padded_starts[:5] = starts
    padded_starts[-1] = num_padded
    # poison: a read below position 0 would go through row 0 of the block table
    padded_tables[4:] = block_tables[0]
    out = triton_attention.paged_attention(padded_query, k_cache, v_cache, padded_tables,
                                           padded_lens, padded_starts, 0.2, varlen=VARLEN_16)
    expected = triton_attention.paged_attention(*batch, 0.2, varlen=VARLEN_16)
    assert torch.equal(out[:num_real], expected)  # bit for bit: the same programs' work
    assert out[num_real:].abs().max().item() == 0.0


def test_split_kv_equals_unsplit_on_a_long_context():
    """One sequence of a long context and one short: every split count gives the unsplit
    result within float32 rounding of the merge."""
    generator = torch.Generator().manual_seed(9)
    batch = random_batch(generator, query_lens=[1, 1], context_lens=[700, 40], num_heads=8,
                         num_kv_heads=2, head_dim=32, block_size=16)
    unsplit = triton_attention.paged_attention(*batch, 0.15, num_splits=1).double()
    assert relative_error(unsplit, naive_paged_attention(*batch, 0.15)) < TOLERANCE
    for num_splits in (3, 64):
        out = triton_attention.paged_attention(*batch, 0.15, num_splits=num_splits)
        assert relative_error(out, unsplit) < (1e-2 if HAS_CUDA else 1e-5)


def test_the_decode_tile_depends_on_the_split_count_and_the_cache():
    """One or two sequences (MAX_DECODE_SPLITS splits) over a bf16 cache take the small
    split tile; more sequences over an e4m3 cache take its own tile; wide heads keep
    theirs. (The split tile's arithmetic: test_split_kv_equals_unsplit_on_a_long_context,
    at 64 splits; the e4m3 tile's: tests/test_triton_kv_fp8.py, whose batches take it.)"""
    config = triton_attention.decode_config
    most = triton_attention.MAX_DECODE_SPLITS
    assert config(128, most, torch.bfloat16) == triton_attention.DECODE_SPLIT_CONFIG
    assert config(128, most - 1, torch.bfloat16) == triton_attention.DECODE_CONFIG
    assert config(128, most, E4M3) == triton_attention.DECODE_CONFIG
    assert config(128, most - 1, E4M3) == triton_attention.DECODE_E4M3_CONFIG
    assert config(128, 1, E4M3) == triton_attention.DECODE_E4M3_CONFIG
    assert config(256, most, torch.bfloat16) == triton_attention.DECODE_WIDE_HEAD_CONFIG


def test_padded_decode_sequence_gives_zeros_and_leaves_others_alone():
    generator = torch.Generator().manual_seed(7)
    batch = random_batch(generator, query_lens=[1, 1], context_lens=[5, 1], num_heads=4,
                         num_kv_heads=2, head_dim=32, block_size=16)
    query, k_cache, v_cache, block_tables, context_lens, query_start_loc = batch
    expected = naive_paged_attention(*batch, 0.1)
    context_lens[1] = 0  # a CUDA-graph padding row
    for num_splits in (1, 2):
        out = triton_attention.paged_attention(query, k_cache, v_cache, block_tables,
                                               context_lens, query_start_loc, 0.1,
                                               num_splits=num_splits)
        assert relative_error(out[:1], expected[:1]) < TOLERANCE
        assert out[1].abs().max().item() == 0.0


def test_write_kv_cache_stores_at_slots_and_skips_negative_slots():
    generator = torch.Generator().manual_seed(3)
    num_blocks, block_size, num_kv_heads, head_dim = 4, 8, 3, 16
    key = torch.randn(5, num_kv_heads, head_dim, generator=generator).to(DTYPE).to(DEVICE)
    value = torch.randn(5, num_kv_heads, head_dim, generator=generator).to(DTYPE).to(DEVICE)
    slot_mapping = torch.tensor([9, 0, 31, -1, 17], dtype=torch.int64, device=DEVICE)
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=DTYPE,
                          device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    triton_attention.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    written = [0, 1, 2, 4]
    assert torch.equal(k_cache.flatten(0, 1)[slot_mapping[written]], key[written])
    assert torch.equal(v_cache.flatten(0, 1)[slot_mapping[written]], value[written])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slot_mapping[written].cpu()] = False
    assert k_cache.flatten(0, 1)[untouched.to(DEVICE)].abs().max().item() == 0.0


def test_write_kv_cache_reads_strided_views():
    """Keys and values usually arrive as views into one fused qkv projection."""
    generator = torch.Generator().manual_seed(4)
    num_kv_heads, head_dim = 2, 16
    qkv = torch.randn(3, (4 + 2 * num_kv_heads) * head_dim, generator=generator)
    qkv = qkv.to(DTYPE).to(DEVICE)
    key = qkv[:, 4 * head_dim:6 * head_dim].view(3, num_kv_heads, head_dim)
    value = qkv[:, 6 * head_dim:].view(3, num_kv_heads, head_dim)
    k_cache = torch.zeros(2, 4, num_kv_heads, head_dim, dtype=DTYPE, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slot_mapping = torch.tensor([5, 2, 7], device=DEVICE)
    triton_attention.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache.flatten(0, 1)[slot_mapping], key)
    assert torch.equal(v_cache.flatten(0, 1)[slot_mapping], value)


def test_matches_the_torch_reference_module():
    generator = torch.Generator().manual_seed(11)
    batch = random_batch(generator, query_lens=[12, 1, 5], context_lens=[12, 30, 21],
                         num_heads=4, num_kv_heads=2, head_dim=32, block_size=16)
    query, k_cache, v_cache, *_ = batch
    scale = 32**-0.5
    expected = reference_attention(query.float(), k_cache.float(), v_cache.float(), *batch[3:],
                                   scale)
    out = triton_attention.paged_attention(*batch, scale)
    assert relative_error(out, expected.double()) < TOLERANCE


def test_a_graph_and_the_eager_step_it_pads_take_the_same_varlen_tile():
    """The varlen tile depends on the step's token count; a graph replays a padded count,
    so every count must take the tile of the graph that would serve it (else a graph
    step and the eager step it stands for would differ in their low bits)."""
    from trio_llm.gpu.cuda_graphs import VARLEN_GRAPH_TOKENS

    assert triton_attention.VARLEN_SMALL_MAX_TOKENS in VARLEN_GRAPH_TOKENS
    tiles = {triton_attention.varlen_config(size) for size in VARLEN_GRAPH_TOKENS}
    assert len(tiles) == 2  # both tiles serve some graph
    for num_tokens in range(1, VARLEN_GRAPH_TOKENS[-1] + 1):
        graph_tokens = next(size for size in VARLEN_GRAPH_TOKENS if size >= num_tokens)
        assert (triton_attention.varlen_config(num_tokens)
                == triton_attention.varlen_config(graph_tokens))
    # heads wider than 128 take one tile at every count
    assert {triton_attention.varlen_config(size, head_dim=256)
            for size in VARLEN_GRAPH_TOKENS} == {triton_attention.VARLEN_WIDE_HEAD_CONFIG}
