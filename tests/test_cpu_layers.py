"""The fused CPU kernels (gpu/kernels/cpu_layers.py) against the torch model's own operations.

Each kernel is close to the torch operation it replaces (the order of a row's sums
differs, nothing else), never depends on the other rows, and the fused model gives
the plain model's logits and greedy tokens. The compiled forward (a whole part of a
step in one call, its GEMMs through torch's sgemm_: gpu/kernels/cpu_blas.py) gives the fused
operations' bits.
"""


import numpy as np
import pytest
import torch

from trio_llm.actors.config import EngineConfig
from trio_llm.gpu.attention import write_kv_cache
from trio_llm.gpu.executor import ModelExecutor
from trio_llm.gpu.kernels import cpu_attention, cpu_blas, cpu_layers
from trio_llm.gpu.layers.linear import chunked_linear
from trio_llm.gpu.layers.mlp import silu_and_mul
from trio_llm.gpu.layers.norm import RMSNorm
from trio_llm.gpu.layers.rotary import RotaryEmbedding
from trio_llm.gpu.models import cpu_fused
from trio_llm.gpu.models.base import AttentionMetadata, CausalLM
from trio_llm.gpu.models.config import RopeConfig
from trio_llm.gpu.testing import GREEDY, DriverRequest, ExecutorDriver, record_logits


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _norm(size: int, seed: int) -> RMSNorm:
    norm = RMSNorm(size, eps=1e-6, dtype=torch.float32, device=torch.device("cpu"))
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(size, generator=_generator(seed)))
    return norm


def test_rms_norm_matches_the_torch_module():
    norm = _norm(256, seed=1)
    x = 3 * torch.randn(70, 256, generator=_generator(2))
    with torch.no_grad():
        expected = norm(x)
    output = cpu_layers.rms_norm(x, norm.weight, norm.eps)
    torch.testing.assert_close(output, expected, rtol=2e-6, atol=2e-6)
    # a row alone is the same bits as in the batch
    assert torch.equal(cpu_layers.rms_norm(x[5:6].clone(), norm.weight, norm.eps), output[5:6])


def test_add_rms_norm_returns_the_sum_and_its_norm():
    norm = _norm(64, seed=3)
    x, residual = torch.randn(9, 64, generator=_generator(4)), torch.randn(9, 64)
    normed, total = cpu_layers.add_rms_norm(x, residual, norm.weight, norm.eps)
    assert torch.equal(total, residual + x)
    with torch.no_grad():
        torch.testing.assert_close(normed, norm(residual + x), rtol=2e-6, atol=2e-6)


def test_silu_and_mul_matches_torch():
    gate_up = 6 * torch.randn(33, 2 * 512, generator=_generator(5))
    gate_up[0, :4] = torch.tensor([0.0, -0.0, 90.0, -90.0])
    output = cpu_layers.silu_and_mul(gate_up)
    torch.testing.assert_close(output, silu_and_mul(gate_up), rtol=3e-6, atol=1e-6)
    assert torch.equal(cpu_layers.silu_and_mul(gate_up[7:8].clone()), output[7:8])


