"""Tensor parallelism on the CPU (gloo): shards, tokens against one rank, failures.

The engine tests start real worker processes (spawn), a few seconds each, so
there are few of them; the shard tests need no process at all.
"""

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import msgspec
import pytest
import torch
import trio

from trio_llm.actors.errors import EngineDead
from trio_llm.actors.messages import (
    SamplingParams,
    ScheduledBatch,
    ScheduledRequest,
    StepBitmasks,
    StepResult,
    StructuredOutputsParams,
)
from trio_llm.api.engine import Engine, EngineConfig
from trio_llm.gpu.builtin import TINY_CONFIG, resolve_model
from trio_llm.gpu.cuda_executor import CudaExecutorOptions, CudaModelExecutor
from trio_llm.gpu.loader import load_model
from trio_llm.gpu.models.config import ModelLoadError
from trio_llm.gpu.tensor_parallel import TensorParallel
from trio_llm.gpu.tp_executor import TensorParallelError, TensorParallelExecutor
from trio_llm.gpu.tp_worker import CommandPipe, WorkerReport, serve_pipelined

# Spawning two ranks and loading the tiny model takes seconds on a busy 2-core machine.
ENGINE_SECONDS = 120
PROMPTS = ["Once upon a time", "The quick brown fox", "hello", "In the beginning there was",
           "A B C D E F G", "the the the"]
TP2_CONFIG = EngineConfig(model="tiny", tensor_parallel_size=2, num_kv_blocks=128)


def load_rank(rank: int, world_size: int, load_format: str = "auto"):
    parallel = TensorParallel(rank=rank, world_size=world_size)
    return load_model(resolve_model("tiny"), dtype=torch.float32, device=torch.device("cpu"),
                      load_format=load_format, parallel=parallel)


def parameters(model) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


# -- shards, without processes ------------------------------------------------------


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_the_shards_of_two_ranks_tile_the_whole_model(load_format: str) -> None:
    whole = parameters(load_rank(0, 1, load_format))
    ranks = [parameters(load_rank(rank, 2, load_format)) for rank in range(2)]
    config = load_rank(0, 1).config
    q_size, kv_size = config.q_size, config.kv_size
    for name, tensor in whole.items():
        shards = [rank[name] for rank in ranks]
        if name.endswith("qkv_proj.weight"):
            # each rank: its query heads, then its key heads, then its value heads
            pieces = [whole_part.chunk(2) for whole_part in
                      tensor.split([q_size, kv_size, kv_size])]
            for rank, shard in enumerate(shards):
                assert torch.equal(shard, torch.cat([piece[rank] for piece in pieces]))
        elif name.endswith("gate_up_proj.weight"):
            gate, up = (part.chunk(2) for part in tensor.chunk(2))
            for rank, shard in enumerate(shards):
                assert torch.equal(shard, torch.cat([gate[rank], up[rank]]))
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat(shards, dim=1), tensor), name
        elif name == "embed_tokens":  # tied: the lm_head's too
            assert torch.equal(torch.cat(shards), tensor)
        else:
            assert all(torch.equal(shard, tensor) for shard in shards), name


def test_a_vocabulary_that_does_not_divide_is_padded_with_zero_rows(tmp_path) -> None:
    config = dict(TINY_CONFIG, vocab_size=2047)
    (tmp_path / "config.json").write_text(json.dumps(config))

    def embedding(rank: int, world_size: int) -> torch.Tensor:
        model = load_model(tmp_path, dtype=torch.float32, device=torch.device("cpu"),
                           load_format="dummy",
                           parallel=TensorParallel(rank=rank, world_size=world_size))
        return model.embed_tokens

    whole = embedding(0, 1)
    first, last = embedding(0, 2), embedding(1, 2)
    assert first.shape == last.shape == (1024, config["hidden_size"])
    assert torch.equal(torch.cat([first, last[:-1]]), whole)
    assert not last[-1].any()  # the padding row


