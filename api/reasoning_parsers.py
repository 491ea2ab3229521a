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
# Qwen3.5 may call a tool from inside its reasoning without closing it first: a
# <tool_call> that opens a function ends the reasoning there (as vLLM's parser does).
TOOL_CALL_START = "<tool_call>"
FUNCTION_START = "<function="


@dataclass(frozen=True, slots=True)
class SplitText:
    """``end``: where the reasoning's text ends in the output, ``</think>`` included
    (0 where there is none), to count its tokens."""

    reasoning: str
    content: str
    end: int = 0


class Qwen3ReasoningParser:
    """Reasoning is the text inside the think block, the answer the text after it.

    Where the block opens depends on the chat template, which the parser learns from
    the end of the prompt (``note_prompt_end``, before the first parse):

    - Qwen3.5 / Qwen3.6 (and Qwen3's thinking-only models) end the prompt with an open
      ``<think>``: the output is reasoning from its first token up to ``</think>``;
    - Qwen3's hybrid models let the model write ``<think>`` itself: output that opens
      with it is reasoning up to ``</think>``, other output is all answer;
    - with thinking off (``chat_template_kwargs: {"enable_thinking": false}``) these
      templates close an empty block in the prompt: the output is all answer.

    The reasoning also ends at a ``<tool_call>`` that opens a function. Output cut off
    inside the block is all reasoning. A ``<think>`` the model writes again after the
    prompt opened the block is dropped.
    """

    def __init__(self) -> None:
        self.is_open_in_prompt = False

    def note_prompt_end(self, text: str) -> None:
        """``text``: the last characters of the prompt the template rendered."""
        self.is_open_in_prompt = text.rstrip().endswith(THINK_START)

    def split(self, text: str, *, is_final: bool) -> SplitText:
        if text.startswith(THINK_START):
            return _split_block(text, len(THINK_START), is_final=is_final)
        if not is_final and THINK_START.startswith(text):
            return SplitText(reasoning="", content="")  # may still open <think>
        if self.is_open_in_prompt:
            return _split_block(text, 0, is_final=is_final)
        return SplitText(reasoning="", content=text)


def _split_block(text: str, start: int, *, is_final: bool) -> SplitText:
    """``text`` whose think block's reasoning starts at ``start``."""
    position = start
    while True:
        think_end = text.find(THINK_END, position)
        call = text.find(TOOL_CALL_START, position)
        if call < 0 or 0 <= think_end < call:
            break
        opens = _opens_function(text, call + len(TOOL_CALL_START), is_final=is_final)
        if opens is None:  # the answer may start here: hold the reasoning back
            return SplitText(reasoning=text[start:call], content="", end=call)
        if opens:
            return SplitText(reasoning=text[start:call], content=text[call:], end=call)
        position = call + len(TOOL_CALL_START)
    if think_end >= 0:
        end = think_end + len(THINK_END)
        return SplitText(reasoning=text[start:think_end], content=text[end:], end=end)
    reasoning = text[start:]
    if not is_final:
        reasoning = _without_partial(reasoning, THINK_END, TOOL_CALL_START)
    return SplitText(reasoning=reasoning, content="", end=len(text))


def _opens_function(text: str, index: int, *, is_final: bool) -> bool | None:
    """Whether whitespace and ``<function=`` follow ``index``; None while unknown."""
    while index < len(text) and text[index] in " \t\r\n":
        index += 1
    rest = text[index:index + len(FUNCTION_START)]
    if rest == FUNCTION_START:
        return True
    return None if not is_final and FUNCTION_START.startswith(rest) else False


def _without_partial(text: str, *tags: str) -> str:
    """``text`` less a tail that could be the start of one of ``tags`` (each has its
    only "<" first, so such a tail starts at the last "<")."""
    cut = text.rfind("<", max(0, len(text) - max(map(len, tags)) + 1))
    if cut >= 0 and any(tag.startswith(text[cut:]) for tag in tags):
        return text[:cut]
    return text


REASONING_PARSERS: dict[str, type[Qwen3ReasoningParser]] = {"qwen3": Qwen3ReasoningParser}
