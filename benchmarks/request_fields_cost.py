"""What the request-field check (api/request_fields.py) adds to decoding a body.

    python benchmarks/request_fields_cost.py

The server decodes each body into its request Struct, then decodes its top
level again into raw fields to find the fields it refuses or ignores. Prints,
for a small chat body and for an 8 MB body of prompt token ids, the time of the
Struct decode and of the check (median of several runs).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial

import msgspec

from trio_llm.api import protocol, request_fields


def median_seconds(function: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    chat = msgspec.json.encode({
        "model": "tiny", "messages": [{"role": "user", "content": "Hello there " * 20}],
        "max_tokens": 64, "temperature": 0.7, "stream": True,
        "stream_options": {"include_usage": True}})
    prompt = [index % 1_000_000 for index in range(1_100_000)]
    ids = msgspec.json.encode({"model": "tiny", "prompt": prompt, "max_tokens": 16})
    cases = [("chat body", chat, protocol.ChatCompletionRequest,
              request_fields.REFUSED_CHAT_FIELDS, 2000),
             ("token-id body", ids, protocol.CompletionRequest,
              request_fields.REFUSED_COMPLETION_FIELDS, 20)]
    for name, body, kind, refused, repeats in cases:
        decode = median_seconds(partial(protocol.decode_request, body, kind), repeats)
        check = median_seconds(partial(request_fields.check_fields, body, kind, refused),
                               repeats)
        print(f"{name}: {len(body):,} bytes, decode {decode * 1e6:.1f} us, "
              f"field check {check * 1e6:.1f} us ({100 * check / decode:.0f}% of the decode)")


if __name__ == "__main__":
    main()
