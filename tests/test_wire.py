"""Wire channels (actors/wire.py) and the core's routing policy (actors/fronts.py)."""

from __future__ import annotations

import pytest
import trio

from trio_llm.actors.errors import EngineDead, QueueFull, RequestRejected
from trio_llm.actors.fronts import (
    CoreToFront,
    FrontRoutes,
    FrontToCore,
    StatisticsReply,
    StreamOutput,
    engine_error,
    front_seed,
    stream_failure,
)
from trio_llm.actors.messages import (
    Abort,
    Admit,
    Request,
    RequestOutput,
    SamplingOptions,
    SamplingParams,
    StopStringHit,
    TokenBatch,
    TokenDelta,
    TokenLogprobs,
    Track,
)
from trio_llm.actors.scheduler import SchedulerStatistics
from trio_llm.actors.wire import (
    MAX_FRAME_BYTES,
    WireDecoder,
    WireEncoder,
    WireError,
    WireFormat,
    open_wire_channel,
)

FORMATS: list[WireFormat] = ["msgpack", "json"]


def request(request_id: str, arrival_index: int = 0) -> Request:
    sampling = SamplingOptions(temperature=0.7, top_p=0.9, top_k=5, min_p=0.0, seed=-3,
                               num_logprobs=2, min_tokens=1, banned_token_ids=[0])
    return Request(request_id=request_id, prompt_token_ids=[1, 2, 3],
                   params=SamplingParams(max_tokens=4, stop=["\n"]), sampling=sampling,
                   stop_token_ids=[0], max_tokens=4, priority=2, arrival_index=arrival_index,
                   arrival_time=12.5)


def delta(request_id: str, finish_reason: str | None = None) -> TokenDelta:
    return TokenDelta(request_id=request_id, token_ids=[7], finish_reason=finish_reason,  # type: ignore[arg-type]
                      logprobs=[TokenLogprobs(logprob=-0.5, top_token_ids=[7, 8],
                                              top_logprobs=[-0.5, -1.5])])


CORE_MESSAGES: list[CoreToFront] = [
    Track(request=request("a")),
    TokenBatch(deltas=[delta("a"), delta("b", "stop")]),
    StreamOutput(output=RequestOutput(request_id="a", token_ids=[], text="é", finished=True,
                                      finish_reason="abort")),
    stream_failure("q", QueueFull("full")),
    StatisticsReply(query_id=3, num_waiting=1, scheduler=SchedulerStatistics(
        num_running=1, num_free_blocks=2, num_total_blocks=3, num_preemptions=0, num_steps=9,
        num_prompt_tokens=4, num_generation_tokens=5)),
]


@pytest.mark.parametrize("wire_format", FORMATS)
def test_frames_decode_to_the_messages_sent_whatever_the_chunking(wire_format: WireFormat) -> None:
    encoder = WireEncoder(wire_format)
    data = b"".join(encoder.frame(message) for message in CORE_MESSAGES)
    for chunk_size in (1, 3, 7, len(data)):
        decoder = WireDecoder(CoreToFront, wire_format)
        received = []
        for start in range(0, len(data), chunk_size):
            received += decoder.feed(data[start:start + chunk_size])
        assert received == CORE_MESSAGES
        assert not decoder.has_partial_frame


def test_a_message_of_the_wrong_kind_or_a_corrupt_length_is_a_wire_error() -> None:
    encoder = WireEncoder()
    with pytest.raises(WireError, match="undecodable"):
        WireDecoder(FrontToCore).feed(encoder.frame(Track(request=request("a"))))
    with pytest.raises(WireError, match="not a frame"):
        WireDecoder(FrontToCore).feed((MAX_FRAME_BYTES + 1).to_bytes(4, "big") + b"x")