@pytest.mark.parametrize("has_qk_norm", [True, False])
def test_qk_norm_rope_write_kv_matches_the_torch_layers(has_qk_norm):
    num_heads, num_kv_heads, head_dim, num_tokens = 8, 4, 32, 20
    rotary = RotaryEmbedding(head_dim, 512, RopeConfig(theta=10000.0), device=torch.device("cpu"))
    q_norm, k_norm = _norm(head_dim, seed=6), _norm(head_dim, seed=7)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim,
                      generator=_generator(8))
    positions = torch.randint(0, 512, (num_tokens,), generator=_generator(9))
    slots = torch.randperm(64, generator=_generator(10))[:num_tokens]
    slots[3] = -1  # padding: not written
    shape = (4, 16, num_kv_heads, head_dim)
    k_cache, v_cache = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    query = cpu_layers.qk_norm_rope_write_kv(
        qkv, positions, rotary.cos, rotary.sin, q_norm.weight if has_qk_norm else None,
        k_norm.weight if has_qk_norm else None, 1e-6, k_cache, v_cache, slots,
        num_heads=num_heads, num_kv_heads=num_kv_heads)

    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                         num_kv_heads * head_dim], dim=-1)
    q = q.reshape(num_tokens, num_heads, head_dim)
    k = k.reshape(num_tokens, num_kv_heads, head_dim)
    with torch.no_grad():
        if has_qk_norm:
            q, k = q_norm(q), k_norm(k)
        q, k = rotary(positions, q, k)
    expected_k, expected_v = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    write_kv_cache(k, v.reshape(num_tokens, num_kv_heads, head_dim), expected_k, expected_v,
                   slots)
    torch.testing.assert_close(query, q, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(k_cache, expected_k, rtol=2e-6, atol=2e-6, equal_nan=True)
    assert torch.equal(v_cache.isnan(), expected_v.isnan())
    assert torch.equal(v_cache.nan_to_num(), expected_v.nan_to_num())


def _executor(fused: bool, num_kv_blocks: int = 64) -> ModelExecutor:
    executor = ModelExecutor.create(EngineConfig(model="tiny", device="cpu", dtype="float32",
                                                 num_kv_blocks=num_kv_blocks))
    if not fused:
        executor.model.__class__ = CausalLM
    return executor


def test_the_cpu_executor_runs_the_fused_model():
    assert isinstance(_executor(fused=True).model, cpu_fused.CpuFusedCausalLM)


def test_the_fused_model_gives_the_plain_models_logits_and_tokens():
    prompts = [[(7 * index + 3) % 2000 + 3 for index in range(length)] for length in (5, 40, 77)]
    runs = {}
    for fused in (True, False):
        executor = _executor(fused)
        recorded = record_logits(executor)
        requests = [DriverRequest(request_id=f"r{index}", prompt_token_ids=prompt,
                                  max_tokens=6, sampling=GREEDY)
                    for index, prompt in enumerate(prompts)]
        outputs = ExecutorDriver(executor).run(requests)
        runs[fused] = ([request.output_token_ids for request in outputs], recorded)
    assert runs[True][0] == runs[False][0]
    assert runs[True][1].keys() == runs[False][1].keys()
    for key, row in runs[False][1].items():
        torch.testing.assert_close(runs[True][1][key], row, rtol=1e-4, atol=1e-4)


def test_other_dtypes_are_left_unfused():
    executor = ModelExecutor.create(EngineConfig(model="tiny", device="cpu", dtype="bfloat16",
                                                 num_kv_blocks=8))
    assert type(executor.model) is CausalLM


def test_split_step_balances_whole_sequences():
    decode = cpu_fused.split_step(np.full(512, 300), np.arange(513), 2)
    assert [(part.first_seq, part.end_seq, part.first_token, part.end_token)
            for part in decode] == [(0, 256, 0, 256), (256, 512, 256, 512)]
    # too few tokens for a second part: the threads would spend more than they save
    assert len(cpu_fused.split_step(np.full(64, 300), np.arange(65), 2)) == 1
    equal = cpu_fused.split_step(np.full(6, 300), np.arange(0, 1900, 300), 3)
    assert [(part.first_seq, part.end_seq) for part in equal] == [(0, 2), (2, 4), (4, 6)]
    # cuts fall at the edges of sequences: an uneven step may get fewer parts
    uneven = cpu_fused.split_step(np.array([400, 400, 80, 800]),
                                   np.array([0, 400, 800, 880, 1680]), 3)
    assert [(part.first_seq, part.end_seq, part.first_token, part.end_token)
            for part in uneven] == [(0, 2, 0, 800), (2, 4, 800, 1680)]


@pytest.mark.parametrize(("num_parts", "min_tokens_per_part"), [(2, 256), (3, 1)])
def test_a_step_in_parts_gives_the_same_bits(monkeypatch, num_parts, min_tokens_per_part):
    """Prefills and decodes of six requests, steps cut into parts on their own threads
    (with one token per part allowed, the decodes too): every logit the same bits as in
    one part."""
    monkeypatch.setattr(cpu_fused, "MIN_TOKENS_PER_PART", min_tokens_per_part)
    monkeypatch.setattr(cpu_fused, "MIN_TOKENS_PER_COMPILED_PART", min_tokens_per_part)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 2000, length).tolist() for length in (300, 1, 33, 400, 9, 264)]
    recorded = {}
    for parts in (1, num_parts):
        executor = _executor(fused=True, num_kv_blocks=128)
        executor.model.num_parts = parts
        logits = record_logits(executor)
        requests = [DriverRequest(request_id=f"r{index}", prompt_token_ids=prompt,
                                  max_tokens=12, sampling=GREEDY)
                    for index, prompt in enumerate(prompts)]
        ExecutorDriver(executor).run(requests)
        recorded[parts] = logits
    assert recorded[1].keys() == recorded[num_parts].keys()
    for key, row in recorded[1].items():
        assert torch.equal(recorded[num_parts][key], row), key


