"""The served layout in one process (api/processes.py, ``open_served_layout``): an
engine core and fronts joined by wire channels over real socket pairs. What holds
in-process holds across the boundary: exact outputs, a global priority queue,
aborts and stop strings freeing blocks, failures reaching every request."""

from __future__ import annotations

import gc
from contextlib import aclosing
from functools import partial

import pytest
import trio
from test_executor_support import FaultyExecutor, InstantPipelinedExecutor

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.errors import EngineDead, RequestRejected
from trio_llm.actors.messages import SamplingParams
from trio_llm.api.engine import Engine
from trio_llm.api.processes import open_served_layout, run_engine_core
from trio_llm.gpu.executor import ModelExecutor

CONFIG = EngineConfig(model="tiny", num_kv_blocks=128, block_size=16, max_num_seqs=16,
                      max_num_batched_tokens=512)
TIMEOUT = 120


def greedy(max_tokens: int, **fields: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                          **fields)  # type: ignore[arg-type]


async def collect(engine: Engine, prompt: list[int] | str, params: SamplingParams,
                  **kwargs: object) -> list[int]:
    return [token_id async for output in engine.generate(prompt, params, **kwargs)  # type: ignore[arg-type]
            for token_id in output.token_ids]


async def wait_statistics(engine: Engine, predicate: object) -> None:
    """Ask the core until its counters satisfy ``predicate`` (each ask is a round
    trip over the wire: no sleeping). Bounded by the caller's fail_after, not by a
    count of asks: on a loaded machine the engine may take many asks' time a step."""
    while not predicate(await engine.fetch_statistics()):  # type: ignore[operator]
        pass


def is_idle(stats: object) -> bool:
    return (stats.num_running == 0 and stats.num_waiting == 0  # type: ignore[attr-defined]
            and stats.num_free_blocks == stats.num_total_blocks)  # type: ignore[attr-defined]


PROMPTS = [[3 + index, 40, 41, 42 + index] * (1 + index % 3) for index in range(12)]
SAMPLINGS = [greedy(10), SamplingParams(max_tokens=10, temperature=1.0, seed=5, ignore_eos=True),
             SamplingParams(max_tokens=10, temperature=0.9, top_k=20, seed=9, ignore_eos=True)]


async def test_outputs_over_two_fronts_equal_the_in_process_ones() -> None:
    requests = [(prompt, SAMPLINGS[index % 3]) for index, prompt in enumerate(PROMPTS)]
    with trio.fail_after(TIMEOUT):
        async with Engine.open(CONFIG) as engine:
            expected = [await collect(engine, prompt, params) for prompt, params in requests]
        results: dict[int, list[int]] = {}
        async with open_served_layout(CONFIG, 2) as fronts:
            async with trio.open_nursery() as nursery:
                for index, (prompt, params) in enumerate(requests):
                    async def run(index: int = index, prompt: list[int] = prompt,
                                  params: SamplingParams = params) -> None:
                        results[index] = await collect(fronts[index % 2], prompt, params)
                    nursery.start_soon(run)
            stats = await fronts[0].fetch_statistics()
    assert [results[index] for index in range(len(requests))] == expected
    assert is_idle(stats) and stats.num_generation_tokens == 10 * len(requests)


async def test_the_priority_queue_is_global_across_fronts() -> None:
    config = EngineConfig(model="tiny", max_num_seqs=2, scheduling_policy="priority",
                          num_kv_blocks=64)
    order: list[str] = []
    with trio.fail_after(TIMEOUT):
        async with open_served_layout(config, 2) as (low_front, high_front):
            first_tokens = {name: trio.Event() for name in "ABCDH"}

            async def run(engine: Engine, name: str, priority: int, max_tokens: int) -> None:
                async for _ in engine.generate([10, 11, 12, ord(name)], greedy(max_tokens),
                                               priority=priority, request_id=name):
                    if not first_tokens[name].is_set():
                        first_tokens[name].set()
                        order.append(name)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, low_front, "A", 5, 60)
                nursery.start_soon(run, low_front, "B", 5, 60)
                await first_tokens["A"].wait()
                await first_tokens["B"].wait()
                for num_waiting, name in enumerate("CD", start=1):
                    nursery.start_soon(run, low_front, name, 5, 5)
                    await wait_statistics(low_front,
                                          lambda stats, n=num_waiting: stats.num_waiting == n)
                nursery.start_soon(run, high_front, "H", 0, 5)
    assert order.index("H") < order.index("C") < order.index("D")


