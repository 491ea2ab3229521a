"""The hybrid family (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) on the CUDA executor.

Fed prompts in odd chunks, arriving late, preempted, its decode rows reading the
token sampled on the device, the CUDA executor must give the CPU executor's greedy
tokens in float32. Without a GPU it runs on the CPU with its streams reduced to
no-ops, its graphs uncaptured on their padded static buffers and its Triton kernels
in Triton's interpreter (fla-core's chunked kernel, which the interpreter cannot
run, replaced by the torch recurrence); with one, the same tests run on it (fla's
kernel, captured graphs). Marked gpu: graphs against eager steps, and bf16 against
the CPU float32 path (match rate reported).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file, save_file

HAS_CUDA = torch.cuda.is_available()  # without it, conftest.py runs Triton's interpreter

from test_model_support import (  # noqa: E402
    ARRIVAL_STEPS,
    CHUNK_PLANS,
    NUM_NEW_TOKENS,
    VOCAB_SIZE,
    random_hybrid_model,
    random_prompts,
    saved,
)

from trio_llm.actors.config import EngineConfig  # noqa: E402
from trio_llm.actors.messages import NewRequestData, ScheduledBatch, ScheduledRequest  # noqa: E402
from trio_llm.gpu import cuda_plan  # noqa: E402
from trio_llm.gpu.cuda_executor import CudaExecutorOptions, CudaModelExecutor  # noqa: E402
from trio_llm.gpu.executor import ModelExecutor, load_executor_model  # noqa: E402
from trio_llm.gpu.kernels.triton_gated_attention import (  # noqa: E402
    gated_qk_norm_rope_write_kv,
    sigmoid_gate,
)
from trio_llm.gpu.kernels.triton_offset_norm import add_offset_rms_norm  # noqa: E402
from trio_llm.gpu.layers.norm import OffsetRMSNorm  # noqa: E402
from trio_llm.gpu.layers.rotary import RotaryEmbedding  # noqa: E402
from trio_llm.gpu.models import cuda_hybrid  # noqa: E402
from trio_llm.gpu.models.config import RopeConfig  # noqa: E402
from trio_llm.gpu.models.cuda_fused import FusedHybridLM  # noqa: E402
from trio_llm.gpu.quantization import E4M3, KVScales, kv_scale_names, quantize_kv  # noqa: E402
from trio_llm.gpu.testing import GREEDY, DriverRequest, ExecutorDriver  # noqa: E402

transformers = pytest.importorskip("transformers")

ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM")
BLOCK_SIZE = 16
# where the CUDA executor under test runs (the CPU executor, the reference, on the CPU)
DEVICE = "cuda" if HAS_CUDA else "cpu"


def write_checkpoint(architecture: str, tmp_path_factory):
    return saved(random_hybrid_model(architecture), tmp_path_factory.mktemp(architecture))[0]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def checkpoint(request, tmp_path_factory):
    """A random checkpoint of each architecture."""
    return write_checkpoint(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def dense_checkpoint(tmp_path_factory):
    """Qwen3.5 dense alone, for what the architectures do not change (Triton's
    interpreter makes each run slow)."""
    return write_checkpoint("Qwen3_5ForCausalLM", tmp_path_factory)


def engine_config(directory, *, device="cpu", dtype="float32",
                  kv_cache_dtype="auto") -> EngineConfig:
    return EngineConfig(model=str(directory), block_size=BLOCK_SIZE, num_kv_blocks=64,
                        device=device, dtype=dtype, max_num_seqs=4,
                        enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)


def cuda_executor(directory, *, device=DEVICE, dtype="float32", use_cuda_graphs=True,
                  max_num_batched_tokens=64, kv_cache_dtype="auto") -> CudaModelExecutor:
    loaded = load_executor_model(engine_config(directory, device=device, dtype=dtype,
                                               kv_cache_dtype=kv_cache_dtype))
    executor = CudaModelExecutor.from_loaded(loaded)
    executor.start(CudaExecutorOptions(max_num_seqs=4,
                                       max_num_batched_tokens=max_num_batched_tokens,
                                       use_cuda_graphs=use_cuda_graphs, use_fused_kernels=True))
    return executor


def driver_requests(*, preempt: bool = False, sampling=GREEDY) -> list[DriverRequest]:
    prompts = random_prompts()
    return [DriverRequest(request_id=f"r{index}", prompt_token_ids=prompt,
                          max_tokens=NUM_NEW_TOKENS, sampling=sampling,
                          chunk_sizes=CHUNK_PLANS[index],
                          arrival_step=ARRIVAL_STEPS[index],
                          preempt_at_steps=[5] if preempt and index == 1 else [])
            for index, prompt in enumerate(prompts)]


def generate(executor, *, preempt: bool = False) -> list[list[int]]:
    requests = ExecutorDriver(executor, decode_input="previous_step").run(
        driver_requests(preempt=preempt))
    return [request.output_token_ids for request in requests]


def test_the_cuda_path_gives_the_cpu_executors_tokens(checkpoint):
    """Chunked prompts, late arrivals, a preemption, in padded graph steps (varlen and
    decode), through the fused hybrid forward: the CPU executor's greedy tokens."""
    expected = generate(ModelExecutor.create(engine_config(checkpoint)), preempt=True)
    executor = cuda_executor(checkpoint)
    assert isinstance(executor.model, FusedHybridLM)
    assert executor.num_state_slots == 4 and len(executor.state_caches) == 4
    assert generate(executor, preempt=True) == expected
    stats = executor.stats
    assert stats.num_graph_steps == stats.num_steps
    assert stats.num_steps_by_kind["decode"] and stats.num_steps_by_kind["mixed"]