@pytest.mark.parametrize(("num_in", "num_out"), [(64, 128), (256, 512), (512, 256)])
def test_sgemm_chunks_give_chunked_linears_bits(num_in, num_out):
    """The compiled forward's GEMMs: torch's own sgemm_, one chunk of rows at a time, as
    torch.bmm runs chunked_linear; any number of rows, the last chunk zero-padded."""
    address = cpu_blas.sgemm_address()
    assert address
    weight = torch.randn(num_out, num_in, generator=_generator(num_out))
    for num_rows in (1, 31, 32, 33, 100):
        x = torch.randn(num_rows, num_in, generator=_generator(num_rows))
        ours = cpu_blas.chunked_linear(x.numpy(), weight.numpy(), address)
        assert torch.equal(torch.from_numpy(ours), chunked_linear(x, weight, None, 32))


def _without_qk_norm(executor: ModelExecutor) -> None:
    for layer in executor.model.layers:
        layer.self_attn.q_norm = layer.self_attn.k_norm = None


def _with_biases(executor: ModelExecutor) -> None:
    """Qwen2's q/k/v biases and, beyond it, the others: the fused model built again."""
    generator = _generator(5)
    for layer in executor.model.layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                       layer.mlp.gate_up_proj, layer.mlp.down_proj):
            linear.bias = torch.nn.Parameter(
                0.1 * torch.randn(linear.weight.shape[0], generator=generator),
                requires_grad=False)
    cpu_fused.fuse_model(executor.model, num_parts=executor.model.num_parts)
    executor.kv_caches = executor.model.allocate_kv_caches(executor.num_kv_blocks,
                                                           executor.block_size)


@pytest.mark.parametrize("num_parts", [1, 3])
@pytest.mark.parametrize("variant", ["qwen3", "without qk norm", "with biases"])
def test_the_compiled_forward_gives_the_fused_operations_bits(monkeypatch, num_parts,
                                                              variant):
    """Prefills, chunked prefills and decodes of seven requests (a step of 1 to 700
    tokens, up to three parts of one token or more): every logit the same bits whether
    each part runs in one compiled call or in torch operations."""
    monkeypatch.setattr(cpu_fused, "MIN_TOKENS_PER_PART", 1)
    monkeypatch.setattr(cpu_fused, "MIN_TOKENS_PER_COMPILED_PART", 1)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 2000, length).tolist() for length in (300, 1, 33, 64, 9, 2, 31)]
    runs = {}
    for is_compiled in (True, False):
        executor = _executor(fused=True, num_kv_blocks=128)
        if variant == "without qk norm":
            _without_qk_norm(executor)
        if variant == "with biases":
            _with_biases(executor)
        assert executor.model.sgemm_address
        assert executor.model.stacked.holds(executor.kv_caches)
        if not is_compiled:
            executor.model.sgemm_address = 0
        executor.model.num_parts = num_parts
        logits = record_logits(executor)
        requests = [DriverRequest(request_id=f"r{index}", prompt_token_ids=prompt,
                                  max_tokens=10, sampling=GREEDY, chunk_sizes=[40, 7],
                                  arrival_step=index % 3)
                    for index, prompt in enumerate(prompts)]
        ExecutorDriver(executor).run(requests)
        runs[is_compiled] = ([request.output_token_ids for request in requests], logits)
    assert runs[True][0] == runs[False][0]
    assert runs[True][1].keys() == runs[False][1].keys()
    for key, row in runs[False][1].items():
        assert torch.equal(runs[True][1][key], row), key


@pytest.mark.parametrize("num_parts", [1, 2, 3])
def test_the_compiled_logits_give_the_lm_heads_bits(num_parts):
    model = _executor(fused=True).model
    model.num_parts = num_parts
    for num_rows in (1, 32, 33, 100):
        hidden = torch.randn(num_rows, model.config.hidden_size, generator=_generator(num_rows))
        with torch.inference_mode():
            assert torch.equal(model.compute_logits(hidden),
                               CausalLM.compute_logits(model, hidden))