async def test_aborts_and_stop_strings_free_blocks_across_the_boundary() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_served_layout(CONFIG, 2) as fronts:
            reference = await collect(fronts[1], [5, 6, 7, 8], greedy(30))
            text = "".join([out.text async for out in fronts[1].generate([5, 6, 7, 8],
                                                                          greedy(30))])
            stop = text[len(text) // 2:len(text) // 2 + 3]
            async with trio.open_nursery() as nursery:
                for index in range(6):
                    async def leave_early(index: int = index) -> None:
                        async with aclosing(fronts[index % 2].generate(
                                [9, index + 3] * 5, greedy(200))) as stream:
                            async for _ in stream:
                                break

                    async def cancelled(index: int = index) -> None:
                        with trio.CancelScope() as scope:
                            async for _ in fronts[0].generate([4, index], greedy(200)):
                                scope.cancel()
                    nursery.start_soon(leave_early)
                    nursery.start_soon(cancelled)
            stopped = [out async for out in fronts[0].generate([5, 6, 7, 8],
                                                               greedy(30, stop=[stop]))]
            await wait_statistics(fronts[0], is_idle)
            again = await collect(fronts[0], [5, 6, 7, 8], greedy(30))
    assert stopped[-1].finish_reason == "stop" and stopped[-1].stop_reason == stop
    assert stop not in "".join(out.text for out in stopped)
    assert again == reference


async def test_a_front_that_dies_has_its_requests_aborted_and_the_other_goes_on() -> None:
    pairs = [trio.socket.socketpair() for _ in range(2)]
    errors: list[EngineDead] = []
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(partial(run_engine_core, CONFIG,
                                        [trio.SocketStream(core) for core, _ in pairs]))
            doomed_end = pairs[0][1]
            with pytest.raises(EngineDead, match="went away"):
                async with Engine.open_front(CONFIG, trio.SocketStream(doomed_end)) as doomed, \
                        Engine.open_front(CONFIG, trio.SocketStream(pairs[1][1])) as survivor:
                    expected = await collect(survivor, [7, 8, 9], greedy(40))
                    results = []
                    async with trio.open_nursery() as requests:
                        for index in range(3):
                            async def run(index: int = index) -> None:
                                try:
                                    await collect(doomed, [3, index], greedy(200))
                                except EngineDead as error:
                                    errors.append(error)
                            requests.start_soon(run)
                        await wait_statistics(survivor, lambda stats: stats.num_running == 3)

                        async def survive() -> None:
                            results.append(await collect(survivor, [7, 8, 9], greedy(40)))
                        requests.start_soon(survive)
                        # The doomed front's process dies: its socket ends both ways.
                        doomed_end.shutdown(trio.socket.SHUT_RDWR)
                    await wait_statistics(survivor, is_idle)
                    assert results == [expected]
                    assert survivor.is_healthy and not doomed.is_healthy
    assert len(errors) == 3


def leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in leaves(inner)]
    return [error]


async def test_requests_one_after_another_through_a_pipelined_core_all_finish() -> None:
    """The workload that stalled the served layout on the GPU (a single stream after
    a batch of requests): each request ends while the scheduler asks the queue for
    more, and it must go on asking, waiting, for the next one."""
    inner = await trio.to_thread.run_sync(ModelExecutor.create, CONFIG)
    with trio.fail_after(TIMEOUT):
        async with Engine.open(CONFIG, executor=inner) as engine:
            expected = [await collect(engine, prompt, greedy(6)) for prompt in PROMPTS[:4]]
        async with open_served_layout(CONFIG, 2,
                                      executor=InstantPipelinedExecutor(inner)) as fronts:  # type: ignore[arg-type]
            async with trio.open_nursery() as nursery:
                for index in range(8):
                    nursery.start_soon(collect, fronts[index % 2], PROMPTS[index], greedy(6))
            outputs = [await collect(fronts[index % 2], prompt, greedy(6))
                       for index, prompt in enumerate(PROMPTS[:4])]
            await wait_statistics(fronts[0], is_idle)
    assert outputs == expected