def test_a_model_the_ranks_cannot_split_is_refused_before_any_process_starts() -> None:
    config = EngineConfig(model="tiny", tensor_parallel_size=3)  # 4 heads, 2 KV heads
    with pytest.raises(ModelLoadError, match="multiple of 3"):
        TensorParallelExecutor.create(config)


def test_tensor_parallel_size_is_a_positive_engine_option() -> None:
    with pytest.raises(msgspec.ValidationError, match="tensor_parallel_size"):
        msgspec.convert({"tensor_parallel_size": 0}, EngineConfig)


# -- the engine over two ranks ------------------------------------------------------


async def generate_all(engine: Engine, requests: list[tuple[str, SamplingParams]]
                       ) -> list[tuple[list[int], list[float]]]:
    """Every request's token ids and sampled-token logprobs, submitted at once."""
    results: list[tuple[list[int], list[float]]] = [([], []) for _ in requests]

    async def one(index: int, prompt: str, params: SamplingParams) -> None:
        async for output in engine.generate(prompt, params):
            results[index][0].extend(output.token_ids)
            results[index][1].extend(entry.logprob for entry in output.logprobs or [])

    async with trio.open_nursery() as nursery:
        for index, (prompt, params) in enumerate(requests):
            nursery.start_soon(one, index, prompt, params)
    return results


def tp_requests() -> list[tuple[str, SamplingParams]]:
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
    seeded = SamplingParams(max_tokens=24, temperature=0.8, seed=7, ignore_eos=True, logprobs=0)
    constrained = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0,
                                 structured_outputs=StructuredOutputsParams(
                                     choice=["red apple", "green pear"]))
    return ([(prompt, greedy) for prompt in PROMPTS]
            + [(PROMPTS[0], seeded), (PROMPTS[1], constrained)])


async def test_two_ranks_give_the_tokens_of_one() -> None:
    """Greedy, seeded and constrained requests batched together (the constrained one's
    bitmasks follow its batches at depth 2): the same tokens at TP 2, depth 2 and 1, as
    at TP 1, and logprobs that agree to float32 rounding of the split sums."""
    requests = tp_requests()
    with trio.fail_after(ENGINE_SECONDS):
        async with Engine.open(msgspec.structs.replace(TP2_CONFIG, tensor_parallel_size=1)
                               ) as engine:
            expected = await generate_all(engine, requests)
        executor = await trio.to_thread.run_sync(TensorParallelExecutor.create, TP2_CONFIG)
        try:
            found_by_depth = []
            for depth in (2, 1):
                config = msgspec.structs.replace(TP2_CONFIG, pipeline_depth=depth)
                async with Engine.open(config, executor=executor) as engine:
                    found_by_depth.append(await generate_all(engine, requests))
        finally:
            await trio.to_thread.run_sync(executor.close)
    for found in found_by_depth:
        for (expected_ids, expected_logprobs), (found_ids, found_logprobs) in zip(
                expected, found, strict=True):
            assert found_ids == expected_ids
            assert found_logprobs == pytest.approx(expected_logprobs, abs=1e-4)
    # closing ended every rank normally
    assert [rank.process.exitcode for rank in executor.ranks] == [0, 0]


async def test_a_rank_that_dies_ends_the_engine_with_an_error() -> None:
    with trio.fail_after(ENGINE_SECONDS):
        executor = await trio.to_thread.run_sync(TensorParallelExecutor.create, TP2_CONFIG)
        try:
            with pytest.raises(EngineDead, match="rank 1"):
                async with Engine.open(TP2_CONFIG, executor=executor) as engine:
                    params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
                    with pytest.raises(EngineDead):
                        async for _ in engine.generate(PROMPTS[0], params):
                            os.kill(executor.ranks[1].process.pid, signal.SIGKILL)
        finally:
            await trio.to_thread.run_sync(executor.close)
    assert executor.ranks[1].process.exitcode == -signal.SIGKILL
    assert executor.ranks[0].process.exitcode is not None


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
async def test_gpu_two_ranks_give_the_tokens_of_one() -> None:
    """NCCL, a CudaModelExecutor with its CUDA graphs on each rank. Only the greedy
    requests, in float32: the tiny model's wide margins absorb the rounding of NCCL's
    all-reduce."""
    config = msgspec.structs.replace(TP2_CONFIG, device="cuda", dtype="float32",
                                     max_num_seqs=16, max_num_batched_tokens=512)
    requests = tp_requests()[:len(PROMPTS)]
    with trio.fail_after(ENGINE_SECONDS * 2):
        async with Engine.open(msgspec.structs.replace(config, tensor_parallel_size=1)
                               ) as engine:
            expected = await generate_all(engine, requests)
        async with Engine.open(config) as engine:
            found = await generate_all(engine, requests)
    num_equal = sum(found_ids == expected_ids for (expected_ids, _), (found_ids, _)
                    in zip(expected, found, strict=True))
    print(f"TP 2 against TP 1 on CUDA: {num_equal} of {len(requests)} requests equal")
    assert [ids[0] for ids, _ in found] == [ids[0] for ids, _ in expected]
    assert num_equal == len(requests)


