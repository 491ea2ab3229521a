"""The engine's tokenizer: a `tokenizers.Tokenizer` plus what a model directory says about it.

Reads, from a Hugging Face model directory and nothing else (never the network):
tokenizer.json (the tokenizer itself), tokenizer_config.json (special tokens,
added tokens, and possibly the chat template), chat_template.jinja (where
transformers 5 writes the chat template) and generation_config.json (EOS ids).
Transformers is deliberately not imported: it is slow to import and this is on
the path of every engine start.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import tokenizers
from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from trio_llm.actors.errors import RequestRejected

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class TooManyTokens(ValueError):
    """A text encodes to more tokens than the caller can use."""

    def __init__(self, num_tokens: int) -> None:
        super().__init__(f"{num_tokens} tokens")
        self.num_tokens = num_tokens


class Tokenizer:
    """Text <-> token ids, chat templates and EOS ids for one model.

    ``backend`` is the underlying ``tokenizers.Tokenizer``, for callers that
    decode incrementally.
    """

    def __init__(self, backend: tokenizers.Tokenizer, *, special_tokens: dict[str, str],
                 chat_template: str | None, generation_eos_ids: Sequence[int]) -> None:
        self.backend = backend
        self.special_tokens = special_tokens
        self.chat_template = chat_template
        self._eos_token_ids = _eos_ids(backend, special_tokens, generation_eos_ids)
        self._all_special_ids = _special_ids(backend, special_tokens)
        self._vocab_size = _vocab_size(backend)
        self._compiled_template: Any = None

    @classmethod
    def from_dir(cls, path: str | Path, *, chat_template: str | None = None) -> Tokenizer:
        """Load the tokenizer of the model directory ``path``; ``chat_template``
        (a file or the template itself, as ``--chat-template`` takes it) replaces
        the model's."""
        directory = Path(path)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{tokenizer_file}: no tokenizer.json in the model directory")
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        config = _read_json(directory / "tokenizer_config.json")
        generation_config = _read_json(directory / "generation_config.json")
        _add_missing_special_tokens(backend, config)
        return cls(
            backend,
            special_tokens=_special_tokens(config),
            chat_template=(load_chat_template(chat_template) if chat_template is not None
                           else _read_chat_template(directory, config)),
            generation_eos_ids=_as_id_list(generation_config.get("eos_token_id")),
        )

    # -- properties -----------------------------------------------------------

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends generation: generation_config.json's, then the tokenizer's."""
        return list(self._eos_token_ids)

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce, added tokens included."""
        return self._vocab_size

    @property
    def all_special_ids(self) -> set[int]:
        """Ids of the added tokens marked special and of the config's named special tokens."""
        return set(self._all_special_ids)

    # -- text <-> ids ---------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = True,
               max_num_tokens: int | None = None) -> list[int]:
        """``add_special_tokens``: let tokenizer.json's post-processor add BOS and the like.

        Goes through ``encode_batch_fast``, which releases the GIL while it
        works (``encode`` holds it: a long prompt encoded in a worker thread
        would still stall the event loop for as long as it takes). Raises
        TooManyTokens, before building the list of ids (which holds the GIL),
        when there are more than ``max_num_tokens``.
        """
        (encoding,) = self.backend.encode_batch_fast([text],
                                                     add_special_tokens=add_special_tokens)
        if max_num_tokens is not None and len(encoding) > max_num_tokens:
            raise TooManyTokens(len(encoding))
        return list(encoding.ids)

    def decode(self, token_ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """Like ``encode``, through the batch call that releases the GIL."""
        (text,) = self.backend.decode_batch([list(token_ids)],
                                            skip_special_tokens=skip_special_tokens)
        return str(text)

    def apply_chat_template(self, messages: list[dict[str, Any]], *,
                            add_generation_prompt: bool = True,
                            continue_final_message: bool = False, **variables: Any) -> str:
        """Render a conversation to the prompt text the model was trained on;
        ``variables`` (tools, documents, enable_thinking, ...) are the template's too.
        ``continue_final_message``: the text ends with the last message's content,
        left open for the model to continue (transformers' rule).

        Raises RequestRejected when the model has no chat template or the
        template rejects the conversation.
        """
        template = self._template()
        try:
            text = str(template.render(**{**self.special_tokens, **variables},
                                       messages=messages,
                                       add_generation_prompt=add_generation_prompt))
        except TemplateError as error:
            raise RequestRejected(f"the chat template failed: {error}",
                                  param="messages") from error
        if continue_final_message:
            return _cut_after_final_message(text, messages)
        return text

    def _template(self) -> Any:
        if self.chat_template is None:
            raise RequestRejected("this model has no chat template; send a plain prompt instead",
                                  param="messages")
        if self._compiled_template is None:
            self._compiled_template = _jinja_environment().from_string(self.chat_template)
        return self._compiled_template


# -- reading the model directory ---------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as file:
        data = json.load(file)
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
    found = {key: _token_content(config.get(key)) for key in SPECIAL_TOKEN_KEYS}
    return {key: token for key, token in found.items() if token is not None}


def _add_missing_special_tokens(backend: tokenizers.Tokenizer, config: dict[str, Any]) -> None:
    """Special tokens tokenizer_config.json declares but tokenizer.json lacks, added where
    they land on the id the config gives them (the end of the vocabulary)."""
    declared = config.get("added_tokens_decoder") or {}
    for token_id, entry in sorted(declared.items(), key=lambda item: int(item[0])):
        content = _token_content(entry)
        if content is None or backend.token_to_id(content) is not None:
            continue
        if int(token_id) == backend.get_vocab_size(with_added_tokens=True):
            backend.add_special_tokens([tokenizers.AddedToken(content, special=True,
                                                              normalized=False)])


def _read_chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    """The chat template: chat_template.jinja (transformers 5) wins over tokenizer_config.json."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        # Several named templates: the one named "default" is the chat template.
        named = {entry.get("name"): entry.get("template") for entry in template}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [item for item in value if isinstance(item, int)]
    return []


def _eos_ids(backend: tokenizers.Tokenizer, special_tokens: dict[str, str],
             generation_eos_ids: Sequence[int]) -> list[int]:
    ids = list(dict.fromkeys(generation_eos_ids))
    eos_token = special_tokens.get("eos_token")
    eos_id = backend.token_to_id(eos_token) if eos_token is not None else None
    if eos_id is not None and eos_id not in ids:
        ids.append(eos_id)
    return ids


def _special_ids(backend: tokenizers.Tokenizer, special_tokens: dict[str, str]) -> set[int]:
    ids = {token_id for token_id, added in backend.get_added_tokens_decoder().items()
           if added.special}
    for token in special_tokens.values():
        token_id = backend.token_to_id(token)
        if token_id is not None:
            ids.add(token_id)
    return ids


def _vocab_size(backend: tokenizers.Tokenizer) -> int:
    added_ids = backend.get_added_tokens_decoder().keys()
    largest_id = max(added_ids, default=-1)
    return max(backend.get_vocab_size(with_added_tokens=True), largest_id + 1)


# -- chat templates ------------------------------------------------------------


def _cut_after_final_message(text: str, messages: list[dict[str, Any]]) -> str:
    """``text`` up to the end of the last message's content, as transformers cuts it
    for continue_final_message: what the template writes after it (an end of turn)
    goes, so the model continues the message."""
    final = str(messages[-1].get("content") or "") if messages else ""
    if not final.strip() or final.strip() not in text:
        raise RequestRejected("continue_final_message is set, but the chat template does not "
                              "write the final message's content", param="messages")
    start = text.rindex(final.strip())
    if text[start:start + len(final.lstrip())] == final.lstrip():
        return text[:start + len(final.lstrip())]
    # the template trimmed the message's trailing space: cut after what it kept
    return text[:start + len(final.strip())]


def load_chat_template(template: str) -> str:
    """``--chat-template``: a file's text, or the template itself given inline (vLLM's rule)."""
    path = Path(template)
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError:
        pass  # a long inline template is no file name
    if "{{" in template or "{%" in template:
        return template
    raise ValueError(f"--chat-template {template!r} is neither a file nor a Jinja template")


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _jinja_environment() -> ImmutableSandboxedEnvironment:
    """A sandbox with the helpers chat templates in the wild expect."""
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment
