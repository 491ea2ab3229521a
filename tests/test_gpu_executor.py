"""The pipelined executor (gpu/cuda_executor.py).

On the CPU its streams and events are no-ops, so its bookkeeping runs in CI:
launched two steps deep, with tokens fed from the previous step on the device,
it must give the plain ModelExecutor's tokens exactly. On CUDA (marked gpu)
depth 2 with graphs and fused kernels must match depth 1, and the greedy output
is compared with the CPU float32 path (match rate reported).
"""

from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()  # without it, conftest.py runs Triton's interpreter

from trio_llm.actors.messages import (  # noqa: E402
    NewRequestData,
    SamplingOptions,
    ScheduledBatch,
    ScheduledRequest,
)
from trio_llm.gpu import cuda_startup, step_packing  # noqa: E402
from trio_llm.gpu.builtin import resolve_model  # noqa: E402
from trio_llm.gpu.cuda_executor import CudaExecutorOptions, CudaModelExecutor  # noqa: E402
from trio_llm.gpu.executor import ModelExecutor, kv_slots  # noqa: E402
from trio_llm.gpu.loader import load_model  # noqa: E402
from trio_llm.gpu.testing import run_depth_1, run_depth_2  # noqa: E402

BLOCK_SIZE = 4
NUM_KV_BLOCKS = 64


def options(temperature: float, *, seed: int = 0, top_k: int = 0, num_logprobs=None,
            min_tokens: int = 0, banned_token_ids=()) -> SamplingOptions:
    return SamplingOptions(temperature=temperature, top_p=1.0, top_k=top_k, min_p=0.0,
                           seed=seed, num_logprobs=num_logprobs, min_tokens=min_tokens,
                           banned_token_ids=list(banned_token_ids))


def scheduled(request_id, token_ids, *, computed, blocks=(), sample=True, output_index=0):
    """A request's share of a step; ``token_ids`` None takes last step's sampled token."""
    return ScheduledRequest(request_id=request_id, token_ids=token_ids or [],
                            input_from_previous_step=token_ids is None,
                            num_computed_tokens=computed, new_block_ids=list(blocks),
                            sample=sample, output_index=output_index)


def scripted_batches() -> list[ScheduledBatch]:
    """Prefill, a chunked prompt, decodes fed from the previous step, a late mixed-in
    request with logprobs, a finish, and sampling with top-k and banned ids."""
    a, b, c = "a", "b", "c"
    return [
        ScheduledBatch(step_id=0, new_requests=[
            NewRequestData(request_id=a, sampling=options(0.0)),
            NewRequestData(request_id=b, sampling=options(0.8, seed=5, top_k=50,
                                                          min_tokens=2, banned_token_ids=[2]))],
            requests=[scheduled(a, [5, 9, 14, 200, 31, 7], computed=0, blocks=[0, 1]),
                      scheduled(b, [40, 41, 42], computed=0, blocks=[2], sample=False)],
            finished_request_ids=[], num_tokens=9),
        ScheduledBatch(step_id=1, new_requests=[], requests=[
            scheduled(a, None, computed=6, output_index=1),
            scheduled(b, [43, 44, 45, 46], computed=3, blocks=[3])],
            finished_request_ids=[], num_tokens=5),
        ScheduledBatch(step_id=2, new_requests=[], requests=[
            scheduled(a, None, computed=7, output_index=2),
            scheduled(b, None, computed=7, output_index=1)],
            finished_request_ids=[], num_tokens=2),
        ScheduledBatch(step_id=3, new_requests=[
            NewRequestData(request_id=c, sampling=options(0.0, num_logprobs=2))], requests=[
            scheduled(a, None, computed=8, blocks=[4], output_index=3),
            scheduled(b, None, computed=8, blocks=[5], output_index=2),
            scheduled(c, [3, 1, 4, 1, 5], computed=0, blocks=[6, 7])],
            finished_request_ids=[], num_tokens=7),
        ScheduledBatch(step_id=4, new_requests=[], requests=[
            scheduled(b, None, computed=9, output_index=3),
            scheduled(c, None, computed=5, output_index=1)],
            finished_request_ids=["a"], num_tokens=2),
        ScheduledBatch(step_id=5, new_requests=[], requests=[
            scheduled(b, None, computed=10, output_index=4),
            scheduled(c, None, computed=6, output_index=2)],
            finished_request_ids=[], num_tokens=2),
    ]