async def test_a_failure_in_the_core_reaches_every_request_on_every_front() -> None:
    executor = FaultyExecutor(await trio.to_thread.run_sync(ModelExecutor.create, CONFIG), 5)
    errors: list[EngineDead] = []
    health: list[bool] = []
    with trio.fail_after(TIMEOUT):
        try:
            async with open_served_layout(CONFIG, 2, executor=executor) as fronts:  # type: ignore[arg-type]
                async with trio.open_nursery() as nursery:
                    for index in range(6):
                        async def run(index: int = index) -> None:
                            try:
                                await collect(fronts[index % 2], [index + 3] * 4, greedy(100))
                            except EngineDead as error:
                                errors.append(error)
                        nursery.start_soon(run)
                health = [front.is_healthy for front in fronts]
        except* EngineDead as group:
            failures = leaves(group)
    assert len(errors) == 6
    assert all("injected device failure" in str(error) for error in errors)
    assert health == [False, False]
    assert failures and all("injected device failure" in str(error) for error in failures)


async def test_a_request_id_in_use_on_another_front_is_rejected() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_served_layout(CONFIG, 2) as fronts:
            first_stream = fronts[0].generate([3, 4], greedy(100), request_id="same")
            async with aclosing(first_stream) as first:
                await anext(first)
                with pytest.raises(RequestRejected, match="already in use") as rejected:
                    await collect(fronts[1], [3, 4], greedy(2), request_id="same")
            await wait_statistics(fronts[1], is_idle)
    assert rejected.value.param == "request_id"


async def test_constrained_outputs_over_fronts_equal_the_in_process_ones() -> None:
    from trio_llm.actors.messages import StructuredOutputsParams

    regex = StructuredOutputsParams(regex="[a-z]{3,8}-[0-9]{2}")
    choice = StructuredOutputsParams(choice=["alpha", "beta", "gamma"])
    requests = [(prompt, SamplingParams(max_tokens=24, temperature=1.0, seed=index,
                                        structured_outputs=(regex, choice)[index % 2]))
                for index, prompt in enumerate(PROMPTS[:6])]
    with trio.fail_after(TIMEOUT):
        async with Engine.open(CONFIG) as engine:
            expected = [await collect(engine, prompt, params) for prompt, params in requests]
        async with open_served_layout(CONFIG, 2) as fronts:
            served = [await collect(fronts[index % 2], prompt, params)
                      for index, (prompt, params) in enumerate(requests)]
    assert served == expected
    assert all(expected), "every constrained request produced output"


async def test_a_front_with_no_requests_receives_no_frames() -> None:
    """The core writes to a front only about the front's own requests: each step's
    tokens, tracks, aborts and statistics go to their owner alone, so an idle API
    server is never woken (one stream through four API servers costs what it costs
    through one)."""
    import socket

    from trio_llm.actors.fronts import CoreReady, CoreToFront
    from trio_llm.actors.wire import WireDecoder

    busy_core_end, busy_front_end = trio.socket.socketpair()
    idle_core_end, idle_front_end = socket.socketpair()
    core_streams = [trio.SocketStream(busy_core_end),
                    trio.SocketStream(trio.socket.from_stdlib_socket(idle_core_end))]
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(partial(run_engine_core, CONFIG, core_streams))
            async with Engine.open_front(CONFIG, trio.SocketStream(busy_front_end)) as front:
                async with trio.open_nursery() as requests:
                    for prompt in PROMPTS[:4]:
                        requests.start_soon(collect, front, prompt, greedy(8))
                async with aclosing(front.generate(PROMPTS[5], greedy(100))) as aborted:
                    await anext(aborted)  # leaving it early aborts it
                await collect(front, PROMPTS[6], greedy(20, stop=["a"]))
                await wait_statistics(front, is_idle)
                # the core and this front share one event loop: anything the core
                # wrote to the idle front is in its socket's buffer by now
                await trio.testing.wait_all_tasks_blocked()
                received = idle_front_end.recv(1 << 20, socket.MSG_DONTWAIT)
                idle_front_end.close()  # the idle front goes; the core serves on
                assert await collect(front, PROMPTS[0], greedy(3))
    assert [type(message) for message in WireDecoder(CoreToFront).feed(received)] == [CoreReady]


async def test_the_core_unfreezes_what_it_froze_once_it_stops() -> None:
    # The core freezes the heap it starts with (gc.freeze, as Engine.open does). As
    # a task of a longer process that heap must be collectable again once it stops,
    # and in its own process frozen objects outlive the interpreter's last collection
    # (an extension may then report them as leaked at exit). A core whose one front
    # has gone stops at once.
    core_end, front_end = trio.socket.socketpair()
    front_end.close()
    gc.collect()
    frozen_before = gc.get_freeze_count()
    with trio.fail_after(TIMEOUT):
        await run_engine_core(CONFIG, [trio.SocketStream(core_end)])
    assert gc.get_freeze_count() == frozen_before
