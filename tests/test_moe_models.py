"""The Mixture-of-Experts families compute what transformers computes, on the CPU.

Random tiny Qwen3-MoE, Qwen2-MoE (with its shared expert) and Mixtral
checkpoints are written by transformers' own classes (``save_pretrained``);
greedy generation through ModelExecutor, several prompts in one mixed batch
with prefills split at odd boundaries, must equal transformers' ``generate``
token for token (float32), with logits within 1e-4. A request's logits are the
same bits alone or batched, and preempted or not; ties between experts resolve
as transformers resolves them.
"""

import pytest
import torch
from test_model import CUDA_LOGITS_TOLERANCE
from test_model_support import (
    NUM_NEW_TOKENS,
    assert_generates_as_transformers,
    assert_same_bits_alone_or_batched,
    moe_config,
    random_causal_lm,
    random_prompts,
    reference,
    run_executor,
    saved,
)

from trio_llm.actors.config import EngineConfig
from trio_llm.gpu.executor import ModelExecutor
from trio_llm.gpu.layers.moe import MoeShape, SparseMoeBlock
from trio_llm.gpu.loader import load_model
from trio_llm.gpu.models import read_model_config
from trio_llm.gpu.models.cpu_fused import CpuFusedCausalLM
from trio_llm.gpu.tensor_parallel import TensorParallel
from trio_llm.gpu.testing import DriverRequest, ExecutorDriver, record_logits
from trio_llm.gpu.tp_executor import TensorParallelExecutor

transformers = pytest.importorskip("transformers")