class PipeExecutor:
    """What TensorParallelExecutor does over a rank's pipe, for a worker loop on a
    thread of this process: the engine drives it like any pipelined executor."""

    def __init__(self, connection, sizes) -> None:
        self.connection = connection
        self.model_path, self.max_model_len = sizes.model_path, sizes.max_model_len
        self.num_kv_blocks, self.vocab_size = sizes.num_kv_blocks, sizes.vocab_size
        self.num_state_slots = getattr(sizes, "num_state_slots", 0)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(WorkerReport)

    def launch(self, batch: ScheduledBatch) -> "PipeStep":
        self.connection.send_bytes(self._encoder.encode(batch))
        return PipeStep(self.connection, batch.step_id)

    def supply_bitmasks(self, pending: "PipeStep", token_bitmasks: list[bytes]) -> None:
        self.connection.send_bytes(self._encoder.encode(StepBitmasks(
            step_id=pending.step_id, token_bitmasks=token_bitmasks)))

    def collect(self, pending: "PipeStep") -> StepResult:
        assert self.connection.poll(0), f"the rank never answered step {pending.step_id}"
        message = self._decoder.decode(self.connection.recv_bytes())
        assert isinstance(message, StepResult)
        return message


class PipeStep:
    def __init__(self, connection, step_id: int) -> None:
        self.connection = connection
        self.step_id = step_id

    def is_ready(self) -> bool:
        return self.connection.poll(0)

    def wait(self) -> None:
        # bounded: a rank that deadlocks fails the test instead of hanging it (a worker
        # thread cannot be cancelled)
        self.connection.poll(ENGINE_SECONDS / 4)


# A step's device time in SlowDevice: long enough that the engine's next batch
# arrives while the step still computes, as it does on a GPU.
DEVICE_SECONDS = 0.02


class SlowDevice:
    """The CUDA executor on the CPU finishes each step as it launches it; this one
    reports a step ready only DEVICE_SECONDS after its launch, like a device."""

    def __init__(self, executor) -> None:
        self.executor = executor

    def launch(self, batch: ScheduledBatch) -> "SlowStep":
        return SlowStep(self.executor.launch(batch), time.monotonic() + DEVICE_SECONDS)

    def supply_bitmasks(self, pending: "SlowStep", token_bitmasks: list[bytes]) -> None:
        self.executor.supply_bitmasks(pending.inner, token_bitmasks)

    def collect(self, pending: "SlowStep") -> StepResult:
        return self.executor.collect(pending.inner)


class SlowStep:
    def __init__(self, inner, ready_at: float) -> None:
        self.inner, self.ready_at, self.step_id = inner, ready_at, inner.step_id

    def is_ready(self) -> bool:
        return time.monotonic() >= self.ready_at and self.inner.is_ready()

    def wait(self) -> None:
        time.sleep(max(0.0, self.ready_at - time.monotonic()))  # the device computing
        self.inner.wait()


