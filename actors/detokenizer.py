"""The detokenizer actor: token ids in, text deltas out, stop strings found.

Decoding is incremental and never emits half a character: with a byte-level
BPE tokenizer every token is a fixed byte string and an incremental UTF-8
decoder holds back an incomplete character until its last byte arrives; with
any other tokenizer (sentencepiece-style "▁" pieces, byte fallback) each step
decodes a short window of previous tokens (the prompt's tail first) and emits
what the new token adds, unless it ends in U+FFFD.

Stop strings are held back: text that could still become a stop string is not
streamed until the following text shows it is not one.

A failure while decoding one request (its decoder, its stop strings) ends
that request alone with RequestFailed; the engine and every other request go
on.
"""

from __future__ import annotations

import codecs
import logging
from bisect import bisect_left
from typing import Protocol

import tokenizers
import trio
from tokenizers import decoders

from trio_llm.actors.errors import RequestFailed
from trio_llm.actors.messages import (
    DetokenizerInbox,
    Request,
    RequestOutput,
    SchedulerInbox,
    StopStringHit,
    TokenBatch,
    TokenDelta,
    Track,
)
from trio_llm.actors.streams import RequestStreams
from trio_llm.actors.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Requests that failed in the detokenizer are remembered (most recent first
# out) so that one tracked again after a preemption is freed, not decoded.
MAX_REMEMBERED_FAILURES = 4096

# Prompt tokens decoded ahead of the output by the window decoder, so the
# first output token gets the spacing it has in context.
NUM_PROMPT_CONTEXT_TOKENS = 5
MAX_BYTES_PER_CHARACTER = 4

REPLACEMENT_CHARACTER = "\ufffd"


# -- decoding token ids to text, one token at a time --------------------------


class _TextDecoder(Protocol):
    def step(self, token_id: int) -> str:
        """The text this token completes; "" while a character is incomplete."""
        ...

    def flush(self) -> str:
        """Whatever is still held back, incomplete characters as U+FFFD."""
        ...


class _ByteTable:
    """Every token's bytes under byte-level BPE, and its text where those bytes
    are whole UTF-8 characters on their own (most tokens): a fast path."""

    __slots__ = ("token_bytes", "token_texts")

    def __init__(self, token_bytes: list[bytes]) -> None:
        self.token_bytes = token_bytes
        self.token_texts = [_whole_text(data) for data in token_bytes]


def _whole_text(data: bytes) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


class _ByteLevelDecoder:
    """Byte-level BPE: a token's text is its bytes, so decoding is a byte stream
    through an incremental UTF-8 decoder that holds back the bytes of an
    incomplete character. Equals the tokenizer's batch decode."""

    __slots__ = ("_table", "_held_bytes")

    def __init__(self, table: _ByteTable) -> None:
        self._table = table
        self._held_bytes = b""

    def step(self, token_id: int) -> str:
        if token_id >= len(self._table.token_bytes):
            return ""  # an id the tokenizer does not know decodes to nothing
        if not self._held_bytes:
            text = self._table.token_texts[token_id]
            if text is not None:
                return text
        data = self._held_bytes + self._table.token_bytes[token_id]
        text, num_consumed = codecs.utf_8_decode(data, "replace", False)
        self._held_bytes = data[num_consumed:]
        return text

    def flush(self) -> str:
        text, _ = codecs.utf_8_decode(self._held_bytes, "replace", True)
        self._held_bytes = b""
        return text


class _WindowDecoder:
    """Any tokenizer: decode a window of recent tokens and emit what the newest
    ones add to the text of the window without them. The window is the tokens
    emitted last time plus those held since; it restarts after every emission."""

    __slots__ = ("_backend", "_skip_special_tokens", "_token_ids", "_num_read", "_read_text")

    def __init__(self, backend: tokenizers.Tokenizer, prompt_token_ids: list[int], *,
                 skipped_token_ids: frozenset[int]) -> None:
        self._backend = backend
        self._skip_special_tokens = bool(skipped_token_ids)
        self._token_ids = self._prompt_context(prompt_token_ids, skipped_token_ids)
        self._read_text = self._decode(self._token_ids)
        while self._read_text.endswith(REPLACEMENT_CHARACTER):
            # The prompt ends inside a character, which cannot anchor the
            # output: anchor on the complete text before it.
            self._token_ids.pop()
            self._read_text = self._decode(self._token_ids)
        self._num_read = len(self._token_ids)

    def _prompt_context(self, prompt_token_ids: list[int],
                        skipped_token_ids: frozenset[int]) -> list[int]:
        """The prompt's last few tokens that decode to text, starting on a
        character boundary: a window that begins inside a byte-fallback
        character decodes to U+FFFD and spoils the bytes that follow it."""
        num_wanted = NUM_PROMPT_CONTEXT_TOKENS + MAX_BYTES_PER_CHARACTER - 1
        candidates: list[int] = []
        for token_id in reversed(prompt_token_ids):
            if token_id not in skipped_token_ids:
                candidates.append(token_id)
                if len(candidates) == num_wanted:
                    break
        candidates.reverse()
        start = max(0, len(candidates) - NUM_PROMPT_CONTEXT_TOKENS)
        while start > 0 and self._decode(candidates[start:]).startswith(REPLACEMENT_CHARACTER):
            start -= 1
        return candidates[start:]

    def step(self, token_id: int) -> str:
        self._token_ids.append(token_id)
        text = self._decode(self._token_ids)
        if len(text) <= len(self._read_text) or text.endswith(REPLACEMENT_CHARACTER):
            return ""
        new_text = text[len(self._read_text):]
        self._token_ids = self._token_ids[self._num_read:]
        self._num_read = len(self._token_ids)
        self._read_text = self._decode(self._token_ids)
        return new_text

    def flush(self) -> str:
        if len(self._token_ids) == self._num_read:
            return ""
        text = self._decode(self._token_ids)
        self._token_ids = self._token_ids[self._num_read:]
        return text[len(self._read_text):]

    def _decode(self, token_ids: list[int]) -> str:
        return self._backend.decode(token_ids, skip_special_tokens=self._skip_special_tokens)


def _byte_level_alphabet() -> dict[str, int]:
    """The printable character byte-level BPE writes for each byte value."""
    byte_values = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                   *range(ord("®"), ord("ÿ") + 1)]
    characters = list(byte_values)
    num_remapped = 0
    for byte_value in range(256):
        if byte_value not in byte_values:
            byte_values.append(byte_value)
            characters.append(256 + num_remapped)
            num_remapped += 1
    return {chr(character): byte_value for byte_value, character in zip(byte_values, characters,
                                                                        strict=True)}


