"""Grammar constraints for structured outputs, on xgrammar.

``Grammars`` compiles a request's StructuredOutputsParams once per distinct
constraint (xgrammar's compiler caches compiled grammars by their source) and
hands out a ``GrammarState`` per running request. Compiling can take a second
or more on a large vocabulary, so intake calls ``compile`` in a worker thread;
the scheduler's ``start`` then finds the grammar in the cache.

A ``GrammarState`` follows one request's confirmed output: ``accept`` each
token as the scheduler reconciles it, ``next_bitmask`` before each sampled
token. The bitmask is plain bytes (see ScheduledRequest.token_bitmask), so it
crosses a channel; the matcher never does.

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
from typing import Any

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


class Grammars:
    """Compiles constraints for one tokenizer and vocabulary. Thread-safe: intake
    compiles in worker threads while the scheduler starts matchers."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler: Any = None
        self._json_safe_words: np.ndarray | None = None
        self._lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``params``; GrammarError names what is wrong.
        Blocking: from a worker thread, except for constraints already compiled."""
        kinds = constraint_kind(params)
        if len(kinds) != 1:
            raise GrammarError(f"give exactly one constraint of json, json_object, regex, "
                               f"choice, grammar (got {', '.join(kinds) or 'none'})")
        compiler = self._get_compiler()
        try:
            return self._compile_with(compiler, params)
        except (RuntimeError, ValueError, TypeError) as error:
            raise GrammarError(f"the {kinds[0]} constraint cannot be compiled: "
                               f"{_first_line(error)}") from None

    def start(self, params: StructuredOutputsParams) -> GrammarState:
        """A matcher at the start of the output."""
        import xgrammar

        matcher = xgrammar.GrammarMatcher(self.compile(params))
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


# Compilers (and the grammars they cached) outlive an engine: one per tokenizer and
# vocabulary in the process, so reopening an engine over the same model recompiles nothing.
_COMPILERS: dict[tuple[str, int, tuple[int, ...]], tuple[Any, np.ndarray]] = {}
_COMPILERS_LOCK = threading.Lock()


def _shared_compiler(tokenizer: Tokenizer, vocab_size: int) -> tuple[Any, np.ndarray]:
    """(compiler, the bitmask words of the tokens free of control characters)."""
    key = (hashlib.sha256(tokenizer.backend.to_str().encode()).hexdigest(), vocab_size,
           tuple(tokenizer.eos_token_ids))
    with _COMPILERS_LOCK:
        compiler = _COMPILERS.get(key)
        if compiler is None:
            compiler = _COMPILERS[key] = _new_compiler(tokenizer, vocab_size)
        return compiler


def _new_compiler(tokenizer: Tokenizer, vocab_size: int) -> tuple[Any, np.ndarray]:
    import transformers
    import xgrammar

    wrapped = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
    info = xgrammar.TokenizerInfo.from_huggingface(wrapped, vocab_size=vocab_size,
                                                   stop_token_ids=tokenizer.eos_token_ids)
    return (xgrammar.GrammarCompiler(info, cache_enabled=True),
            _words_without_control_characters(info.decoded_vocab, vocab_size))


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

    __slots__ = ("_matcher", "_bitmask", "_allowed_words")

    def __init__(self, matcher: Any, vocab_size: int, *,
                 allowed_words: np.ndarray | None = None) -> None:
        """``allowed_words``: a bitmask every mask is narrowed to (None: the grammar's)."""
        import xgrammar

        self._matcher = matcher
        self._bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
        self._allowed_words = allowed_words

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar forbids it."""
        return bool(self._matcher.accept_token(token_id))

    @property
    def is_terminated(self) -> bool:
        """It accepted a stop token: nothing may follow."""
        return bool(self._matcher.is_terminated())

    def next_bitmask(self) -> bytes:
        """The tokens allowed next, as ScheduledRequest.token_bitmask bytes. After a
        stop token nothing follows; a mask asked for then (a step already planned
        when the request finished, whose token is dropped) allows everything."""
        if self._matcher.is_terminated():
            self._bitmask.fill_(-1)
            return self._bitmask.numpy().tobytes()
        self._matcher.fill_next_token_bitmask(self._bitmask, 0)
        words = self._bitmask.numpy()[0]
        if self._allowed_words is not None:
            words = words & self._allowed_words
        return words.tobytes()