def build(executor_class, device, **start_options):
    model = load_model(resolve_model("tiny"), dtype=torch.float32, device=device)
    executor = executor_class(model, model_path=resolve_model("tiny"),
                              num_kv_blocks=NUM_KV_BLOCKS, block_size=BLOCK_SIZE,
                              max_model_len=256)
    if start_options:
        executor.start(CudaExecutorOptions(max_num_seqs=4, **start_options))
    return executor


def assert_same_results(results, expected):
    for result, reference in zip(results, expected, strict=True):
        assert result.step_id == reference.step_id
        assert result.request_ids == reference.request_ids
        assert result.sampled_token_ids == reference.sampled_token_ids
        if reference.logprobs is None:
            assert result.logprobs is None
            continue
        for ours, theirs in zip(result.logprobs, reference.logprobs, strict=True):
            assert (ours is None) == (theirs is None)
            if theirs is not None:
                # values, not ids: GEMMs of another shape may swap two near-tied tokens
                assert ours.top_logprobs == pytest.approx(theirs.top_logprobs, abs=1e-4)
                assert ours.logprob == pytest.approx(theirs.logprob, abs=1e-4)


def test_depth_2_on_the_cpu_gives_the_plain_executors_tokens():
    cpu = torch.device("cpu")
    expected = run_depth_1(build(ModelExecutor, cpu), scripted_batches())
    pipelined = build(CudaModelExecutor, cpu, use_cuda_graphs=False, use_fused_kernels=False)
    results = run_depth_2(pipelined, scripted_batches())
    assert_same_results(results, expected)
    assert [len(r.sampled_token_ids) for r in results] == [1, 2, 2, 3, 2, 2]
    assert "a" not in pipelined.requests  # finished requests are forgotten


@pytest.mark.parametrize("run", [run_depth_1, run_depth_2])
def test_padded_graph_steps_on_the_cpu_give_the_plain_executors_tokens(run):
    """On the CPU a "graph" runs eagerly on the graphs' static, padded buffers: every
    step of the script goes through them (mixed steps padded to a varlen token count,
    decode steps to a batch size), and the tokens are the plain executor's."""
    cpu = torch.device("cpu")
    expected = run_depth_1(build(ModelExecutor, cpu), scripted_batches())
    padded = build(CudaModelExecutor, cpu, use_cuda_graphs=True, use_fused_kernels=False,
                   max_num_batched_tokens=64)
    assert sorted(padded.varlen_graphs.graphs) == [16, 32, 64]
    assert_same_results(run(padded, scripted_batches()), expected)
    stats = padded.stats
    assert stats.num_graph_steps == stats.num_steps == 6
    assert stats.num_steps_by_kind == {"decode": 3, "mixed": 2, "prefill": 1}
    assert stats.num_graph_steps_by_kind == stats.num_steps_by_kind


def test_a_decode_row_fed_from_the_host_makes_a_mixed_step():
    """At depth 1 the scheduler sends a decode row's token itself (a 1-token chunk)."""
    executor = build(CudaModelExecutor, torch.device("cpu"), use_cuda_graphs=False,
                     use_fused_kernels=False)
    first = executor.execute(scripted_batches()[0])
    executor.execute(ScheduledBatch(step_id=1, new_requests=[], requests=[
        scheduled("a", first.sampled_token_ids, computed=6, output_index=1),
        scheduled("b", [43, 44, 45, 46], computed=3, blocks=[3])],
        finished_request_ids=[], num_tokens=5))
    assert executor.stats.num_steps_by_kind == {"decode": 0, "mixed": 1, "prefill": 1}


def test_a_step_takes_the_smallest_graph_that_fits():
    executor = build(CudaModelExecutor, torch.device("cpu"), use_cuda_graphs=True,
                     use_fused_kernels=False, max_num_batched_tokens=64)
    varlen = executor.varlen_graphs
    assert [varlen.num_tokens_for(n, 2) for n in (1, 16, 17, 33, 64, 65)] == [
        16, 16, 32, 64, 64, None]
    assert varlen.num_tokens_for(20, 5) is None  # more sequences than max_num_seqs (4)
    assert [varlen.num_seq_slots(n) for n in (16, 64)] == [5, 5]  # 4 sequences + padding
    assert [executor.decode_graphs.batch_size_for(n) for n in (1, 3, 4, 5)] == [1, 4, 4, None]


