"""No silently ignored field: what the server does with each field of a request body.

Every field of OpenAI's or vLLM's request schema is one of:

- **declared** in the request Struct (api/protocol.py): honoured;
- **refused** (``REFUSED_*``): trio-llm does not do what it asks, so a value
  that would change anything is a 400 naming the field; its default (or null)
  is accepted, since clients send defaults;
- **without effect** (``NO_EFFECT_FIELDS``): it never changes the output
  (an end user's id, a cache routing key), so it is accepted;

A field in neither schema is ignored with one warning log line naming it,
as vLLM does.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import msgspec

from trio_llm.actors.errors import RequestRejected

logger = logging.getLogger(__name__)


class Refusal(NamedTuple):
    """Values of a refused field that change nothing (null always does), and why
    any other value is refused."""

    accepted: tuple[Any, ...]
    reason: str


_TEXT_ONLY = Refusal((["text"],), "trio-llm generates text only")
_NO_BEAM_SEARCH = Refusal((False,), "trio-llm has no beam search")
_LEGACY_GUIDED = Refusal((), "use structured_outputs (vLLM's current name for the guided_* "
                             "fields) or response_format")
_NO_LOGITS_PROCESSORS = Refusal((), "trio-llm runs no custom logits processors")
_NO_DISAGGREGATION = Refusal((), "trio-llm has no disaggregated prefill")
_NO_XARGS = Refusal((), "trio-llm has no request extensions")
_SERVER_REQUEST_IDS = Refusal((), "the server names each request itself (the response's id)")
_NO_MULTIMODAL = Refusal((), "trio-llm serves text models only")
_SPACES = Refusal((True,), "the tokenizer decodes special tokens as they are")

# Fields both endpoints share (OpenAI's and vLLM's).
_REFUSED_SHARED: dict[str, Refusal] = {
    "use_beam_search": _NO_BEAM_SEARCH,
    "length_penalty": Refusal((1.0,), "trio-llm has no beam search"),
    "spaces_between_special_tokens": _SPACES,
    "guided_json": _LEGACY_GUIDED,
    "guided_regex": _LEGACY_GUIDED,
    "guided_choice": _LEGACY_GUIDED,
    "guided_grammar": _LEGACY_GUIDED,
    "guided_decoding_backend": Refusal(("xgrammar", "auto"),
                                       "trio-llm compiles constraints with xgrammar only"),
    "guided_whitespace_pattern": _LEGACY_GUIDED,
    "structural_tag": Refusal((), "structural tags are not supported"),
    "request_id": _SERVER_REQUEST_IDS,
    "logits_processors": _NO_LOGITS_PROCESSORS,
    "kv_transfer_params": _NO_DISAGGREGATION,
    "vllm_xargs": _NO_XARGS,
    "mm_processor_kwargs": _NO_MULTIMODAL,
    # a word of several tokens depends on the token still in flight at depth 2
    "bad_words": Refusal(([],), "bad_words is not supported; allowed_token_ids and logit_bias "
                                "are"),
    "prompt_logprobs": Refusal((), "prompt logprobs come with echo and logprobs on "
                                   "/v1/completions"),
}

REFUSED_CHAT_FIELDS: dict[str, Refusal] = {
    **_REFUSED_SHARED,
    # OpenAI's
    "audio": Refusal((), "trio-llm generates text only"),
    "modalities": _TEXT_ONLY,
    "functions": Refusal((), "the deprecated functions field is not supported; use tools"),
    "function_call": Refusal((), "the deprecated function_call field is not supported; "
                                 "use tool_choice"),
    "store": Refusal((False,), "trio-llm stores no completions"),
    "prediction": Refusal((), "predicted outputs are not supported"),
    "service_tier": Refusal(("auto", "default"), "trio-llm has one service tier"),
    "verbosity": Refusal((), "verbosity is not supported; say it in the prompt"),
    "web_search_options": Refusal((), "trio-llm does not search the web"),
    "reasoning_effort": Refusal((), "send it in chat_template_kwargs if the model's chat "
                                    "template reads it"),
    # vLLM's
    "echo": Refusal((False,), "chat does not echo the last message; /v1/completions echoes "
                              "its prompt"),
    "chat_template": Refusal((), "a request may not bring its own chat template (vLLM refuses "
                                 "it too by default); start the server with --chat-template"),
    "include_reasoning": Refusal((True,), "reasoning is always returned, in "
                                          "reasoning_content with --reasoning-parser"),
}

REFUSED_COMPLETION_FIELDS: dict[str, Refusal] = {
    **_REFUSED_SHARED,
    "prompt_embeds": Refusal((), "prompts are text or token ids"),
}

# They never change the output, so accepting them does what they ask.
NO_EFFECT_FIELDS = frozenset({
    "metadata",  # tags of a stored completion; nothing is stored (see store)
    "prompt_cache_key",  # a cache routing hint: the prefix cache needs none
    "safety_identifier",  # an end user's id for abuse monitoring, like user
})


def check_fields(body: bytes | str, kind: type[Any],
                 refused: dict[str, Refusal]) -> None:
    """Refuse what ``kind`` does not honour, warn once about what neither schema has.

    Call it after ``body`` decoded into ``kind``, so it is a JSON object.
    Raises RequestRejected naming the first refused field.
    """
    fields = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    declared = _declared_fields(kind)
    ignored = []
    for name, raw in fields.items():
        if name in declared or name in NO_EFFECT_FIELDS:
            continue
        refusal = refused.get(name)
        if refusal is None:
            ignored.append(name)
            continue
        value = msgspec.json.decode(raw)
        if value is not None and not any(_same(value, ok) for ok in refusal.accepted):
            raise RequestRejected(f"{name} is not supported by trio-llm: {refusal.reason}",
                                  param=name)
    if ignored:
        # vLLM's message, so log searches built for it find ours.
        logger.warning("The following fields were present in the request but ignored: %s",
                       ", ".join(sorted(ignored)))


_DECLARED: dict[type[Any], frozenset[str]] = {}


def _declared_fields(kind: type[Any]) -> frozenset[str]:
    """The field names ``kind`` decodes (its Struct fields, inherited ones too)."""
    if kind not in _DECLARED:
        _DECLARED[kind] = frozenset(kind.__struct_fields__)
    return _DECLARED[kind]


def _same(value: Any, accepted: Any) -> bool:
    """Equal and of the same kind: 0 is not False, 1 is 1.0."""
    if isinstance(value, bool) or isinstance(accepted, bool):
        return value is accepted
    return bool(value == accepted)