def _byte_tables(backend: tokenizers.Tokenizer, vocab_size: int) -> tuple[_ByteTable, _ByteTable]:
    """Each token's bytes, as the byte-level decoder writes them: a token whose
    characters are all in the byte alphabet maps through it; any other (an
    added token such as "<|im_end|>" with a space in it) is its own UTF-8.
    Returns the table with special tokens, and the one with them as b""."""
    alphabet = _byte_level_alphabet()
    alphabet_characters = frozenset(alphabet)
    translation = {ord(character): byte_value for character, byte_value in alphabet.items()}
    with_special = [b""] * vocab_size
    for token, token_id in backend.get_vocab(with_added_tokens=True).items():
        if alphabet_characters.issuperset(token):
            with_special[token_id] = token.translate(translation).encode("latin-1")
        else:
            with_special[token_id] = token.encode("utf-8")
    without_special = list(with_special)
    for token_id, added in backend.get_added_tokens_decoder().items():
        if added.special:
            without_special[token_id] = b""
    return _ByteTable(with_special), _ByteTable(without_special)


# -- stop strings ---------------------------------------------------------------


class StopStrings:
    """A request's stop strings: where one first appears, and how much text
    at the end could still be the start of one (and must be held back).

    Both look only at a tail window of the text (the longest stop string
    less one character, plus what is new), so a step's cost is bounded by the
    stop strings' count and length, and nothing is built per prefix: a
    request's stop strings cost memory linear in their size (intake bounds
    their count and length).
    """

    __slots__ = ("stops", "_sorted_stops", "_first_characters", "_max_prefix_length")

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self._sorted_stops = sorted(set(stops))
        self._first_characters = frozenset(stop[0] for stop in stops if len(stop) > 1)
        self._max_prefix_length = max(len(stop) for stop in stops) - 1

    def find(self, text: str, num_old_chars: int) -> tuple[int, str] | None:
        """The earliest stop string in ``text`` that ends after its first
        ``num_old_chars`` characters (older text was searched already), as
        (start index, stop string). On a tie the longer stop string wins."""
        best: tuple[int, str] | None = None
        for stop in self.stops:
            start = text.find(stop, max(0, num_old_chars - len(stop) + 1))
            if start == -1:
                continue
            if best is None or start < best[0] or (start == best[0] and len(stop) > len(best[1])):
                best = (start, stop)
        return best

    def num_held_chars(self, text: str) -> int:
        """Length of the longest end of ``text`` that begins some stop string
        (and is shorter than it: a whole stop string was found already)."""
        num_chars = len(text)
        for start in range(max(0, num_chars - self._max_prefix_length), num_chars):
            if text[start] in self._first_characters and self._begins_a_stop(text[start:]):
                return num_chars - start
        return 0

    def _begins_a_stop(self, tail: str) -> bool:
        """Whether ``tail`` is a proper prefix of a stop string. In sorted
        order the strings ``tail`` begins follow it at once, so one binary
        search finds the first of them (after ``tail`` itself, if a stop)."""
        stops = self._sorted_stops
        index = bisect_left(stops, tail)
        if index < len(stops) and stops[index] == tail:
            index += 1
        return index < len(stops) and stops[index].startswith(tail)