def test_steps_beyond_the_largest_graph_run_eagerly():
    cpu = torch.device("cpu")
    expected = run_depth_1(build(ModelExecutor, cpu), scripted_batches())
    executor = build(CudaModelExecutor, cpu, use_cuda_graphs=True, use_fused_kernels=False,
                     max_num_batched_tokens=8)
    assert sorted(executor.varlen_graphs.graphs) == [8]
    assert_same_results(run_depth_2(executor, scripted_batches()), expected)
    assert executor.stats.num_graph_steps == 5  # the 9-token prefill ran eagerly


def test_graph_capture_stops_at_its_budget_and_says_so(caplog):
    """A capture budget spent before the first graph leaves every step eager, and the
    log names the budget; the summary line says how many graphs, in how long."""
    cpu = torch.device("cpu")
    expected = run_depth_1(build(ModelExecutor, cpu), scripted_batches())
    with caplog.at_level("INFO", logger="trio_llm.gpu.cuda_executor"):
        executor = build(CudaModelExecutor, cpu, use_cuda_graphs=True,
                         use_fused_kernels=False, graph_capture_budget_seconds=-1.0)
    assert not executor.decode_graphs.graphs and not executor.varlen_graphs.graphs
    assert "stopped at its -1 s budget" in caplog.text
    assert "captured 0 decode CUDA graphs" in caplog.text and "0 varlen graphs" in caplog.text
    assert_same_results(run_depth_1(executor, scripted_batches()), expected)
    assert executor.stats.num_graph_steps == 0


def test_padding_tokens_never_write_the_kv_cache():
    cpu = torch.device("cpu")
    executor = build(CudaModelExecutor, cpu, use_cuda_graphs=True, use_fused_kernels=False,
                     max_num_batched_tokens=64)
    for k_cache, v_cache in executor.kv_caches:
        k_cache.fill_(7.0)
        v_cache.fill_(7.0)
    run_depth_1(executor, scripted_batches()[:2])  # 9 and 5 tokens, in graphs of 16
    # a: slots 0-5 then 6; b: slots 8-10 then 11-14 (blocks 0 to 3, 4 slots each)
    expected_slots = [*range(7), *range(8, 15)]
    for k_cache, v_cache in executor.kv_caches:
        for cache in (k_cache, v_cache):
            written = (cache.flatten(0, 1) != 7.0).flatten(1).any(dim=1)
            assert written.nonzero().flatten().tolist() == expected_slots


def test_the_fused_kernels_in_padded_graph_steps_give_the_eager_steps_tokens():
    """The varlen and decode kernels (in Triton's interpreter without CUDA), fed the
    graphs' padded layout, give the tokens of the same kernels on unpadded eager steps."""
    device = torch.device("cuda" if HAS_CUDA else "cpu")
    eager = run_depth_1(build(CudaModelExecutor, device, use_cuda_graphs=False,
                              use_fused_kernels=True), scripted_batches())
    padded = build(CudaModelExecutor, device, use_cuda_graphs=True, use_fused_kernels=True,
                   max_num_batched_tokens=32)
    assert_same_results(run_depth_2(padded, scripted_batches()), eager)
    assert padded.stats.num_graph_steps == 6


def test_the_start_up_warm_up_leaves_no_trace():
    cpu = torch.device("cpu")
    expected = run_depth_1(build(ModelExecutor, cpu), scripted_batches())
    pipelined = build(CudaModelExecutor, cpu, use_cuda_graphs=False, use_fused_kernels=False)
    cuda_startup.warm_up(pipelined)
    assert not pipelined.requests and pipelined.stats.num_steps == 0
    assert_same_results(run_depth_2(pipelined, scripted_batches()), expected)