def test_eager_steps_give_the_cpu_executors_tokens(dense_checkpoint, caplog):
    """Without graphs (unpadded steps, decode steps by the is_decode of the step itself).
    The start-up log says how many state slots, and their size."""
    expected = generate(ModelExecutor.create(engine_config(dense_checkpoint)))
    with caplog.at_level("INFO", logger="trio_llm.gpu.cuda_executor"):
        executor = cuda_executor(dense_checkpoint, use_cuda_graphs=False)
    assert "state cache: 4 slots of 0.0 MiB over 4 linear-attention layers" in caplog.text
    assert generate(executor) == expected
    assert executor.stats.num_graph_steps == 0


def test_an_fp8_kv_cache_on_the_cuda_path_holds_the_cpu_executors_bytes(tmp_path):
    """--kv-cache-dtype fp8 with the checkpoint's scales (its attention layer's, under a
    multimodal checkpoint's prefix): the keys and values the prompts leave in the cache,
    written over their scales by the gated attention's kernel in padded graph steps, are
    the bytes the CPU executor's cache holds (but for Triton's interpreter's rounding at
    a binade's top, tests/test_triton_kv_fp8.py; on a GPU the model runs in bf16, whose
    keys round to e4m3 a step apart from float32's now and then)."""
    directory = tmp_path / "checkpoint"
    random_hybrid_model("Qwen3_5MoeForConditionalGeneration").save_pretrained(directory)
    k_name, v_name, _ = kv_scale_names(3, "model.language_model.")
    path = directory / "model.safetensors"
    save_file(load_file(path) | {k_name: torch.tensor(0.5), v_name: torch.tensor(2.0)}, path,
              metadata={"format": "pt"})
    reference = ModelExecutor.create(engine_config(directory, kv_cache_dtype="fp8"))
    assert reference.model.decoder_layers[3].self_attn.kv_scales == KVScales(0.5, 2.0)
    executor = cuda_executor(directory, kv_cache_dtype="fp8",
                             dtype="bfloat16" if HAS_CUDA else "float32")
    for run in (reference, executor):
        for cache in run.kv_caches[3]:
            cache.zero_()  # (e4m3 zero is the zero byte: the rows left zero were not written)
        ExecutorDriver(run, decode_input="previous_step").run(
            [dataclasses.replace(request, max_tokens=1) for request in driver_requests()])
    for ours, theirs in zip(executor.kv_caches[3], reference.kv_caches[3], strict=True):
        assert ours.dtype == theirs.dtype == E4M3
        ours, theirs = ours.cpu().view(torch.uint8), theirs.view(torch.uint8)
        written = theirs.flatten(0, 1).flatten(1).ne(0).any(1)
        # (the same slots: one driver's block choices; a finished prompt's blocks reused)
        assert torch.equal(ours.flatten(0, 1).flatten(1).ne(0).any(1), written)
        assert int(written.sum()) > 40
        same = ours.flatten(0, 1)[written] == theirs.flatten(0, 1)[written]
        assert same.float().mean().item() > (0.9 if HAS_CUDA else 0.95)


