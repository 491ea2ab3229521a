"""The in-process API end to end: priority, cancellation, failure, bad input."""

from __future__ import annotations

import random
from contextlib import aclosing

import pytest
import trio
from test_executor_support import (
    HOLD_LIMIT_SECONDS,
    FaultyExecutor,
    HangingPipelinedExecutor,
)
from trio.testing import wait_all_tasks_blocked

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.errors import EngineDead, RequestRejected
from trio_llm.actors.messages import SamplingParams
from trio_llm.api.engine import Engine
from trio_llm.gpu.executor import ModelExecutor

CONFIG = EngineConfig(model="tiny", num_kv_blocks=256, block_size=16, max_num_seqs=64,
                      max_num_batched_tokens=512)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def collect(engine: Engine, prompt: list[int] | str, params: SamplingParams,
                  **kwargs: object) -> list[int]:
    token_ids: list[int] = []
    async for output in engine.generate(prompt, params, **kwargs):  # type: ignore[arg-type]
        token_ids += output.token_ids
    return token_ids


async def assert_engine_idle(engine: Engine) -> None:
    """Run one more request: channels are FIFO, so once it finished, every abort
    sent before it has been handled. Then nothing may hold a KV block."""
    assert await collect(engine, [5, 6, 7], greedy(2))
    stats = engine.statistics()
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.num_free_blocks == stats.num_total_blocks


# -- priority -------------------------------------------------------------------


async def first_token_order(config: EngineConfig) -> tuple[list[str], int]:
    """Fill both seats with low-priority requests, queue two more, then send a
    high-priority one; return the order in which requests got a first token."""
    order: list[str] = []
    async with Engine.open(config) as engine:
        first_tokens = {name: trio.Event() for name in "ABCDH"}

        async def run(name: str, priority: int, max_tokens: int) -> None:
            async for _ in engine.generate([10, 11, 12, ord(name)], greedy(max_tokens),
                                           priority=priority, request_id=name):
                if not first_tokens[name].is_set():
                    first_tokens[name].set()
                    order.append(name)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "A", 5, 60)
            nursery.start_soon(run, "B", 5, 60)
            await first_tokens["A"].wait()
            await first_tokens["B"].wait()
            for name in "CD":
                nursery.start_soon(run, name, 5, 5)
                await wait_all_tasks_blocked()
            nursery.start_soon(run, "H", 0, 5)
        num_preemptions = engine.statistics().num_preemptions
    return order, num_preemptions


async def test_late_high_priority_request_runs_before_earlier_low_priority_ones() -> None:
    config = EngineConfig(model="tiny", max_num_seqs=2, scheduling_policy="priority",
                          num_kv_blocks=64)
    with trio.fail_after(60):
        order, num_preemptions = await first_token_order(config)
    assert order.index("H") < order.index("C") < order.index("D")
    assert num_preemptions == 0


async def test_priority_preemption_threshold() -> None:
    base = EngineConfig(model="tiny", max_num_seqs=2, scheduling_policy="priority",
                        num_kv_blocks=64)
    with trio.fail_after(60):
        order, num_preemptions = await first_token_order(
            msgspec_replace(base, priority_preemption_threshold=3))
        assert num_preemptions >= 1
        assert order[2] == "H", "the high-priority request preempted a running one at once"

        order, num_preemptions = await first_token_order(
            msgspec_replace(base, priority_preemption_threshold=6))
        assert num_preemptions == 0, "a gap of 5 is under the threshold of 6"


def msgspec_replace(config: EngineConfig, **changes: object) -> EngineConfig:
    import msgspec

    return msgspec.structs.replace(config, **changes)


# -- cancellation ---------------------------------------------------------------


async def test_cancelled_streams_free_their_blocks_and_leave_others_unchanged() -> None:
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(1, 30))] for _ in range(100)]
    cancelled = set(rng.sample(range(100), 50))
    with trio.fail_after(240):
        async with Engine.open(CONFIG) as engine:
            reference = {}
            async with trio.open_nursery() as nursery:
                for index in sorted(set(range(100)) - cancelled):
                    async def run_reference(index: int = index) -> None:
                        reference[index] = await collect(engine, prompts[index], greedy(12))
                    nursery.start_soon(run_reference)

            results: dict[int, list[int]] = {}

            async def run(index: int) -> None:
                received: list[int] = []
                stop_after = 1 + index % 5
                if index not in cancelled:
                    results[index] = await collect(engine, prompts[index], greedy(12))
                elif index % 2:  # leave the loop early
                    async with aclosing(engine.generate(prompts[index], greedy(12))) as stream:
                        async for output in stream:
                            received += output.token_ids
                            if len(received) >= stop_after:
                                break
                else:  # a cancel scope around the stream
                    with trio.CancelScope() as scope:
                        async for output in engine.generate(prompts[index], greedy(12)):
                            received += output.token_ids
                            if len(received) >= stop_after:
                                scope.cancel()

            async with trio.open_nursery() as nursery:
                for index in range(100):
                    nursery.start_soon(run, index)
            assert results == reference
            await assert_engine_idle(engine)


