"""The wire format's measurement: msgpack against JSON on the messages that cross
between the engine core and its API servers, per message, encode and decode.

    python benchmarks/wire_codec.py [--batch 256] [--repeat 2000]

The messages are the served layout's per-step and per-request traffic: one
TokenBatch per step (one delta per running request), a Track and an Admit per
request (a prompt of 128 token ids). Prints microseconds per message and frame
bytes for each format, as JSON.
"""

from __future__ import annotations

import argparse
import json
import time

from trio_llm.actors.fronts import CoreToFront, FrontToCore
from trio_llm.actors.messages import (
    Admit,
    Request,
    SamplingOptions,
    SamplingParams,
    TokenBatch,
    TokenDelta,
    Track,
)
from trio_llm.actors.wire import WireDecoder, WireEncoder


def request(index: int) -> Request:
    sampling = SamplingOptions(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=index,
                               num_logprobs=None, min_tokens=0, banned_token_ids=[])
    return Request(request_id=f"cmpl-{index:032x}", prompt_token_ids=list(range(1000, 1128)),
                   params=SamplingParams(max_tokens=128, ignore_eos=True), sampling=sampling,
                   stop_token_ids=[151645], max_tokens=128, priority=0, arrival_index=index,
                   arrival_time=1234.5)


def token_batch(batch_size: int) -> TokenBatch:
    return TokenBatch(deltas=[TokenDelta(request_id=f"cmpl-{index:032x}", token_ids=[4242],
                                         logprobs=None, finish_reason=None)
                              for index in range(batch_size)])


def time_per_call(function: object, argument: object, repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        function(argument)  # type: ignore[operator]
    return (time.perf_counter() - start) / repeat * 1e6


def measure(wire_format: str, batch_size: int, repeat: int) -> dict[str, dict[str, float]]:
    encoder = WireEncoder(wire_format)  # type: ignore[arg-type]
    cases = {"token_batch": (token_batch(batch_size), CoreToFront),
             "track": (Track(request=request(1)), CoreToFront),
             "admit": (Admit(request=request(2)), FrontToCore)}
    figures = {}
    for name, (message, union) in cases.items():
        frame = encoder.frame(message)
        decoder = WireDecoder(union, wire_format)  # type: ignore[arg-type]
        assert decoder.feed(frame) == [message]
        figures[name] = {
            "encode_us": time_per_call(encoder.frame, message, repeat),
            "decode_us": time_per_call(decoder.feed, frame, repeat),
            "frame_bytes": len(frame),
        }
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=256, help="requests in one TokenBatch")
    parser.add_argument("--repeat", type=int, default=2000)
    args = parser.parse_args()
    print(json.dumps({fmt: measure(fmt, args.batch, args.repeat)
                      for fmt in ("msgpack", "json")}, indent=2))


if __name__ == "__main__":
    main()
