"""Reasoning split out of generated text: Qwen3's ``<think>...</think>``.

Like the tool parsers, a reasoning parser reads the whole text so far and says
what is reasoning and what is the answer; both parts only grow as text arrives
(a tail that may be the start of a tag is held back), so streamed deltas are the
differences between successive parses. Registered under the name
``--reasoning-parser`` takes.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(frozen=True, slots=True)
class SplitText:
    reasoning: str
    content: str


class Qwen3ReasoningParser:
    """Output that opens with ``<think>`` is reasoning up to ``</think>`` and answer
    after it (cut off before ``</think>``: all reasoning). Output that does not open
    with it is all answer: thinking disabled (``chat_template_kwargs:
    {"enable_thinking": false}`` writes an empty think block into the prompt), or a
    template that opened the block itself, which this parser does not see (it reads
    the output only, so that streamed and whole responses always agree)."""

    def split(self, text: str, *, is_final: bool) -> SplitText:
        if not text.startswith(THINK_START):
            if not is_final and THINK_START.startswith(text):
                return SplitText(reasoning="", content="")  # may still open <think>
            return SplitText(reasoning="", content=text)
        body = text[len(THINK_START):]
        end = body.find(THINK_END)
        if end >= 0:
            return SplitText(reasoning=body[:end], content=body[end + len(THINK_END):])
        return SplitText(reasoning=body if is_final else _without_partial(body, THINK_END),
                         content="")


def _without_partial(text: str, tag: str) -> str:
    """``text`` less a tail that could be the start of ``tag``."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return text[:-length]
    return text


REASONING_PARSERS: dict[str, type[Qwen3ReasoningParser]] = {"qwen3": Qwen3ReasoningParser}
