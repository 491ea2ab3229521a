"""The hybrid family (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) computes what transformers
computes, on the CPU.

Random tiny checkpoints are written by transformers' own classes
(``save_pretrained``), the ConditionalGeneration ones with a tiny vision tower:
greedy generation through ModelExecutor (prompts arriving at different steps,
prefilled in odd chunks) equals transformers' ``generate`` token for token in
float32, logits within LOGITS_TOLERANCE. A request's logits are the same bits alone or
batched, preempted or not, and whatever chunks its prompt was cut into (the
linear attention's state carries from chunk to chunk and step to step); two
ranks over gloo generate what one does.
"""

import pytest
import torch
from test_model_support import (
    HYBRID_ARCHITECTURES,
    HYBRID_TEXT,
    NUM_NEW_TOKENS,
    assert_generates_as_transformers,
    assert_same_bits_alone_or_batched,
    random_hybrid_model,
    random_prompts,
    run_executor,
    saved,
)

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.messages import NewRequestData, ScheduledBatch, ScheduledRequest
from trio_llm.gpu.errors import ModelLoadError
from trio_llm.gpu.executor import ModelExecutor
from trio_llm.gpu.layers.linear_attention import GatedDeltaNet, StateCache
from trio_llm.gpu.loader import load_model
from trio_llm.gpu.models import read_model_config
from trio_llm.gpu.models.cpu_fused import CpuFusedCausalLM
from trio_llm.gpu.tensor_parallel import TensorParallel
from trio_llm.gpu.testing import GREEDY, DriverRequest, ExecutorDriver, record_logits
from trio_llm.gpu.tp_executor import TensorParallelExecutor

transformers = pytest.importorskip("transformers")

# transformers prefills the delta rule in its chunked form (sums over 64-token chunks),
# trio-llm computes the recurrent form token by token: the same function, summed in
# another order (a few 1e-4 after five layers; the dense families' 1e-4 otherwise)
LOGITS_TOLERANCE = 5e-4