async def test_wire_channels_carry_messages_in_order_and_end_with_the_peer() -> None:
    left, right = trio.socket.socketpair()
    core_send, core_receive = open_wire_channel(trio.SocketStream(left), FrontToCore)
    front_send, front_receive = open_wire_channel(trio.SocketStream(right), CoreToFront)
    sent: list[FrontToCore] = [Admit(request=request(f"r{index}", index)) for index in range(50)]
    sent += [Abort(request_id="r3"), StopStringHit(request_id="r4")]
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            async def send_all() -> None:
                async with front_send:
                    for message in sent:
                        await front_send.send(message)
            nursery.start_soon(send_all)
            received = [message async for message in core_receive]
        for message in CORE_MESSAGES:
            await core_send.send(message)
        replies = [await front_receive.receive() for _ in CORE_MESSAGES]
        await core_receive.aclose()  # the core's process is gone: its socket closes
        with pytest.raises(trio.EndOfChannel):
            await front_receive.receive()
        with pytest.raises(trio.ClosedResourceError):
            await front_send.send(Abort(request_id="late"))
    assert received == sent
    assert replies == CORE_MESSAGES


async def test_a_peer_gone_mid_frame_is_a_wire_error() -> None:
    left, right = trio.socket.socketpair()
    receive = open_wire_channel(trio.SocketStream(left), FrontToCore)[1]
    frame = WireEncoder().frame(Abort(request_id="x"))
    with trio.fail_after(10):
        await right.send(frame[:-1])
        right.close()
        with pytest.raises(WireError, match="middle of a frame"):
            await receive.receive()


@pytest.mark.parametrize("error", [
    QueueFull("the queue is full"), RequestRejected("bad id", param="request_id"),
    EngineDead("dead")])
def test_errors_cross_the_wire_as_what_they_were(error: Exception) -> None:
    failure = stream_failure("r", error)  # type: ignore[arg-type]
    decoded = WireDecoder(CoreToFront).feed(WireEncoder().frame(failure))[0]
    rebuilt = engine_error(decoded)  # type: ignore[arg-type]
    assert type(rebuilt) is type(error)
    assert str(rebuilt) == str(error)
    assert getattr(rebuilt, "param", None) == getattr(error, "param", None)


# -- the core's routing policy -----------------------------------------------------------


def test_arrivals_are_restamped_in_the_order_the_core_sees_them() -> None:
    routes = FrontRoutes(2)
    first = routes.admit(1, Admit(request=request("b", 0)))
    second = routes.admit(0, Admit(request=request("a", 0)))
    third = routes.admit(1, Admit(request=request("c", 1)))
    assert first is not None and second is not None and third is not None
    assert [first.request.arrival_index, second.request.arrival_index,
            third.request.arrival_index] == [0, 1, 2]
    assert second.request.request_id == "a" and second.request.priority == 2
    assert routes.admit(0, Admit(request=request("b", 5))) is None  # b is front 1's


def test_a_batch_is_split_by_owner_and_finished_requests_are_forgotten() -> None:
    routes = FrontRoutes(2)
    for front_index, request_id in [(0, "a"), (1, "b"), (0, "c")]:
        routes.admit(front_index, Admit(request=request(request_id)))
    batch = TokenBatch(deltas=[delta("a"), delta("b", "length"), delta("c"), delta("gone")])
    split = dict(routes.split(batch))
    assert [d.request_id for d in split[0].deltas] == ["a", "c"]
    assert [d.request_id for d in split[1].deltas] == ["b"]
    assert routes.owner("b") is None and routes.owner("a") == 0
    finished = RequestOutput(request_id="c", token_ids=[], text="", finished=True)
    assert routes.end_output(finished) == 0 and routes.owner("c") is None
    assert routes.end_failure("a") == 0 and routes.num_owned == 0


def test_a_front_gone_has_its_requests_aborted_and_the_others_kept() -> None:
    routes = FrontRoutes(3)
    for front_index, request_id in [(0, "a"), (1, "b"), (1, "c"), (2, "d")]:
        routes.admit(front_index, Admit(request=request(request_id)))
    aborts = routes.front_gone(1)
    assert aborts == [Abort(request_id="b"), Abort(request_id="c")]
    assert not routes.is_live(1) and routes.num_live_fronts == 2
    assert routes.owner("a") == 0 and routes.owner("d") == 2


def test_fronts_draw_seeds_apart_and_the_first_as_in_process() -> None:
    seeds = {front_seed(0, index) for index in range(8)}
    assert front_seed(0, 0) == 0 and front_seed(5, 0) == 5
    assert len(seeds) == 8