# -- per-request state ------------------------------------------------------------


class _DecodingRequest:
    """One running request's decoding state. ``pending_text`` is decoded text
    not streamed yet: held back because it could begin a stop string."""

    __slots__ = ("request_id", "decoder", "stop_strings", "include_stop_str_in_output",
                 "min_tokens", "wants_logprobs", "num_prompt_tokens", "num_output_tokens",
                 "pending_text", "queue_time", "prompt_token_ids")

    def __init__(self, request: Request, decoder: _TextDecoder, queue_time: float) -> None:
        params = request.params
        self.request_id = request.request_id
        self.decoder = decoder
        self.stop_strings = StopStrings(params.stop) if params.stop else None
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.wants_logprobs = params.logprobs is not None
        self.num_prompt_tokens = len(request.prompt_token_ids)
        # goes out with the first output (and the prompt logprobs), then let go
        self.prompt_token_ids: list[int] | None = request.prompt_token_ids
        self.num_output_tokens = 0
        self.pending_text = ""
        self.queue_time: float | None = queue_time

    def advance(self, delta: TokenDelta) -> RequestOutput:
        """Decode one delta of tokens into the output to publish."""
        token_ids = delta.token_ids
        if delta.finish_reason is None and self.stop_strings is None:
            # The common case, every request in every step: nothing to hold back.
            step = self.decoder.step
            text = step(token_ids[0]) if len(token_ids) == 1 else "".join(map(step, token_ids))
            return self._output(delta, token_ids, text)
        # A stop token's text is left out unless asked for; the id is reported.
        skips_stop_token = (delta.finish_reason == "stop" and bool(token_ids)
                            and not self.include_stop_str_in_output)
        num_decoded = len(token_ids) - 1 if skips_stop_token else len(token_ids)
        num_kept, stop = self._decode(token_ids[:num_decoded])
        if stop is not None:
            return self._output(delta, token_ids[:num_kept], self._take_text(finished=True),
                                stop_reason=stop)
        if delta.finish_reason is not None:
            self.pending_text += self.decoder.flush()
        return self._output(delta, token_ids, self._take_text(delta.finish_reason is not None))

    def _decode(self, token_ids: list[int]) -> tuple[int, str | None]:
        """Decode tokens until a stop string appears. Returns how many tokens
        were consumed (up to and including the one completing the stop
        string) and the stop string, if one appeared."""
        for index, token_id in enumerate(token_ids):
            text = self.decoder.step(token_id)
            if text:
                stop = self._append_text(text, num_output_tokens=self.num_output_tokens + index + 1)
                if stop is not None:
                    return index + 1, stop
        return len(token_ids), None

    def _append_text(self, text: str, *, num_output_tokens: int) -> str | None:
        """Add decoded text; on a stop string, cut the text there and return it.
        Stop strings count only once more than min_tokens tokens were produced."""
        num_old_chars = len(self.pending_text)
        self.pending_text += text
        if self.stop_strings is None or num_output_tokens <= self.min_tokens:
            return None
        found = self.stop_strings.find(self.pending_text, num_old_chars)
        if found is None:
            return None
        start, stop = found
        end = start + len(stop) if self.include_stop_str_in_output else start
        self.pending_text = self.pending_text[:end]
        return stop

    def _take_text(self, finished: bool) -> str:
        """The text that can be streamed now; all of it once finished."""
        held = 0
        if not finished and self.stop_strings is not None:
            held = self.stop_strings.num_held_chars(self.pending_text)
        cut = len(self.pending_text) - held
        text, self.pending_text = self.pending_text[:cut], self.pending_text[cut:]
        return text

    def _output(self, delta: TokenDelta, token_ids: list[int], text: str, *,
                stop_reason: str | None = None) -> RequestOutput:
        """The output to publish: finished by a stop string (``stop_reason``)
        or by the delta's own finish reason."""
        self.num_output_tokens += len(token_ids)
        logprobs = None
        if self.wants_logprobs and delta.logprobs is not None:
            logprobs = delta.logprobs[:len(token_ids)]
        queue_time, self.queue_time = self.queue_time, None
        prompt_token_ids, self.prompt_token_ids = self.prompt_token_ids, None
        output = RequestOutput(request_id=self.request_id, token_ids=token_ids, text=text,
                               logprobs=logprobs, stop_reason=delta.stop_reason,
                               num_prompt_tokens=self.num_prompt_tokens,
                               num_output_tokens=self.num_output_tokens, queue_time=queue_time,
                               prompt_token_ids=prompt_token_ids,
                               prompt_logprobs=delta.prompt_logprobs,
                               embedding=delta.embedding)
        # Most outputs do not finish: the constructor leaves the finish fields unset.
        if stop_reason is not None:
            output.finished, output.finish_reason, output.stop_reason = True, "stop", stop_reason
        elif delta.finish_reason is not None:
            output.finished, output.finish_reason = True, delta.finish_reason
        return output