@pytest.mark.parametrize(("start", "end"), [(0, 1), (5, 6), (3, 130), (17, 300), (0, 512)])
def test_kv_slots_loop_and_vectorized_agree(start, end):
    block_size = 16
    block_ids = [(7 * index + 3) % 97 for index in range(-(-end // block_size))]
    expected = [block_ids[position // block_size] * block_size + position % block_size
                for position in range(start, end)]
    assert kv_slots(block_ids, block_size, start, end) == expected


def test_long_chunks_pack_their_positions_and_slots_in_place():
    """Long chunks' positions and slots travel as arrays inserted between the short
    rows' values: the upload holds every token's position and slot in batch order, the
    graph's padding after them."""
    model = load_model(resolve_model("tiny"), dtype=torch.float32, device=torch.device("cpu"))
    executor = CudaModelExecutor(model, model_path=resolve_model("tiny"), num_kv_blocks=200,
                                 block_size=BLOCK_SIZE, max_model_len=512)
    executor.start(CudaExecutorOptions(max_num_seqs=4, max_num_batched_tokens=512,
                                       use_cuda_graphs=True, use_fused_kernels=False))
    lengths = [3, 150, 1, 200]  # short, long, a decode-sized chunk, long
    shuffled = [(37 * index + 11) % 200 for index in range(200)]
    blocks, requests = iter(shuffled), []
    for i, length in enumerate(lengths):
        own = [next(blocks) for _ in range(-(-length // BLOCK_SIZE))]
        requests.append(scheduled(f"r{i}", [3] * length, computed=0, blocks=own))
    batch = ScheduledBatch(step_id=0, new_requests=[
        NewRequestData(request_id=f"r{i}", sampling=options(0.0)) for i in range(4)],
        requests=requests, finished_request_ids=[], num_tokens=sum(lengths))
    executor._update_states(batch)
    step = executor._plan(batch)
    executor._pad_for_graph(step)
    assert step.graph_key == ("varlen", 384) and len(step.inserts["positions"]) == 2
    int_offsets, _, _ = executor._pack(step, executor._sampling_plan(step), executor.slots[0])
    packed = executor.slots[0].host_ints.numpy()

    def segment(name):
        start, length = int_offsets[name]
        return packed[start:start + length].tolist()

    num_real = sum(lengths)
    expected_positions = [position for length in lengths for position in range(length)]
    expected_slots = [slot for request in requests
                      for slot in kv_slots(request.new_block_ids, BLOCK_SIZE, 0,
                                           len(request.token_ids))]
    assert segment("positions") == expected_positions + [0] * (384 - num_real)
    assert segment("slot_mapping") == expected_slots + [-1] * (384 - num_real)
    assert len(segment("token_ids")) == 384


def test_every_upload_segment_starts_16_byte_aligned():
    """Triton specialises kernels on 16-byte-aligned pointers: misaligned views of the
    upload would compile new kernel variants mid-run."""
    offsets = step_packing.offsets({"a": 3, "b": 1, "c": 0, "d": 5, "e": 2})
    assert [start for start, _ in offsets.values()] == [0, 4, 8, 8, 16]
    assert step_packing.end(offsets) == 18
    assert all(start * 4 % 16 == 0 for start, _ in offsets.values())


def test_a_third_launch_without_a_collect_is_refused():
    executor = build(CudaModelExecutor, torch.device("cpu"), use_cuda_graphs=False,
                     use_fused_kernels=False)
    batches = scripted_batches()
    executor.launch(batches[0])
    executor.launch(batches[1])
    with pytest.raises(AssertionError):
        executor.launch(batches[2])


def test_the_block_table_grows_past_its_rows():
    executor = build(CudaModelExecutor, torch.device("cpu"), use_cuda_graphs=False,
                     use_fused_kernels=False)
    num_rows = executor.block_table.shape[0]
    new_requests = [NewRequestData(request_id=f"r{i}", sampling=options(0.0))
                    for i in range(num_rows + 1)]
    requests = [scheduled(f"r{i}", [7], computed=0, blocks=[i % NUM_KV_BLOCKS])
                for i in range(num_rows + 1)]
    result = executor.execute(ScheduledBatch(step_id=0, new_requests=new_requests,
                                             requests=requests, finished_request_ids=[],
                                             num_tokens=len(requests)))
    assert len(result.sampled_token_ids) == num_rows + 1
    assert executor.block_table.shape[0] > num_rows
    assert len(set(result.sampled_token_ids)) == 1  # same prompt, same greedy token


def test_a_largest_step_fits_the_slots_as_started():
    """Slots start large enough for max_num_batched_tokens and max_num_seqs (a graph's
    padding included): growing one mid-run waits for the device."""
    model = load_model(resolve_model("tiny"), dtype=torch.float32, device=torch.device("cpu"))
    executor = CudaModelExecutor(model, model_path=resolve_model("tiny"), num_kv_blocks=160,
                                 block_size=BLOCK_SIZE, max_model_len=512)
    executor.start(CudaExecutorOptions(max_num_seqs=4, max_num_batched_tokens=512,
                                       use_cuda_graphs=True, use_fused_kernels=False))
    buffers = [(slot.host_ints, slot.host_floats) for slot in executor.slots]
    lengths, block_ids = [250, 200, 61, 1], iter(range(160))
    requests = [scheduled(f"r{i}", [3] * length, computed=0,
                          blocks=[next(block_ids) for _ in range(-(-length // BLOCK_SIZE))])
                for i, length in enumerate(lengths)]
    new_requests = [NewRequestData(request_id=f"r{i}", sampling=options(0.7, seed=i))
                    for i in range(len(lengths))]
    prefill = ScheduledBatch(step_id=0, new_requests=new_requests, requests=requests,
                             finished_request_ids=[], num_tokens=sum(lengths))
    decode = ScheduledBatch(step_id=1, new_requests=[], requests=[
        scheduled(f"r{i}", [5], computed=length, blocks=[next(block_ids)])
        for i, length in enumerate(lengths)], finished_request_ids=[], num_tokens=4)
    for batch in (prefill, decode):
        assert len(executor.execute(batch).sampled_token_ids) == len(lengths)
    assert executor.stats.num_graph_steps == 2
    assert all(slot.host_ints is ints and slot.host_floats is floats
               for slot, (ints, floats) in zip(executor.slots, buffers, strict=True))


def test_previous_tokens_are_read_from_the_device_where_ids_are_negative():
    from trio_llm.gpu.cuda_graphs import with_previous_tokens

    sampled = torch.tensor([[11, 12, 13], [21, 22, 23]])
    token_ids = torch.tensor([5, -1, 0, -6, -4, 7])
    assert with_previous_tokens(token_ids, sampled).tolist() == [5, 11, 0, 23, 21, 7]


def test_a_step_wider_than_max_num_seqs_drops_the_graphs_and_keeps_the_tokens():
    """device_sampled is as wide as max_num_seqs and the graphs read it; a wider step
    (never from the scheduler) widens it, re-addresses the tokens still to be read, and
    runs every later step eagerly, with the plain executor's tokens at depth 2."""
    cpu = torch.device("cpu")
    num_requests = 6
    new = [NewRequestData(request_id=f"r{i}", sampling=options(0.0)) for i in range(4)]
    wide_new = [NewRequestData(request_id=f"r{i}", sampling=options(0.0))
                for i in range(4, num_requests)]
    first = [scheduled(f"r{i}", [3 + i, 9, 4], computed=0, blocks=[2 * i, 2 * i + 1])
             for i in range(4)]
    # the wide step comes third: the tokens it reads were sampled into slot 1, whose
    # rows move when the buffer widens
    second = [scheduled(f"r{i}", None, computed=3, output_index=1) for i in range(4)]
    wide = [scheduled(f"r{i}", None, computed=4, output_index=2) for i in range(4)] + [
        scheduled(f"r{i}", [2 * i, 5], computed=0, blocks=[2 * i, 2 * i + 1])
        for i in range(4, num_requests)]
    last = [scheduled(f"r{i}", None, computed=5 if i < 4 else 2, output_index=3 if i < 4 else 1)
            for i in range(num_requests)]
    batches = [ScheduledBatch(step_id=index, new_requests=new_requests, requests=requests,
                              finished_request_ids=[],
                              num_tokens=sum(len(r.token_ids) or 1 for r in requests))
               for index, (new_requests, requests) in enumerate(
                   [(new, first), ([], second), (wide_new, wide), ([], last)])]
    expected = run_depth_1(build(ModelExecutor, cpu), batches)
    padded = build(CudaModelExecutor, cpu, use_cuda_graphs=True, use_fused_kernels=False,
                   max_num_batched_tokens=64)
    assert_same_results(run_depth_2(padded, batches), expected)
    assert padded.device_sampled.shape[1] == num_requests
    assert not padded.decode_graphs.graphs and not padded.varlen_graphs.graphs
    assert padded.stats.num_graph_steps == 2  # the steps before the wide one


# -- CUDA -----------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_depth_2_with_graphs_matches_depth_1():
    cuda = torch.device("cuda")
    depth_1 = run_depth_1(build(CudaModelExecutor, cuda, use_cuda_graphs=True,
                                use_fused_kernels=True), scripted_batches())
    executor = build(CudaModelExecutor, cuda, use_cuda_graphs=True, use_fused_kernels=True)
    assert executor.graphs  # decode steps replay graphs
    assert_same_results(run_depth_2(executor, scripted_batches()), depth_1)


@pytest.mark.gpu
def test_gpu_graphs_match_eager_steps():
    cuda = torch.device("cuda")
    eager = run_depth_1(build(CudaModelExecutor, cuda, use_cuda_graphs=False,
                              use_fused_kernels=True), scripted_batches())
    executor = build(CudaModelExecutor, cuda, use_cuda_graphs=True, use_fused_kernels=True)
    assert_same_results(run_depth_1(executor, scripted_batches()), eager)
    # every step replayed a graph: prefill, mixed and decode alike
    assert executor.stats.num_graph_steps_by_kind == {"decode": 3, "mixed": 2, "prefill": 1}


@pytest.mark.gpu
def test_gpu_greedy_match_rate_against_the_cpu_float32_path():
    """Greedy decoding of the tiny model, float32 on the CPU vs float32 on CUDA (fused
    kernels, graphs). Reported: the share of tokens that match, and the first divergence."""
    num_steps, num_requests = 48, 4
    prompts = [[(17 * r + 5 * i) % 2000 + 3 for i in range(6 + 3 * r)] for r in range(num_requests)]
    outputs = {}
    for name, executor in (("cpu", build(ModelExecutor, torch.device("cpu"))),
                           ("cuda", build(CudaModelExecutor, torch.device("cuda"),
                                          use_cuda_graphs=True, use_fused_kernels=True))):
        outputs[name] = greedy_generate(executor, prompts, num_steps)
    matches = total = 0
    first_divergence = None
    for r in range(num_requests):
        for i, (ours, theirs) in enumerate(zip(outputs["cuda"][r], outputs["cpu"][r],
                                               strict=True)):
            total += 1
            if ours == theirs:
                matches += 1
            elif first_divergence is None or i < first_divergence[1]:
                first_divergence = (r, i)
    print(f"\ngreedy match rate cuda vs cpu float32: {matches}/{total} = {matches / total:.3f}; "
          f"first divergence (request, output index): {first_divergence}")
    assert matches / total > 0.5


def greedy_generate(executor, prompts, num_steps):
    """Prefill every prompt in one step, then decode ``num_steps`` tokens, depth 1."""
    outputs = [[] for _ in prompts]
    blocks_per_request = -(-(max(map(len, prompts)) + num_steps + 1) // BLOCK_SIZE)
    block_ids = [list(range(r * blocks_per_request, (r + 1) * blocks_per_request))
                 for r in range(len(prompts))]
    new_requests = [NewRequestData(request_id=str(r), sampling=options(0.0))
                    for r in range(len(prompts))]
    requests = [scheduled(str(r), prompt, computed=0, blocks=block_ids[r])
                for r, prompt in enumerate(prompts)]
    result = executor.execute(ScheduledBatch(step_id=0, new_requests=new_requests,
                                             requests=requests, finished_request_ids=[],
                                             num_tokens=sum(map(len, prompts))))
    for step in range(1, num_steps + 1):
        for r, token_id in enumerate(result.sampled_token_ids):
            outputs[r].append(token_id)
        requests = [scheduled(str(r), None, computed=len(prompt) + step - 1, output_index=step)
                    for r, prompt in enumerate(prompts)]
        result = executor.execute(ScheduledBatch(step_id=step, new_requests=[],
                                                 requests=requests, finished_request_ids=[],
                                                 num_tokens=len(prompts)))
    return outputs


async def test_the_engine_pipelines_the_executor_on_the_cpu():
    """Through the whole engine (scheduler at depth 2, the runner's launch/collect loop),
    the pipelined executor gives the plain executor's greedy and seeded tokens."""
    import trio

    from trio_llm.actors.config import EngineConfig
    from trio_llm.actors.messages import SamplingParams
    from trio_llm.api.engine import Engine

    config = EngineConfig(model="tiny", device="cpu", num_kv_blocks=64, max_num_seqs=4)
    prompts = ["Hello there", "The quick brown fox", "trio actors", "one two three four"]
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0.9, seed=3, ignore_eos=True)]

    async def generate_all(executor):
        outputs = {}

        async def one(index, prompt):
            tokens = []
            async for output in engine.generate(prompt, params[index % 2]):
                tokens += output.token_ids
            outputs[index] = tokens

        async with Engine.open(config, executor=executor) as engine:
            async with trio.open_nursery() as nursery:
                for index, prompt in enumerate(prompts):
                    nursery.start_soon(one, index, prompt)
        return outputs

    with trio.fail_after(60):
        expected = await generate_all(ModelExecutor.create(config))
        pipelined = CudaModelExecutor.create(config)
        assert not pipelined.options.use_cuda_graphs
        assert await generate_all(pipelined) == expected