def test_an_fp8_checkpoints_kept_projections_give_the_cpu_executors_tokens(
        tmp_path, monkeypatch):
    """Qwen3-Next's FP8 checkpoint, its projections kept in e4m3 (as on a GPU: the
    linear attention's q/k/v/z in one layer, b and a apart in the model's dtype): the
    CUDA path gives the CPU executor's tokens (both multiply through Fp8Linear)."""
    from test_quantization import write_fp8_checkpoint

    from trio_llm.gpu import quantization
    from trio_llm.gpu.layers.fp8_linear import Fp8Linear

    write_fp8_checkpoint(random_hybrid_model("Qwen3NextForCausalLM"), tmp_path / "fp8",
                         tmp_path / "plain", "block", (16, 16))
    monkeypatch.setattr(quantization, "FP8_DEVICE_TYPES", ("cuda", "cpu"))
    expected = generate(ModelExecutor.create(engine_config(tmp_path / "fp8")))
    executor = cuda_executor(tmp_path / "fp8")
    layer = executor.model.decoder_layers[0].linear_attn
    assert isinstance(layer.in_proj, Fp8Linear) and not isinstance(layer.in_proj_ba, Fp8Linear)
    assert generate(executor) == expected


def _step(step_id, requests, *, new=(), finished=(), copies=()):
    return ScheduledBatch(step_id=step_id, new_requests=list(new), requests=requests,
                          finished_request_ids=list(finished),
                          num_tokens=sum(len(item.token_ids) for item in requests),
                          state_copies=list(copies))


def _scheduled(request_id, token_ids, start, block_ids):
    return ScheduledRequest(request_id=request_id, token_ids=token_ids,
                            input_from_previous_step=False, num_computed_tokens=start,
                            new_block_ids=block_ids, sample=True, output_index=0)


def test_state_copies_restore_a_prefix_before_the_forward(dense_checkpoint):
    """A request's state after 16 tokens saved into a free slot by state_copies, then
    copied into a second request's slot in the batch that runs it on the same KV
    blocks: the second request samples what the first did after the same chunk.
    Admitted with computed tokens but no copy into its slot, it is refused."""
    checkpoint = dense_checkpoint
    prompt = [(7 * index + 3) % VOCAB_SIZE for index in range(30)]
    executor = cuda_executor(checkpoint)
    first = NewRequestData(request_id="a", sampling=GREEDY, state_slot=0)
    executor.execute(_step(0, [_scheduled("a", prompt[:16], 0, [0])], new=[first]))
    continued = executor.execute(_step(1, [_scheduled("a", prompt[16:], 16, [1])],
                                       copies=[(0, 3)]))
    second = NewRequestData(request_id="b", sampling=GREEDY, state_slot=1)
    with pytest.raises(ValueError, match="no state was restored into its state slot 1"):
        executor.execute(_step(2, [_scheduled("b", prompt[16:], 16, [0, 2])], new=[second]))
    restored = executor.execute(_step(3, [_scheduled("b", prompt[16:], 16, [0, 2])],
                                      new=[second], copies=[(3, 1)], finished=["b"]))
    assert restored.sampled_token_ids == continued.sampled_token_ids
    # the snapshot (slot 3) is the state of the first 16 tokens, computed afresh
    fresh = cuda_executor(checkpoint)
    fresh.execute(_step(0, [_scheduled("b", prompt[:16], 0, [0])], new=[
        NewRequestData(request_id="b", sampling=GREEDY, state_slot=2)]))
    for cache, twin in zip(executor.state_caches, fresh.state_caches, strict=True):
        assert torch.equal(cache.recurrent[3], twin.recurrent[2])
        assert torch.equal(cache.conv[3], twin.conv[2])