FAMILIES = ("qwen3_moe", "qwen2_moe", "qwen2_moe_stacked", "mixtral")


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    """(directory, transformers model) for a random checkpoint of one MoE family."""
    model = random_causal_lm(moe_config(request.param), seed=len(request.param))
    return saved(model, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def prompts():
    return random_prompts()


def test_the_config_names_the_experts(checkpoint):
    directory, model = checkpoint
    config = read_model_config(directory)
    assert config.num_experts == (model.config.num_local_experts
                                  if hasattr(model.config, "num_local_experts")
                                  else model.config.num_experts)
    assert config.num_experts_per_tok == 2


@pytest.mark.parametrize("block_size", [1, 16])
def test_greedy_generation_matches_transformers(checkpoint, prompts, block_size):
    directory, model = checkpoint
    requests, recorded = run_executor(directory, prompts, block_size=block_size)
    executor_model = ModelExecutor.create(EngineConfig(
        model=str(directory), num_kv_blocks=8, device="cpu", dtype="float32")).model
    assert isinstance(executor_model, CpuFusedCausalLM)  # the engine's CPU path
    assert_generates_as_transformers(model, prompts, requests, recorded, atol=1e-4)


def _recorded_logits(directory, requests) -> dict:
    executor = ModelExecutor.create(EngineConfig(model=str(directory), block_size=16,
                                                 num_kv_blocks=256, device="cpu",
                                                 dtype="float32"))
    recorded = record_logits(executor)
    ExecutorDriver(executor).run(requests)
    return recorded


def test_a_requests_logits_are_the_same_bits_alone_batched_or_preempted(checkpoint, prompts):
    """Each request alone, in one chunk; then all of them in one run, arriving at
    different steps, prefilled in odd chunks, one preempted and recomputed: every
    logit the same bits (the experts see other tokens in every step of the batch)."""
    directory, _ = checkpoint
    assert_same_bits_alone_or_batched(lambda requests: _recorded_logits(directory, requests),
                                      prompts)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_ties_between_experts_resolve_as_in_transformers(family):
    """Equal router logits (duplicate router rows, then a router of zeros): the experts
    picked, and their weights, are transformers' own."""
    config = moe_config(family)
    reference = (transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter(config)
                 if family == "qwen3_moe" else
                 transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter(config))
    num_experts = reference.weight.shape[0]
    shape = MoeShape(hidden_size=64, num_experts=num_experts, top_k=2, intermediate_size=32,
                     normalize=family == "mixtral" or config.norm_topk_prob,
                     weights_in_float32=family == "mixtral")
    block = SparseMoeBlock(shape, dtype=torch.float32, device=torch.device("cpu"),
                           parallel=TensorParallel.single())
    hidden = torch.randn(37, 64, generator=torch.Generator().manual_seed(3))
    rows = torch.randn(num_experts // 2, 64, generator=torch.Generator().manual_seed(4))
    for weight in (torch.cat([rows, rows]), torch.zeros(num_experts, 64)):
        with torch.no_grad():
            reference.weight.copy_(weight)
            block.gate.weight.copy_(weight)
            _, expected_weights, expected_ids = reference(hidden)
            weights, expert_ids = block.route(hidden)
        assert torch.equal(expert_ids, expected_ids)
        assert torch.equal(weights, expected_weights)


def test_the_experts_of_two_ranks_tile_the_whole_layer(checkpoint):
    """Each rank holds every expert's slice of the intermediate size: gate and up rows,
    down columns; the router whole."""
    directory, _ = checkpoint

    def experts(rank: int, world_size: int) -> dict[str, torch.Tensor]:
        model = load_model(directory, dtype=torch.float32, device=torch.device("cpu"),
                           parallel=TensorParallel(rank=rank, world_size=world_size))
        return {name: tensor for name, tensor in model.named_parameters()
                if "experts_" in name or "mlp.gate." in name}

    whole, ranks = experts(0, 1), [experts(rank, 2) for rank in range(2)]
    assert whole
    for name, tensor in whole.items():
        shards = [rank[name] for rank in ranks]
        if name.endswith("experts_gate_up"):
            gate, up = (part.chunk(2, dim=1) for part in tensor.chunk(2, dim=1))
            for rank, shard in enumerate(shards):
                assert torch.equal(shard, torch.cat([gate[rank], up[rank]], dim=1))
        elif name.endswith("experts_down"):
            assert torch.equal(torch.cat(shards, dim=2), tensor)
        else:
            assert all(torch.equal(shard, tensor) for shard in shards), name


def test_two_ranks_over_gloo_generate_what_one_does(checkpoint, prompts):
    """Tensor parallelism 2 on the CPU (worker processes, gloo): the experts split along
    their intermediate size, the same greedy tokens as one rank."""
    directory, _ = checkpoint
    requests = [DriverRequest(request_id=f"r{index}", prompt_token_ids=prompt,
                              max_tokens=NUM_NEW_TOKENS)
                for index, prompt in enumerate(prompts)]
    one_rank = ModelExecutor.create(EngineConfig(model=str(directory), num_kv_blocks=128,
                                                 device="cpu", dtype="float32"))
    expected = [request.output_token_ids for request in ExecutorDriver(one_rank).run(requests)]
    requests = [DriverRequest(request_id=request.request_id,
                              prompt_token_ids=request.prompt_token_ids,
                              max_tokens=NUM_NEW_TOKENS) for request in requests]
    two_ranks = TensorParallelExecutor.create(EngineConfig(
        model=str(directory), num_kv_blocks=128, device="cpu", dtype="float32",
        tensor_parallel_size=2))
    try:
        ExecutorDriver(two_ranks).run(requests)  # type: ignore[arg-type]
    finally:
        two_ranks.close()
    assert [request.output_token_ids for request in requests] == expected


def test_the_fused_gpu_forward_matches_the_plain_one(checkpoint, monkeypatch):
    """The CUDA path's forward (gpu/models/cuda_fused.py: Triton's layers, attention,
    routing and fused MoE kernels; here in Triton's interpreter) against the torch
    forward, on a mixed batch: a 5-token prompt beside a decode token with 3 positions
    cached."""
    from trio_llm.gpu.kernels import fused_moe
    from trio_llm.gpu.models import cuda_fused
    from trio_llm.gpu.models.base import AttentionMetadata

    directory, _ = checkpoint
    calls, routings = [], []
    kernel, route = fused_moe.fused_moe, cuda_fused.route_topk
    monkeypatch.setattr(fused_moe, "fused_moe",
                        lambda *args, **kwargs: calls.append(1) or kernel(*args, **kwargs))
    monkeypatch.setattr(cuda_fused, "route_topk",
                        lambda *args, **kwargs: routings.append(1) or route(*args, **kwargs))

    def load():
        model = load_model(directory, dtype=torch.float32, device=torch.device("cpu"))
        model.set_batch_invariant(False)
        return model

    plain, fused = load(), cuda_fused.fuse_model(load())
    token_ids = torch.tensor([5, 17, 300, 2, 9, 44])
    positions = torch.tensor([0, 1, 2, 3, 4, 3])
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor([0, 1, 2, 3, 4, 11]),
        block_tables=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        context_lens=torch.tensor([5, 4], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 5, 6], dtype=torch.int32))
    caches = [plain.allocate_kv_caches(4, 4), fused.allocate_kv_caches(4, 4)]
    generator = torch.Generator().manual_seed(5)
    for plain_pair, fused_pair in zip(*caches, strict=True):
        for plain_cache, fused_cache in zip(plain_pair, fused_pair, strict=True):
            plain_cache.copy_(torch.randn(plain_cache.shape, generator=generator))
            fused_cache.copy_(plain_cache)
    with torch.no_grad():
        expected = plain(token_ids, positions, caches[0], metadata)
        out = fused(token_ids, positions, caches[1], metadata)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-4)
    num_moe_blocks = sum(isinstance(module, SparseMoeBlock) for module in fused.modules())
    assert len(calls) == len(routings) == num_moe_blocks  # the routing kernel, not torch's
    assert torch.equal(plain.compute_logits(expected).argmax(-1),
                       fused.compute_logits(out).argmax(-1))


