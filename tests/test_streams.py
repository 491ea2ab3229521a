"""Request streams coalesce deltas and never block the publisher."""

import pytest
import trio
from trio.testing import wait_all_tasks_blocked

from trio_llm.actors.errors import EngineDead
from trio_llm.actors.messages import RequestOutput
from trio_llm.actors.streams import RequestStreams


def delta(token_id: int, text: str, *, finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id="r", token_ids=[token_id], text=text, finished=finished,
                         finish_reason="length" if finished else None,
                         num_output_tokens=token_id)


async def test_unread_deltas_are_merged_into_one() -> None:
    streams = RequestStreams()
    stream = streams.open("r")
    for index, text in enumerate(["a", "b", "c"], start=1):
        streams.publish(delta(index, text, finished=index == 3))
    output = await stream.receive()
    assert (output.token_ids, output.text, output.finished) == ([1, 2, 3], "abc", True)
    assert output.num_output_tokens == 3


async def test_receive_waits_for_publish() -> None:
    streams = RequestStreams()
    stream = streams.open("r")
    received = []

    async def reader() -> None:
        received.append(await stream.receive())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        await wait_all_tasks_blocked()
        assert received == []
        streams.publish(delta(1, "x"))
    assert received[0].text == "x"


async def test_failure_is_raised_after_pending_output() -> None:
    streams = RequestStreams()
    stream = streams.open("r")
    streams.publish(delta(1, "x"))
    streams.fail_all(EngineDead("gone"))
    assert (await stream.receive()).text == "x"
    with pytest.raises(EngineDead):
        await stream.receive()


async def test_closed_stream_drops_output_and_ids_are_unique() -> None:
    streams = RequestStreams()
    streams.open("r")
    with pytest.raises(ValueError, match="already in use"):
        streams.open("r")
    streams.close("r")
    streams.publish(delta(1, "x"))  # nobody listens: dropped, no error
    assert len(streams) == 0


async def test_wait_empty_returns_when_the_last_stream_closes() -> None:
    streams = RequestStreams()
    streams.open("a")
    streams.open("b")
    done = trio.Event()

    async def waiter() -> None:
        await streams.wait_empty()
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await wait_all_tasks_blocked()
        streams.close("a")
        await wait_all_tasks_blocked()
        assert not done.is_set()
        streams.close("b")
    assert done.is_set()


async def test_publish_all_routes_each_output_to_its_stream() -> None:
    streams = RequestStreams()
    first, second = streams.open("a"), streams.open("b")
    streams.open("gone")
    streams.close("gone")
    streams.publish_all([RequestOutput(request_id=request_id, token_ids=[index], text=request_id)
                         for index, request_id in enumerate(["a", "gone", "b", "a"])])
    assert ((await first.receive()).token_ids, (await second.receive()).token_ids) == ([0, 3], [2])