def test_a_token_id_outside_the_vocabulary_is_refused():
    """The compiled forward trusts its indices: the wrapper checks the token ids."""
    executor = _executor(fused=True)
    metadata = AttentionMetadata(slot_mapping=torch.tensor([0]),
                                 block_tables=torch.zeros(1, 1, dtype=torch.int32),
                                 context_lens=torch.ones(1, dtype=torch.int32),
                                 query_start_loc=torch.tensor([0, 1], dtype=torch.int32))
    vocab_size = executor.model.config.vocab_size
    with torch.inference_mode(), pytest.raises(ValueError, match="token ids"):
        executor.model(torch.tensor([vocab_size]), torch.tensor([0]), executor.kv_caches,
                       metadata)


def test_split_step_cuts_decode_steps_at_chunk_edges():
    """A part pads its tokens to whole GEMM chunks of 32 rows: a decode step of 64
    sequences cut 30 + 34 costs three chunks, 32 + 32 two; a cut that saves none stays
    where the work is even."""
    def cuts(num_seqs: int, context_lens: np.ndarray, max_parts: int = 2) -> list[int]:
        parts = cpu_fused.split_step(context_lens, np.arange(num_seqs + 1), max_parts, 16)
        return [part.end_seq for part in parts]

    uneven = np.array([380] * 30 + [100] * 34)  # even work cuts near 28
    assert cuts(64, uneven) == [32, 64]
    assert cuts(40, np.full(40, 300)) == [20, 40]  # 20 + 20 is one chunk each already
    assert cuts(100, np.full(100, 300)) == [50, 100]  # 64 + 36 saves no chunk on 50 + 50
    assert cuts(31, np.full(31, 300)) == [31]  # one part below two parts of 16 tokens


def test_a_step_whose_parts_would_share_a_block_being_written_is_not_cut():
    """A repeated prompt hits the blocks its twin computes in the same step (prefix
    caching): the twins in two parts on their own threads would race on those blocks."""
    def reads_the_others_writes(twin_blocks: list[int]) -> bool:
        # the first prompt: 20 tokens into blocks 4 and 5 (of 16 slots); its twin has its
        # first 16 tokens cached and computes the last 4 into its second block
        tables = torch.tensor([[4, 5], twin_blocks], dtype=torch.int32)
        slots = torch.cat([torch.arange(64, 84), torch.arange(4) + 16 * twin_blocks[1]])
        plan = cpu_attention.plan_step(
            tables, torch.tensor([20, 20], dtype=torch.int32),
            torch.tensor([0, 20, 24], dtype=torch.int32), slots, num_tokens=24,
            num_blocks=8, block_size=16, max_runs=2)
        parts = [cpu_fused.StepPart(0, 1, 0, 20), cpu_fused.StepPart(1, 2, 20, 24)]
        return cpu_fused.reads_another_parts_writes(plan, parts, 8, 16)

    assert reads_the_others_writes([4, 6])  # block 4: a hit on what the first part writes
    assert not reads_the_others_writes([3, 6])  # block 3 was written in an earlier step


def test_the_compiled_forward_shares_the_layers_weights_and_takes_its_own_caches():
    """The stacked weights are the layers' own parameters (nothing stored twice); caches
    allocated elsewhere are not the fused model's one tensor, and run in torch ops."""
    executor = _executor(fused=True)
    model, stacked = executor.model, executor.model.stacked
    with torch.no_grad():
        model.layers[1].mlp.down_proj.weight[0, 0] = 123.0
    assert stacked.weights[3][1, 0, 0] == 123.0
    assert stacked.holds(executor.kv_caches)
    others = CausalLM.allocate_kv_caches(model, executor.num_kv_blocks, 16)
    assert not stacked.holds(others)
    metadata = AttentionMetadata(slot_mapping=torch.arange(3),
                                 block_tables=torch.zeros(1, 1, dtype=torch.int32),
                                 context_lens=torch.full((1,), 3, dtype=torch.int32),
                                 query_start_loc=torch.tensor([0, 3], dtype=torch.int32))
    token_ids, positions = torch.tensor([5, 6, 7]), torch.arange(3)
    with torch.inference_mode():
        compiled = model(token_ids, positions, executor.kv_caches, metadata)
        in_ops = model(token_ids, positions, others, metadata)
    assert torch.equal(compiled, in_ops)