@pytest.fixture(scope="module", params=HYBRID_ARCHITECTURES)
def checkpoint(request, tmp_path_factory):
    """(directory, transformers model) for a random checkpoint of one architecture."""
    return saved(random_hybrid_model(request.param), tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def prompts():
    return random_prompts()


def test_the_config_names_the_layers_and_the_vision_tower(checkpoint):
    directory, model = checkpoint
    config = read_model_config(directory)
    assert config.architecture == type(model).__name__
    assert [config.is_linear_attention_layer(index) for index in range(5)] == [
        True, True, True, False, True]
    assert config.rotary_dim == 8  # a quarter of each head of 32
    is_multimodal = config.architecture.endswith("ForConditionalGeneration")
    assert config.has_vision_tower == is_multimodal
    assert config.weight_prefix == ("model.language_model." if is_multimodal else "model.")


@pytest.mark.parametrize("block_size", [1, 16])
def test_greedy_generation_matches_transformers(checkpoint, prompts, block_size):
    directory, model = checkpoint
    requests, recorded = run_executor(directory, prompts, block_size=block_size)
    assert_generates_as_transformers(model, prompts, requests, recorded, atol=LOGITS_TOLERANCE)


def _executor(directory, **overrides) -> ModelExecutor:
    fields = dict(model=str(directory), block_size=16, num_kv_blocks=256, device="cpu",
                  dtype="float32", max_num_seqs=8, enable_prefix_caching=False)
    return ModelExecutor.create(EngineConfig(**{**fields, **overrides}))


def _recorded_logits(directory, requests) -> dict:
    executor = _executor(directory)
    recorded = record_logits(executor)
    ExecutorDriver(executor).run(requests)
    return recorded


def test_the_executor_runs_the_family_unfused_with_a_slot_per_running_sequence(checkpoint):
    directory, _ = checkpoint
    executor = _executor(directory)
    assert not isinstance(executor.model, CpuFusedCausalLM)  # no compiled hybrid kernels
    assert executor.num_state_slots == 8  # max_num_seqs; prefix caching off: no snapshots
    states = [cache for cache in executor.kv_caches if isinstance(cache, StateCache)]
    assert len(states) == 4 and len(executor.kv_caches) == 5
    assert states[0].conv.shape == (8, 2 * 2 * 16 + 4 * 16, 3)
    assert states[0].recurrent.shape == (8, 4, 16, 16)
    assert states[0].recurrent.dtype == torch.float32
    # only the full-attention layer holds keys and values
    assert executor.model.kv_cache_bytes_per_token == 2 * 1 * 2 * 32 * 4


def test_snapshot_slots_come_from_max_state_snapshots_or_a_quarter_of_the_memory(checkpoint):
    directory, _ = checkpoint
    executor = _executor(directory, enable_prefix_caching=True, num_kv_blocks=None,
                         cpu_kv_cache_gib=0.001)
    slot_bytes = executor.model.state_bytes_per_slot
    assert executor.num_state_slots == 8 + int(0.25 * 0.001 * 2**30 // slot_bytes)
    state_bytes = executor.num_state_slots * slot_bytes
    bytes_per_block = 16 * executor.model.kv_cache_bytes_per_token
    assert executor.num_kv_blocks == int((0.001 * 2**30 - state_bytes) // bytes_per_block)


def test_running_states_beyond_memory_are_refused_with_the_max_num_seqs_that_fits(checkpoint):
    """A hybrid model at a max_num_seqs whose running states alone outgrow the cache
    memory (qwen3.5-27b at the default 256 on an H100) is refused with the number to
    pass, not a negative budget."""
    directory, _ = checkpoint
    slot_bytes = _executor(directory).model.state_bytes_per_slot
    cache_gib = 100 * slot_bytes / 2**30  # room for 100 states
    with pytest.raises(ModelLoadError, match=r"256 running sequences \(--max-num-seqs\).*"
                                             r"pass --max-num-seqs 50 or fewer"):
        _executor(directory, max_num_seqs=256, num_kv_blocks=None, cpu_kv_cache_gib=cache_gib)


def test_a_requests_logits_are_the_same_bits_alone_batched_or_preempted(checkpoint, prompts):
    """Each request alone, in one chunk; then all of them in one run, arriving at
    different steps, prefilled in odd chunks, one preempted and recomputed (into
    another slot): every logit the same bits."""
    directory, _ = checkpoint
    assert_same_bits_alone_or_batched(lambda requests: _recorded_logits(directory, requests),
                                      prompts)


@pytest.mark.parametrize("chunk_size", [1, 2, 5, 16])
def test_chunked_prefill_gives_the_unchunked_bits(checkpoint, prompts, chunk_size):
    """A 41-token prompt prefilled in chunks of 1, 2, 5 and 16 tokens: the state
    carried from chunk to chunk, every logit the same bits as in one chunk."""
    directory, _ = checkpoint
    prompt = prompts[2]

    def run(chunk_sizes: list[int]) -> dict:
        return _recorded_logits(directory, [DriverRequest(
            request_id="r", prompt_token_ids=prompt, max_tokens=NUM_NEW_TOKENS,
            chunk_sizes=chunk_sizes)])

    whole, chunked = run([1 << 30]), run([chunk_size])
    assert whole.keys() == chunked.keys()
    for key, logits in whole.items():
        assert torch.equal(chunked[key], logits), key


def test_two_ranks_over_gloo_generate_what_one_does(checkpoint, prompts):
    """Tensor parallelism 2 on the CPU (worker processes, gloo): the linear attention's
    key and value heads (and their conv channels) split over the ranks, the same greedy
    tokens as one rank."""
    directory, _ = checkpoint
    requests = [DriverRequest(request_id=f"r{index}", prompt_token_ids=prompt,
                              max_tokens=NUM_NEW_TOKENS)
                for index, prompt in enumerate(prompts)]
    one_rank = _executor(directory)
    expected = [request.output_token_ids for request in ExecutorDriver(one_rank).run(requests)]
    requests = [DriverRequest(request_id=request.request_id,
                              prompt_token_ids=request.prompt_token_ids,
                              max_tokens=NUM_NEW_TOKENS) for request in requests]
    two_ranks = TensorParallelExecutor.create(EngineConfig(
        model=str(directory), num_kv_blocks=128, device="cpu", dtype="float32",
        tensor_parallel_size=2, max_num_seqs=8, enable_prefix_caching=False))
    try:
        assert two_ranks.num_state_slots == 8
        ExecutorDriver(two_ranks).run(requests)  # type: ignore[arg-type]
    finally:
        two_ranks.close()
    assert [request.output_token_ids for request in requests] == expected


def test_the_heads_of_two_ranks_tile_the_linear_attention(checkpoint):
    """Each rank holds its key heads' q and k rows, its value heads' v, z, b and a rows
    (in_proj), the same channels of the conv, its value heads' decay parameters, and
    its value heads' columns of out_proj."""
    directory, _ = checkpoint

    def layer(rank: int, world_size: int) -> GatedDeltaNet:
        model = load_model(directory, dtype=torch.float32, device=torch.device("cpu"),
                           parallel=TensorParallel(rank=rank, world_size=world_size))
        linear = model.decoder_layers[0].linear_attn
        assert linear is not None
        return linear

    whole, ranks = layer(0, 1), [layer(rank, 2) for rank in range(2)]
    key, value, heads = 2 * 16, 4 * 16, 4  # whole sizes: q/k rows, v/z rows, value heads
    sections = [key, key, value, value, heads, heads]

    def split(weight: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        return list(weight.split(sizes))

    for name, sizes in (("in_proj.weight", sections), ("conv_weight", sections[:3]),
                        ("A_log", [heads]), ("dt_bias", [heads])):
        parts = split(whole.get_parameter(name), sizes)
        shards = [split(rank.get_parameter(name), [size // 2 for size in sizes])
                  for rank in ranks]
        for part, (first, second) in zip(parts, zip(*shards, strict=True), strict=True):
            assert torch.equal(torch.cat([first, second]), part), name
    assert torch.equal(torch.cat([rank.out_proj.weight for rank in ranks], dim=1),
                       whole.out_proj.weight)


def _step(step_id: int, requests: list[ScheduledRequest], *, new=(), finished=(),
          copies=()) -> ScheduledBatch:
    return ScheduledBatch(step_id=step_id, new_requests=list(new), requests=requests,
                          finished_request_ids=list(finished),
                          num_tokens=sum(len(item.token_ids) for item in requests),
                          state_copies=list(copies))


def _scheduled(request_id: str, token_ids: list[int], start: int, block_ids: list[int],
               ) -> ScheduledRequest:
    return ScheduledRequest(request_id=request_id, token_ids=token_ids,
                            input_from_previous_step=False, num_computed_tokens=start,
                            new_block_ids=block_ids, sample=True, output_index=0)


def test_a_state_restored_by_state_copies_continues_the_prefix(checkpoint, prompts):
    """A snapshot of a request's state after its prompt's first 16 tokens, copied into
    another request's slot, with the first request's KV blocks: the second request's
    next chunk gives the same logits as the first one's, bit for bit. Without the copy,
    the executor refuses the step rather than continue from a state of another prefix."""
    directory, _ = checkpoint
    prompt = prompts[2]
    executor = _executor(directory)
    recorded = record_logits(executor)
    first = NewRequestData(request_id="a", sampling=GREEDY, state_slot=0)
    executor.execute(_step(0, [_scheduled("a", prompt[:16], 0, [0])], new=[first]))
    # save a's state after 16 tokens into slot 5, then a goes on
    executor.execute(_step(1, [_scheduled("a", prompt[16:], 16, [1, 2])], copies=[(0, 5)]))
    second = NewRequestData(request_id="b", sampling=GREEDY, state_slot=3)
    with pytest.raises(ValueError, match="no state was restored into its state slot 3"):
        executor.execute(_step(2, [_scheduled("b", prompt[16:], 16, [0, 3, 4])],
                               new=[second]))
    executor.execute(_step(3, [_scheduled("b", prompt[16:], 16, [0, 3, 4])], new=[second],
                           copies=[(5, 3)], finished=["b"]))
    assert torch.equal(recorded[("b", 0)], recorded[("a", 0)])


def test_a_finished_requests_slot_serves_a_new_request_from_zeros(checkpoint, prompts):
    """A request given the slot another request just left starts from a zero state: its
    logits are those it has in a fresh executor."""
    directory, _ = checkpoint
    executor = _executor(directory)
    recorded = record_logits(executor)
    executor.execute(_step(0, [_scheduled("a", prompts[1], 0, [0, 1])], new=[
        NewRequestData(request_id="a", sampling=GREEDY, state_slot=2)]))
    executor.execute(_step(1, [_scheduled("b", prompts[2], 0, [2, 3, 4])], finished=["a"],
                           new=[NewRequestData(request_id="b", sampling=GREEDY,
                                               state_slot=2)]))
    fresh = _recorded_logits(directory, [DriverRequest(
        request_id="b", prompt_token_ids=prompts[2], max_tokens=1)])
    assert torch.equal(recorded[("b", 0)], fresh[("b", 0)])


def test_a_request_without_a_slot_is_refused_by_name(checkpoint, prompts):
    directory, _ = checkpoint
    executor = _executor(directory)
    with pytest.raises(ValueError, match="request 'a' has state slot None"):
        executor.execute(_step(0, [_scheduled("a", prompts[0], 0, [0])], new=[
            NewRequestData(request_id="a", sampling=GREEDY)]))


def _config_data(**changes) -> dict:
    """A Qwen3.5 text config.json's contents, with ``changes``."""
    data = transformers.Qwen3_5TextConfig(**HYBRID_TEXT, intermediate_size=96).to_dict()
    data["architectures"] = ["Qwen3_5ForCausalLM"]
    return data | changes


@pytest.mark.parametrize(("changes", "problem"), [
    ({"layer_types": ["linear_attention"] * 4 + ["sliding_attention"]},
     r"unsupported layer_types \['sliding_attention'\]"),
    ({"layer_types": ["linear_attention", "full_attention"]},
     "layer_types names 2 layers, num_hidden_layers is 5"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads \\(3\\) must be a multiple"),
    ({"hidden_act": "gelu"}, "unsupported hidden_act"),
])
def test_a_config_the_family_cannot_serve_is_refused_by_name(changes, problem):
    from trio_llm.gpu.models import ModelLoadError, parse_model_config

    with pytest.raises(ModelLoadError, match=problem):
        parse_model_config(_config_data(**changes))


def test_a_config_without_layer_types_puts_full_attention_every_fourth_layer():
    from trio_llm.gpu.models import parse_model_config

    data = _config_data(num_hidden_layers=8)
    del data["layer_types"]
    config = parse_model_config(data)
    assert [config.is_linear_attention_layer(index) for index in range(8)] == [
        True, True, True, False] * 2


def test_a_tensor_parallel_size_that_splits_no_linear_heads_is_refused_by_name():
    from trio_llm.gpu.models import ModelLoadError, parse_model_config
    from trio_llm.gpu.tensor_parallel import check_divisible

    config = parse_model_config(_config_data(linear_num_key_heads=3,
                                             linear_num_value_heads=6))
    with pytest.raises(ModelLoadError, match="linear-attention key heads"):
        check_divisible(config, 2)


@pytest.mark.gpu
def test_cuda_greedy_generation_matches_the_cpu(checkpoint, prompts):
    """On CUDA, float32, the family's torch forward (the plain executor: Triton attention,
    the linear attention's recurrent form in torch): the CPU executor's greedy tokens,
    which the tests above hold to transformers'. (transformers itself is no reference
    here: with fla-core installed it sends CPU tensors to fla's CUDA kernels.)"""
    directory, _ = checkpoint
    on_cuda, _ = run_executor(directory, prompts, block_size=16, device="cuda")
    on_cpu, _ = run_executor(directory, prompts, block_size=16)
    assert [request.output_token_ids for request in on_cuda] == [
        request.output_token_ids for request in on_cpu]