def test_fewer_chunk_seats_give_the_same_tokens_and_the_plan_refuses_more_chunks(
        dense_checkpoint, monkeypatch):
    """With MAX_CHUNKED_SEQS at 2 (the driver's steps hold at most two chunks of two
    tokens or more: its first and third steps two, beside decode rows and one-token
    chunks) the compacted seats are full and the tokens are the CPU executor's. At 1, a
    step with two such chunks is refused on the host, before anything runs."""
    expected = generate(ModelExecutor.create(engine_config(dense_checkpoint)))
    monkeypatch.setattr(cuda_hybrid, "MAX_CHUNKED_SEQS", 2)
    monkeypatch.setattr(cuda_plan, "MAX_CHUNKED_SEQS", 2)
    assert generate(cuda_executor(dense_checkpoint)) == expected
    monkeypatch.setattr(cuda_plan, "MAX_CHUNKED_SEQS", 1)
    executor = cuda_executor(dense_checkpoint)
    prompt = [(5 * index + 1) % VOCAB_SIZE for index in range(8)]
    new = [NewRequestData(request_id=request_id, sampling=GREEDY, state_slot=slot)
           for slot, request_id in enumerate("ab")]
    with pytest.raises(ValueError, match="has 2 sequences of two tokens or more"):
        executor.execute(_step(0, [_scheduled("a", prompt[:5], 0, [0]),
                                   _scheduled("b", prompt[5:], 0, [1])], new=new))


# -- the gated attention's kernels -----------------------------------------------------------