@pytest.mark.gpu
def test_cuda_greedy_generation_matches_transformers(checkpoint, prompts):
    """On CUDA, float32: the plain forward's logits (Triton attention, whose float32
    dots run in TF32) within the dense test's TF32 tolerance of transformers'; the CUDA
    executor's (fused MoE kernel, CUDA graphs) greedy tokens
    equal to transformers'."""
    from trio_llm.gpu.rank_executor import create_rank_executor

    directory, model = checkpoint
    requests, recorded = run_executor(directory, prompts, block_size=16, device="cuda")
    config = EngineConfig(model=str(directory), block_size=16, num_kv_blocks=512,
                          device="cuda", dtype="float32", max_num_seqs=8)
    fused = [DriverRequest(request_id=f"r{index}", prompt_token_ids=prompt,
                           max_tokens=NUM_NEW_TOKENS) for index, prompt in enumerate(prompts)]
    ExecutorDriver(create_rank_executor(config)).run(fused)  # type: ignore[arg-type]
    for request, fused_request, prompt in zip(requests, fused, prompts, strict=True):
        expected_tokens, expected_logits = reference(model, prompt)
        assert request.output_token_ids == expected_tokens
        assert fused_request.output_token_ids == expected_tokens
        ours = torch.stack([recorded[(request.request_id, index)].cpu()
                            for index in range(NUM_NEW_TOKENS)])
        torch.testing.assert_close(ours, expected_logits, rtol=0,
                                   atol=CUDA_LOGITS_TOLERANCE["triton"])


@pytest.mark.gpu
def test_cuda_bfloat16_greedy_match_rate_against_the_cpu_float32_path(checkpoint, prompts):
    """The issue's GPU match rate, as the dense family reports it: greedy tokens of the
    CUDA executor in bfloat16 (fused MoE kernel, graphs) against the CPU's float32, on the
    same checkpoint. bf16 is not float32, and on these random tiny models a rounding
    flips a router's or the sampler's near tie early (H200, 2026-12-02: 0.375, 0.547,
    0.609): reported, with a floor far above a broken path's (1 in 384 by chance)."""
    from trio_llm.gpu.rank_executor import create_rank_executor

    directory, _ = checkpoint
    num_new_tokens = 48
    outputs = {}
    for device, dtype in (("cpu", "float32"), ("cuda", "bfloat16")):
        config = EngineConfig(model=str(directory), block_size=16, num_kv_blocks=512,
                              device=device, dtype=dtype, max_num_seqs=8)
        requests = [DriverRequest(request_id=f"r{index}", prompt_token_ids=prompt,
                                  max_tokens=num_new_tokens)
                    for index, prompt in enumerate(prompts)]
        ExecutorDriver(create_rank_executor(config)).run(requests)  # type: ignore[arg-type]
        outputs[device] = [request.output_token_ids for request in requests]
    pairs = [(ours, theirs) for cuda, cpu in zip(outputs["cuda"], outputs["cpu"], strict=True)
             for ours, theirs in zip(cuda, cpu, strict=True)]
    matches = sum(ours == theirs for ours, theirs in pairs)
    first_divergences = [_first_difference(cuda, cpu)
                         for cuda, cpu in zip(outputs["cuda"], outputs["cpu"], strict=True)]
    print(f"\n{directory.name}: greedy match rate cuda bf16 vs cpu float32: "
          f"{matches}/{len(pairs)} = {matches / len(pairs):.3f}; first divergence per "
          f"request: {first_divergences}")
    assert matches / len(pairs) > 0.2


def _first_difference(ours: list[int], theirs: list[int]) -> int | None:
    return next((index for index, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b),
                None)