async def test_a_pipelined_rank_collects_while_bitmasks_are_on_their_way() -> None:
    """A CUDA rank's loop (serve_pipelined), here over the CUDA executor on the CPU
    with a device's latency: a step whose bitmasks follow is launched at once, and the
    step before it is collected and reported while they come (they come only once the
    engine has its result). Depth 2 gives TP 1's tokens."""
    path = resolve_model("tiny")
    model = load_model(path, dtype=torch.float32, device=torch.device("cpu"))
    executor = CudaModelExecutor(model, model_path=path, num_kv_blocks=128, block_size=16,
                                 max_model_len=4096)
    executor.start(CudaExecutorOptions(max_num_seqs=16, use_cuda_graphs=False,
                                       use_fused_kernels=False))
    supplied: list[int] = []
    supply = executor.supply_bitmasks

    def counting_supply(pending, token_bitmasks: list[bytes]) -> None:
        supplied.append(len(token_bitmasks))
        supply(pending, token_bitmasks)

    executor.supply_bitmasks = counting_supply
    engine_end, rank_end = multiprocessing.Pipe()
    rank = threading.Thread(target=serve_pipelined,
                            args=(SlowDevice(executor), CommandPipe(rank_end)),
                            kwargs={"is_reporter": True}, daemon=True)
    rank.start()
    pipe_executor = PipeExecutor(engine_end, executor)
    requests = tp_requests()
    try:
        with trio.fail_after(ENGINE_SECONDS):
            async with Engine.open(msgspec.structs.replace(TP2_CONFIG, tensor_parallel_size=1)
                                   ) as engine:
                expected = await generate_all(engine, requests)
            async with Engine.open(TP2_CONFIG, executor=pipe_executor) as engine:
                found = await generate_all(engine, requests)
    finally:
        engine_end.close()  # the rank's loop ends
        await trio.to_thread.run_sync(rank.join, ENGINE_SECONDS)
    assert not rank.is_alive()
    assert [ids for ids, _ in found] == [ids for ids, _ in expected]
    assert supplied, "a constrained row decoded on a placeholder"


def test_a_rank_that_raises_reports_its_traceback() -> None:
    """A step the ranks cannot run (a request never registered): the error carries the
    rank's own message, and every rank has exited."""
    executor = TensorParallelExecutor.create(TP2_CONFIG)
    try:
        batch = ScheduledBatch(step_id=0, new_requests=[], finished_request_ids=[],
                               num_tokens=1, requests=[ScheduledRequest(
                                   request_id="unknown", token_ids=[5],
                                   input_from_previous_step=False, num_computed_tokens=0,
                                   new_block_ids=[0], sample=True, output_index=0)])
        with pytest.raises(TensorParallelError, match="(?s)rank [01] failed:.*never registered"):
            executor.execute(batch)
    finally:
        executor.close()
    assert [rank.process.exitcode for rank in executor.ranks] == [1, 1]


ORPHAN_SCRIPT = textwrap.dedent("""
    import sys
    from trio_llm.api.engine import EngineConfig
    from trio_llm.gpu.tp_executor import TensorParallelExecutor

    if __name__ == "__main__":
        executor = TensorParallelExecutor.create(
            EngineConfig(model="tiny", tensor_parallel_size=2, num_kv_blocks=16))
        print(" ".join(str(rank.process.pid) for rank in executor.ranks), flush=True)
        sys.stdin.read()  # until the test kills this process
""")


async def test_the_ranks_exit_when_the_engine_process_dies(tmp_path) -> None:
    script = tmp_path / "engine.py"
    script.write_text(ORPHAN_SCRIPT)
    with trio.fail_after(ENGINE_SECONDS):
        engine_process = await trio.lowlevel.open_process(
            [sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            line = b""
            while not line.endswith(b"\n"):
                chunk = await engine_process.stdout.receive_some()
                assert chunk, "the engine process ended before its ranks were ready"
                line += chunk
            pidfds = [os.pidfd_open(int(pid)) for pid in line.split()]
        finally:
            engine_process.kill()
            await engine_process.wait()
        # each pidfd turns readable when its process has exited
        for pidfd in pidfds:
            await trio.lowlevel.wait_readable(pidfd)
            os.close(pidfd)
