"""Grammar constraints for structured outputs, on xgrammar.

``Grammars`` compiles a request's StructuredOutputsParams once per distinct
constraint (xgrammar's compiler caches compiled grammars by their source) and
hands out a ``GrammarState`` per running request. Compiling can take a second
or more on a large vocabulary, so intake calls ``compile`` in a worker thread;
the scheduler's ``start`` then finds the grammar in the cache.

A ``GrammarState`` follows one request's confirmed output: ``accept`` each
token as the scheduler reconciles it; ``fill_bitmasks`` computes the masks of a
step's constrained rows at once, in a worker thread (xgrammar releases the GIL
while it fills). The bitmask is plain bytes (see ScheduledRequest.token_bitmask),
so it crosses a channel; the matcher never does.

xgrammar's view of the vocabulary is built from the ``tokenizers`` backend
directly: wrapping it in a transformers tokenizer first (what
``TokenizerInfo.from_huggingface`` wants) took 12 s for the built-in
qwen3-0.6b's 150k added tokens, all of it before the first constrained request
could be admitted.

JSON constraints also forbid every token holding a control character (U+0000 to
U+001F): xgrammar's JSON strings admit them raw, which strict JSON parsers
(Python's json, pydantic) refuse. With whitespace bounded no JSON token needs one.

Why xgrammar and not llguidance: docs/performance.md, "Grammar engine".
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from trio_llm.actors.messages import StructuredOutputsParams
from trio_llm.actors.tokenizer import Tokenizer


class GrammarError(ValueError):
    """A constraint the engine cannot compile; the message names the problem."""


def constraint_kind(params: StructuredOutputsParams) -> list[str]:
    """The constraints ``params`` sets (a valid one sets exactly one)."""
    given = [name for name in ("json", "regex", "choice", "grammar")
             if getattr(params, name) is not None]
    return given + (["json_object"] if params.json_object else [])


def choice_grammar(choices: list[str]) -> str:
    """EBNF matching exactly one of ``choices`` (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


# vLLM's VLLM_XGRAMMAR_CACHE_MB default: compiled grammars an engine keeps at hand.
DEFAULT_CACHE_BYTES = 512 * 2**20


class Grammars:
    """Compiles constraints for one tokenizer and vocabulary and keeps the compiled
    grammars, most recently used last, within ``cache_bytes`` (xgrammar's own size of
    each). Thread-safe: the queue compiles in worker threads while the scheduler
    starts matchers. A matcher keeps its grammar alive after eviction: a running
    request never loses its grammar, a waiting one is compiled again."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, *,
                 cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.cache_bytes = cache_bytes
        self._compiler: Any = None
        self._json_safe_words: np.ndarray | None = None
        self._lock = threading.Lock()
        # constraint (its msgspec encoding) -> (compiled grammar, its bytes)
        self._compiled: OrderedDict[bytes, tuple[Any, int]] = OrderedDict()
        self.num_cached_bytes = 0

    def is_compiled(self, params: StructuredOutputsParams) -> bool:
        """Whether ``start`` finds ``params`` compiled (it then never blocks)."""
        with self._lock:
            return constraint_key(params) in self._compiled

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``params``; GrammarError names what is wrong.
        Blocking: from a worker thread, except for constraints already compiled."""
        key = constraint_key(params)
        with self._lock:
            cached = self._compiled.get(key)
            if cached is not None:
                self._compiled.move_to_end(key)
                return cached[0]
        kinds = constraint_kind(params)
        if len(kinds) != 1:
            raise GrammarError(f"give exactly one constraint of json, json_object, regex, "
                               f"choice, grammar (got {', '.join(kinds) or 'none'})")
        compiler = self._get_compiler()
        try:
            compiled = self._compile_with(compiler, params)
        except (RuntimeError, ValueError, TypeError) as error:
            raise GrammarError(f"the {kinds[0]} constraint cannot be compiled: "
                               f"{_first_line(error)}") from None
        self._keep(key, compiled)
        return compiled

    def _keep(self, key: bytes, compiled: Any) -> None:
        """Cache it, evicting the least recently used beyond ``cache_bytes`` (one
        grammar alone over the bound is still kept: its request is about to start)."""
        num_bytes = int(compiled.memory_size_bytes)
        with self._lock:
            if key in self._compiled:
                return
            self._compiled[key] = (compiled, num_bytes)
            self.num_cached_bytes += num_bytes
            while self.num_cached_bytes > self.cache_bytes and len(self._compiled) > 1:
                _, (_, evicted_bytes) = self._compiled.popitem(last=False)
                self.num_cached_bytes -= evicted_bytes

    @property
    def num_cached(self) -> int:
        return len(self._compiled)

    def lookup(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``params`` if cached (never compiles), else None."""
        key = constraint_key(params)
        with self._lock:
            cached = self._compiled.get(key)
            if cached is None:
                return None
            self._compiled.move_to_end(key)
            return cached[0]

    def start(self, params: StructuredOutputsParams, compiled: Any = None) -> GrammarState:
        """A matcher at the start of the output, of ``compiled`` (``lookup``'s) or,
        blocking, of ``params`` compiled now."""
        import xgrammar

        matcher = xgrammar.GrammarMatcher(compiled or self.compile(params))
        is_json = params.json is not None or params.json_object
        return GrammarState(matcher, self.vocab_size,
                            allowed_words=self._json_safe_words if is_json else None)

    @staticmethod
    def _compile_with(compiler: Any, params: StructuredOutputsParams) -> Any:
        # Whitespace is not free: a free-running model could otherwise emit
        # spaces inside a JSON document forever.
        if params.json is not None:
            return compiler.compile_json_schema(params.json, any_whitespace=False,
                                                strict_mode=True)
        if params.json_object:
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if params.regex is not None:
            return compiler.compile_regex(params.regex)
        if params.choice is not None:
            if not params.choice:
                raise ValueError("choice must list at least one string")
            return compiler.compile_grammar(choice_grammar(params.choice))
        assert params.grammar is not None
        return compiler.compile_grammar(params.grammar)

    def _get_compiler(self) -> Any:
        """xgrammar's compiler, built on first use (seconds for a 150k vocabulary)."""
        with self._lock:
            if self._compiler is None:
                self._compiler, self._json_safe_words = _shared_compiler(self.tokenizer,
                                                                         self.vocab_size)
            return self._compiler


def constraint_key(params: StructuredOutputsParams) -> bytes:
    """The cache key of a constraint: its msgspec encoding."""
    return msgspec.msgpack.encode(params)


# Compilers outlive an engine: one per tokenizer and vocabulary in the process, so
# reopening an engine over the same model builds no second vocabulary view.
_COMPILERS: dict[tuple[str, int, tuple[int, ...]], tuple[Any, np.ndarray]] = {}
_COMPILERS_LOCK = threading.Lock()


def _shared_compiler(tokenizer: Tokenizer, vocab_size: int) -> tuple[Any, np.ndarray]:
    """(compiler, the bitmask words of the tokens free of control characters)."""
    serialised = tokenizer.backend.to_str()  # half a second for a 150k vocabulary: once
    key = (hashlib.sha256(serialised.encode()).hexdigest(), vocab_size,
           tuple(tokenizer.eos_token_ids))
    with _COMPILERS_LOCK:
        compiler = _COMPILERS.get(key)
        if compiler is None:
            compiler = _COMPILERS[key] = _new_compiler(tokenizer, vocab_size, serialised)
        return compiler


def _new_compiler(tokenizer: Tokenizer, vocab_size: int,
                  serialised: str) -> tuple[Any, np.ndarray]:
    import xgrammar

    info = tokenizer_info(tokenizer, vocab_size, serialised=serialised)
    # xgrammar's own cache is off: it is unbounded by default, and Grammars keeps
    # the compiled grammars within its bound in bytes.
    return (xgrammar.GrammarCompiler(info, cache_enabled=False),
            _words_without_control_characters(info.decoded_vocab, vocab_size))


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int, *,
                   serialised: str | None = None) -> Any:
    """xgrammar's TokenizerInfo, as ``from_huggingface`` builds it for a fast tokenizer
    (the vocabulary by id, its encoding detected from the serialised tokenizer), read
    from the ``tokenizers`` backend without building a transformers tokenizer."""
    import xgrammar

    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    detect = getattr(xgrammar.TokenizerInfo, "_detect_metadata_from_hf", None)
    from_vocab = getattr(xgrammar.TokenizerInfo, "_detect_vocab_type_from_vocab", None)
    metadata = None if detect is None else detect(serialised or tokenizer.backend.to_str())
    if metadata is None or (from_vocab is not None and from_vocab(vocab) not in
                            (None, metadata["vocab_type"])):
        # an xgrammar without these helpers, or a vocabulary whose serialised form
        # misdescribes it: xgrammar's own (slower) path sorts it out
        return _tokenizer_info_through_transformers(tokenizer, vocab_size)
    encoded_vocab = [""] * vocab_size
    for token, token_id in vocab.items():
        if token_id < vocab_size:
            encoded_vocab[token_id] = token
    return xgrammar.TokenizerInfo(encoded_vocab, metadata["vocab_type"], vocab_size=vocab_size,
                                  stop_token_ids=tokenizer.eos_token_ids,
                                  add_prefix_space=metadata["add_prefix_space"])


def _tokenizer_info_through_transformers(tokenizer: Tokenizer, vocab_size: int) -> Any:
    import transformers
    import xgrammar

    wrapped = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
    return xgrammar.TokenizerInfo.from_huggingface(wrapped, vocab_size=vocab_size,
                                                   stop_token_ids=tokenizer.eos_token_ids)


_CONTROL_BYTE = re.compile(rb"[\x00-\x1f]")


def _words_without_control_characters(decoded_vocab: list[bytes], vocab_size: int
                                      ) -> np.ndarray:
    """Bitmask words (int32) allowing every token whose bytes hold no control character."""
    bits = np.zeros((vocab_size + 31) // 32 * 32, dtype=np.uint8)
    for token_id, token in enumerate(decoded_vocab[:vocab_size]):
        bits[token_id] = _CONTROL_BYTE.search(token) is None
    return np.packbits(bits, bitorder="little").view(np.int32)


# xgrammar prefixes its messages with "[time] source-file:line: ".
_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*")


def _first_line(error: Exception) -> str:
    text = _LOG_PREFIX.sub("", str(error).strip()) or type(error).__name__
    return text.splitlines()[0] if len(text) > 300 else text


class GrammarState:
    """One request's place in its grammar."""

    __slots__ = ("_matcher", "vocab_size", "_allowed_words")

    def __init__(self, matcher: Any, vocab_size: int, *,
                 allowed_words: np.ndarray | None = None) -> None:
        """``allowed_words``: a bitmask every mask is narrowed to (None: the grammar's)."""
        self._matcher = matcher
        self.vocab_size = vocab_size
        self._allowed_words = allowed_words

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar forbids it."""
        return bool(self._matcher.accept_token(token_id))

    @property
    def is_terminated(self) -> bool:
        """It accepted a stop token: nothing may follow."""
        return bool(self._matcher.is_terminated())

    def next_bitmask(self) -> bytes:
        """The tokens allowed next (see ``fill_bitmasks``)."""
        return fill_bitmasks([self])[0]


def accept_tokens(states: Sequence[GrammarState], token_ids: Sequence[int]) -> list[bool]:
    """``GrammarState.accept`` of each state's token, in one call into xgrammar (a
    step's constrained rows at once, on the event loop: one call instead of 64)."""
    import xgrammar

    if not states:
        return []
    return xgrammar.BatchGrammarMatcher.batch_accept_token(
        [state._matcher for state in states], list(token_ids))


def fill_bitmasks(states: Sequence[GrammarState]) -> list[bytes]:
    """The tokens each state allows next, as ScheduledRequest.token_bitmask bytes.

    One call into xgrammar fills every row (its BatchGrammarMatcher, on a thread pool
    of half the machine's cores, without the GIL): about 0.8 ms for 64 rows of a 150k
    vocabulary on the H200's host, as long as the matchers' own fills one after the
    other took, but the GIL is let go and taken back once, not 64 times (each a wait of
    up to the interpreter's switch interval, 5 ms, behind a busy event loop:
    docs/performance.md, "Structured outputs"). Up to tens of ms in states xgrammar
    resolves at run time.

    After a stop token nothing follows; a mask asked for then (a step already
    planned when the request finished, whose token is dropped) allows everything."""

    if not states:
        return []
    vocab_size = states[0].vocab_size
    assert all(state.vocab_size == vocab_size for state in states), "one vocabulary per step"
    words = np.full((len(states), (vocab_size + 31) // 32), -1, dtype=np.int32)
    live = [index for index, state in enumerate(states) if not state.is_terminated]
    if live:
        _batch_matcher().batch_fill_next_token_bitmask(
            [states[index]._matcher for index in live], words, live)
    _narrow(words, states, live)
    return [row.tobytes() for row in words]


def _narrow(words: np.ndarray, states: Sequence[GrammarState], live: list[int]) -> None:
    """Take out of each live row the tokens no mask of its grammar may allow: one
    vectorised operation for all the rows that share an ``allowed_words``."""
    by_allowed: dict[int, tuple[np.ndarray, list[int]]] = {}
    for index in live:
        allowed = states[index]._allowed_words
        if allowed is not None:
            by_allowed.setdefault(id(allowed), (allowed, []))[1].append(index)
    for allowed, rows in by_allowed.values():
        if len(rows) == len(states):
            np.bitwise_and(words, allowed, out=words)
        else:
            words[rows] &= allowed


_BATCH_MATCHER: Any = None
_BATCH_MATCHER_LOCK = threading.Lock()


def _batch_matcher() -> Any:
    """xgrammar's batch matcher, whose thread pool the process shares."""
    global _BATCH_MATCHER
    import xgrammar

    with _BATCH_MATCHER_LOCK:
        if _BATCH_MATCHER is None:
            _BATCH_MATCHER = xgrammar.BatchGrammarMatcher()
        return _BATCH_MATCHER