def test_gated_qk_kernel_and_gate_match_the_attention_layer():
    """q/k (1 + weight) norms, partial rotary, the KV store and the sigmoid gate against
    the torch layer's operations."""
    device = torch.device("cuda" if HAS_CUDA else "cpu")
    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    heads, kv_heads, head_dim, rotary_dim, num_tokens = 4, 2, 32, 8, 5
    generator = torch.Generator().manual_seed(3)

    def random(*shape):
        return torch.randn(*shape, generator=generator).to(dtype).to(device)

    qkv = random(num_tokens, heads * 2 * head_dim + 2 * kv_heads * head_dim)
    q_norm, k_norm = (OffsetRMSNorm(head_dim, eps=1e-6, dtype=dtype, device=device)
                      for _ in range(2))
    q_norm.weight.data, k_norm.weight.data = random(head_dim) * 0.1, random(head_dim) * 0.1
    rotary = RotaryEmbedding(head_dim, 64, RopeConfig(theta=10000.0), device=device,
                             rotary_dim=rotary_dim)
    positions = torch.tensor([0, 3, 9, 63, 1], device=device)
    slot_mapping = torch.tensor([2, -1, 0, 7, 5], device=device)
    k_cache = torch.zeros(2, 4, kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    query = gated_qk_norm_rope_write_kv(
        qkv, positions, rotary.cos, rotary.sin, q_norm.weight, k_norm.weight, 1e-6, k_cache,
        v_cache, slot_mapping, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)
    gated_query, rest = qkv.split([heads * 2 * head_dim, 2 * kv_heads * head_dim], dim=-1)
    expected_query, gate = gated_query.view(num_tokens, heads, 2 * head_dim).split(head_dim, -1)
    key, value = rest.view(num_tokens, 2 * kv_heads, head_dim).split(kv_heads, dim=1)
    expected_query, expected_key = rotary(positions, q_norm(expected_query), k_norm(key))
    tolerance = dict(rtol=1e-2, atol=1e-2) if HAS_CUDA else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(query, expected_query, **tolerance)
    flat_k, flat_v = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    written = [index for index, slot in enumerate(slot_mapping.tolist()) if slot >= 0]
    slots = slot_mapping[written]
    torch.testing.assert_close(flat_k[slots], expected_key[written], **tolerance)
    assert torch.equal(flat_v[slots], value[written])
    assert int((flat_k.flatten(1) != 0).any(1).sum()) == len(written)
    # an FP8 cache (--kv-cache-dtype fp8): the same keys and values over their scales
    fp8_k, fp8_v = (torch.zeros_like(k_cache, dtype=E4M3) for _ in range(2))
    gated_qk_norm_rope_write_kv(
        qkv, positions, rotary.cos, rotary.sin, q_norm.weight, k_norm.weight, 1e-6, fp8_k,
        fp8_v, slot_mapping, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        kv_scales=KVScales(0.5, 2.0))
    for cache, floats, scale in ((fp8_k, flat_k, 0.5), (fp8_v, flat_v, 2.0)):
        stored = cache.flatten(0, 1)[slots].view(torch.uint8)
        expected = quantize_kv(floats[slots], scale, E4M3).view(torch.uint8)
        if HAS_CUDA:
            assert torch.equal(stored, expected)
        # (Triton's interpreter rounds a mantissa that carries into the next binade a
        # binade low: tests/test_triton_kv_fp8.py)
        assert (stored == expected).float().mean().item() > 0.95
    attended = random(num_tokens, heads, head_dim)
    torch.testing.assert_close(sigmoid_gate(attended, qkv),
                               (attended * torch.sigmoid(gate)).flatten(1), **tolerance)


def test_offset_norm_kernel_matches_the_layer():
    norm = OffsetRMSNorm(96, eps=1e-6, dtype=torch.float32, device=torch.device("cpu"))
    generator = torch.Generator().manual_seed(4)
    norm.weight.data = 0.1 * torch.randn(96, generator=generator)
    x, residual = torch.randn(2, 5, 96, generator=generator)
    if HAS_CUDA:
        norm, x, residual = norm.cuda(), x.cuda(), residual.cuda()
    out, summed = add_offset_rms_norm(x, residual, norm.weight, norm.eps)
    assert torch.equal(summed, x + residual)
    torch.testing.assert_close(out, norm(x + residual), rtol=1e-5, atol=1e-5)


# -- CUDA -----------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_graphs_give_the_eager_steps_tokens(checkpoint):
    """Graph replays against the same kernels eagerly (fla's chunk index built on the
    device, state slots in the static inputs)."""
    eager = generate(cuda_executor(checkpoint, device="cuda", use_cuda_graphs=False))
    assert generate(cuda_executor(checkpoint, device="cuda")) == eager


@pytest.mark.gpu
@pytest.mark.parametrize("architecture", ["Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM"])
def test_gpu_an_fp8_checkpoints_graphs_give_the_eager_steps_tokens(architecture, tmp_path):
    """An FP8 checkpoint in bf16 on CUDA, with an FP8 KV cache: the linear attention's
    q/k/v/z projection, the attention's and the experts in e4m3 through the FP8 kernels,
    b and a apart; graph replays give the eager steps' tokens."""
    from test_quantization import write_fp8_checkpoint

    from trio_llm.gpu.layers.fp8_linear import Fp8Linear

    write_fp8_checkpoint(random_hybrid_model(architecture), tmp_path / "fp8",
                         tmp_path / "plain", "block", (16, 16))
    eager_executor = cuda_executor(tmp_path / "fp8", device="cuda", dtype="bfloat16",
                                   use_cuda_graphs=False, kv_cache_dtype="fp8")
    layer = eager_executor.model.decoder_layers[0].linear_attn
    assert isinstance(layer.in_proj, Fp8Linear) and layer.in_proj_ba is not None
    eager = generate(eager_executor)
    assert generate(cuda_executor(tmp_path / "fp8", device="cuda", dtype="bfloat16",
                                  kv_cache_dtype="fp8")) == eager


@pytest.mark.gpu
def test_gpu_pdl_launches_give_the_plain_launches_tokens(checkpoint, enable_pdl):
    """TRIO_LLM_PDL=1 (gpu/kernels/pdl.py): the linear attention's decode kernels, the
    gated attention's and the norms launched while the kernel before runs, in graphs:
    the tokens of plain launches."""
    plain = generate(cuda_executor(checkpoint, device="cuda"))
    enable_pdl()
    assert generate(cuda_executor(checkpoint, device="cuda")) == plain


@pytest.mark.gpu
def test_gpu_bf16_greedy_match_rate_against_the_cpu_float32_path(checkpoint):
    """bf16 on CUDA against float32 on the CPU: the share of greedy tokens that match
    (reported; tiny random models amplify rounding, so the bar is low)."""
    expected = generate(ModelExecutor.create(engine_config(checkpoint)))
    ours = generate(cuda_executor(checkpoint, device="cuda", dtype="bfloat16"))
    pairs = [(a, b) for mine, theirs in zip(ours, expected, strict=True)
             for a, b in zip(mine, theirs, strict=True)]
    rate = sum(a == b for a, b in pairs) / len(pairs)
    print(f"\n{checkpoint.name}: bf16 cuda vs cpu float32 greedy match rate {rate:.3f}")
    assert rate > 0.5