# -- the policy ---------------------------------------------------------------------


class Detokenizer:
    """Incremental decoding and stop strings for every running request.

    Finishing follows vLLM: a stop token (EOS or stop_token_ids, finish_reason
    "stop" from the scheduler) is in ``token_ids`` but its text is not in
    ``text`` unless include_stop_str_in_output. A stop string cuts the text
    before it (or after it with include_stop_str_in_output); ``token_ids``
    ends with the token that completed the stop string: it was generated, so
    it is reported, but tokens decoded after it in the same delta are not
    (their text lies beyond the stop). Stop strings count only once more than
    min_tokens tokens were produced; one may begin in earlier text.

    A request's state is dropped when it finishes; tokens that arrive for it
    later (computed while the stop string was found, depth-2 pipelining) are
    dropped too, as are deltas for a request never tracked.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._backend = tokenizer.backend
        self._special_token_ids = frozenset(
            token_id for token_id, added in self._backend.get_added_tokens_decoder().items()
            if added.special)
        self._byte_tables: tuple[_ByteTable, _ByteTable] | None = None
        if isinstance(self._backend.decoder, decoders.ByteLevel):
            self._byte_tables = _byte_tables(self._backend, tokenizer.vocab_size)
        self._requests: dict[str, _DecodingRequest] = {}
        self._failed_request_ids: dict[str, None] = {}
        self._new_failures: list[tuple[str, RequestFailed]] = []

    @property
    def num_tracked(self) -> int:
        """Requests being decoded now."""
        return len(self._requests)

    def track(self, request: Request, now: float) -> None:
        """Start decoding a request; ``now`` on the clock of ``request.arrival_time``.

        Tracking a request already tracked (it is recomputed after a preemption)
        keeps its state: its output so far was streamed already.
        """
        request_id = request.request_id
        if request_id in self._requests:
            return
        if request_id in self._failed_request_ids:
            # It failed, was preempted before the scheduler freed it, and runs again.
            failure = RequestFailed("decoding the output failed earlier", stage="detokenizer")
            self._new_failures.append((request_id, failure))
            return
        try:
            decoder = self._new_decoder(request)
            queue_time = max(0.0, now - request.arrival_time)
            self._requests[request_id] = _DecodingRequest(request, decoder, queue_time)
        except Exception as error:
            self._fail(request_id, "track", error)

    def take_failures(self) -> list[tuple[str, RequestFailed]]:
        """Requests that failed here since the last call, with their errors:
        each must have its stream failed and be freed by the scheduler."""
        failures, self._new_failures = self._new_failures, []
        return failures

    def _fail(self, request_id: str, stage: str, error: Exception) -> None:
        logger.error("decoding request %s failed (%s); it alone ends", request_id, stage,
                     exc_info=error)
        self._requests.pop(request_id, None)
        self._failed_request_ids[request_id] = None
        if len(self._failed_request_ids) > MAX_REMEMBERED_FAILURES:
            del self._failed_request_ids[next(iter(self._failed_request_ids))]
        failure = RequestFailed(f"decoding the output failed: {type(error).__name__}: {error}",
                                stage="detokenizer")
        failure.__cause__ = error
        self._new_failures.append((request_id, failure))

    def process(self, batch: TokenBatch) -> tuple[list[RequestOutput], list[str]]:
        """Decode one step's tokens. Returns the outputs to publish and the ids
        of requests a stop string finished while the scheduler still runs them."""
        requests = self._requests
        outputs: list[RequestOutput] = []
        stopped_request_ids: list[str] = []
        for delta in batch.deltas:
            state = requests.get(delta.request_id)
            if state is None:
                if delta.finish_reason is not None:
                    self._failed_request_ids.pop(delta.request_id, None)
                continue
            try:
                output = state.advance(delta)
            except Exception as error:
                self._fail(delta.request_id, "decode", error)
                continue
            if output.finished:
                del requests[delta.request_id]
                if delta.finish_reason is None:
                    stopped_request_ids.append(delta.request_id)
                outputs.append(output)
            elif output.token_ids or output.text:
                outputs.append(output)
        return outputs, stopped_request_ids

    def _new_decoder(self, request: Request) -> _TextDecoder:
        skip_special_tokens = request.params.skip_special_tokens
        if self._byte_tables is not None:
            with_special, without_special = self._byte_tables
            return _ByteLevelDecoder(without_special if skip_special_tokens else with_special)
        skipped_token_ids = self._special_token_ids if skip_special_tokens else frozenset()
        return _WindowDecoder(self._backend, request.prompt_token_ids,
                              skipped_token_ids=skipped_token_ids)


async def run_detokenizer(
    inbox: trio.MemoryReceiveChannel[DetokenizerInbox],
    scheduler_outbox: trio.MemorySendChannel[SchedulerInbox],
    streams: RequestStreams,
    detokenizer: Detokenizer,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Consume Track and TokenBatch; publish RequestOutput deltas to the
    request streams (never blocks) and send StopStringHit to the scheduler for
    each request a stop string finished, or whose decoding failed (its stream
    fails with RequestFailed). Closes the scheduler outbox when the
    inbox closes. Queue time is measured on trio's clock (``trio.current_time``),
    which request arrival times must use too."""
    task_status.started()
    async with scheduler_outbox:
        async for message in inbox:
            match message:
                case Track(request=request):
                    detokenizer.track(request, trio.current_time())
                case TokenBatch():
                    outputs, stopped_request_ids = detokenizer.process(message)
                    streams.publish_all(outputs)
                    for request_id in stopped_request_ids:
                        await scheduler_outbox.send(StopStringHit(request_id=request_id))
            for request_id, failure in detokenizer.take_failures():
                streams.fail(request_id, failure)
                # Like a stop string, the failure ended the request here: the
                # scheduler frees it (if it already finished, nothing happens).
                await scheduler_outbox.send(StopStringHit(request_id=request_id))