async def test_a_stream_held_in_a_variable_is_aborted_when_its_loop_breaks() -> None:
    """No aclosing: the loop's own iterator aborts the request when the loop drops
    it, while the stream itself is still referenced."""
    with trio.fail_after(120):
        async with Engine.open(CONFIG) as engine:
            stream = engine.generate([5, 6, 7], greedy(200))
            async for output in stream:
                assert output.token_ids
                break
            await wait_all_tasks_blocked()
            assert engine.num_open_requests == 0  # the abort went out
            with pytest.raises(StopAsyncIteration):
                await anext(stream)  # one loop consumes a stream
            await assert_engine_idle(engine)  # its blocks are free
            del stream


async def test_a_stream_dropped_unfinished_is_aborted_when_collected() -> None:
    import gc

    with trio.fail_after(120):
        async with Engine.open(CONFIG) as engine:
            stream = engine.generate([5, 6, 7], greedy(200))
            assert (await anext(stream)).token_ids  # read directly, without a loop
            assert engine.num_open_requests == 1
            del stream
            gc.collect()
            await wait_all_tasks_blocked()
            assert engine.num_open_requests == 0
            await assert_engine_idle(engine)


async def test_a_stream_is_its_own_async_context_manager() -> None:
    with trio.fail_after(120):
        async with Engine.open(CONFIG) as engine:
            async with engine.generate([5, 6, 7], greedy(200)) as stream:
                first = await anext(stream)
            # aborted on the way out of the block, before anything else runs
            assert first.token_ids and engine.num_open_requests == 0
            await assert_engine_idle(engine)
            async with engine.generate([5, 6, 7], greedy(3)) as stream:
                token_ids = [token for output in [o async for o in stream]
                             for token in output.token_ids]
            assert len(token_ids) == 3


async def test_abort_by_id_finishes_the_stream_with_reason_abort() -> None:
    with trio.fail_after(60):
        async with Engine.open(CONFIG) as engine:
            last = None
            async for output in engine.generate([1, 2, 3], greedy(1000), request_id="victim"):
                last = output
                if not output.finished:
                    await engine.abort("victim")
            assert last is not None and last.finished and last.finish_reason == "abort"
            await assert_engine_idle(engine)


# -- failure --------------------------------------------------------------------


async def test_a_step_that_never_completes_does_not_hold_shutdown() -> None:
    """A hung device step: at exit its request ends with EngineDead once the grace
    is over, and the engine closes without waiting for the step."""
    inner = await trio.to_thread.run_sync(ModelExecutor.create, CONFIG)
    executor = HangingPipelinedExecutor(inner, hang_at=3)
    errors: list[EngineDead] = []
    try:
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                async with Engine.open(msgspec_replace(CONFIG, shutdown_grace_seconds=0),
                                       executor=executor) as engine:  # type: ignore[arg-type]

                    async def run() -> None:
                        try:
                            await collect(engine, [3, 4, 5], greedy(20))
                        except EngineDead as error:
                            errors.append(error)

                    nursery.start_soon(run)
                    await executor.hung.wait()
                    start = trio.current_time()
            elapsed = trio.current_time() - start
    finally:
        executor.release()
    assert len(errors) == 1
    assert elapsed < HOLD_LIMIT_SECONDS / 2, "the exit waited for the hung step"


async def test_runner_failure_reaches_every_request_and_closes_the_engine() -> None:
    executor = FaultyExecutor(await trio.to_thread.run_sync(ModelExecutor.create, CONFIG), 5)
    errors: list[BaseException] = []
    with trio.fail_after(60), pytest.raises(EngineDead, match="injected device failure"):
        async with Engine.open(CONFIG, executor=executor) as engine:

            async def run(index: int) -> None:
                try:
                    await collect(engine, [index + 3] * 4, greedy(100))
                except EngineDead as error:
                    errors.append(error)

            async with trio.open_nursery() as nursery:
                for index in range(8):
                    nursery.start_soon(run, index)
            assert len(errors) == 8
            assert not engine.is_healthy
            with pytest.raises(EngineDead):
                await collect(engine, [1, 2], greedy(2))


# -- bad input ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "params", "param", "words"),
    [
        ("", {}, "prompt", "empty"),
        ([], {}, "prompt", "empty"),
        ("hello", {"max_tokens": 0}, "max_tokens", ">= 1"),
        ("hello", {"temperature": -1.0}, "temperature", ">= 0"),
        ("hello", {"top_p": 1.5}, "top_p", "<= 1"),
        ([1, 2, 10**9], {}, "prompt", "vocabulary"),
        ("hello", {"stop_token_ids": [-4]}, "stop_token_ids", ""),
        (None, {}, "prompt", "a string or a list of token ids, not NoneType"),
        ("hello", {"min_tokens": 5, "max_tokens": 2}, "min_tokens", "must not exceed"),
        ([1] * 5000, {}, "prompt", "maximum context length"),
        ("hello", {"max_tokens": 10**6}, "max_tokens", "maximum context length"),
    ],
)
async def test_bad_input_is_rejected_clearly(prompt: object, params: dict[str, object],
                                             param: str, words: str) -> None:
    """Refused with the same error whether SamplingParams refuses it as it is built
    (one definition of valid parameters) or the engine does."""
    with trio.fail_after(60):
        async with Engine.open(CONFIG) as engine:
            with pytest.raises(RequestRejected) as caught:
                await collect(engine, prompt, SamplingParams(**params))  # type: ignore
            assert caught.value.param == param
            assert words in str(caught.value)
            assert await collect(engine, "hello", greedy(3)), "the engine still serves"
