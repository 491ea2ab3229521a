"""Tokenizer: files of a model directory, chat templates, EOS ids."""

import json
import shutil

import pytest

from trio_llm.actors.errors import RequestRejected
from trio_llm.actors.tokenizer import Tokenizer
from trio_llm.gpu.builtin import resolve_model

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Where is the lighthouse?"},
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRIO_LLM_CACHE", str(tmp_path_factory.mktemp("cache")))
        return resolve_model("tiny")


@pytest.fixture
def model_dir(tiny_dir, tmp_path):
    """A private copy of the tiny model's tokenizer files, for a test to edit."""
    directory = tmp_path / "model"
    directory.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "generation_config.json"):
        shutil.copy(tiny_dir / name, directory / name)
    return directory


def _edit_json(path, **changes):
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update(changes)
    path.write_text(json.dumps(data))


def test_round_trip_and_special_tokens(model_dir):
    tokenizer = Tokenizer.from_dir(model_dir)
    token_ids = tokenizer.encode("<|im_start|>user\nThe fox came.<|im_end|>")
    assert token_ids[0] == tokenizer.backend.token_to_id("<|im_start|>")
    assert tokenizer.decode(token_ids) == "user\nThe fox came."
    assert tokenizer.decode(token_ids, skip_special_tokens=False) == (
        "<|im_start|>user\nThe fox came.<|im_end|>")
    assert tokenizer.all_special_ids == {0, 1, 2}


def test_chat_template_from_jinja_file(model_dir):
    prompt = Tokenizer.from_dir(model_dir).apply_chat_template(CONVERSATION)
    assert prompt == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                      "<|im_start|>user\nWhere is the lighthouse?<|im_end|>\n"
                      "<|im_start|>assistant\n")


def test_chat_template_from_tokenizer_config(model_dir):
    template = (model_dir / "chat_template.jinja").read_text()
    (model_dir / "chat_template.jinja").unlink()
    _edit_json(model_dir / "tokenizer_config.json", chat_template=template)
    tokenizer = Tokenizer.from_dir(model_dir)
    prompt = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=False)
    assert prompt.endswith("Where is the lighthouse?<|im_end|>\n")


def test_named_chat_templates_use_the_default(model_dir):
    (model_dir / "chat_template.jinja").unlink()
    _edit_json(model_dir / "tokenizer_config.json", chat_template=[
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "{{ messages[0]['content'] }}{{ eos_token }}"},
    ])
    prompt = Tokenizer.from_dir(model_dir).apply_chat_template(CONVERSATION)
    assert prompt == "Be brief.<|im_end|>"


def test_no_chat_template_is_rejected(model_dir):
    (model_dir / "chat_template.jinja").unlink()
    with pytest.raises(RequestRejected) as caught:
        Tokenizer.from_dir(model_dir).apply_chat_template(CONVERSATION)
    assert caught.value.param == "messages"


def test_template_raise_exception_is_rejected(model_dir):
    (model_dir / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}"
        "{% endif %}")
    with pytest.raises(RequestRejected, match="no system role"):
        Tokenizer.from_dir(model_dir).apply_chat_template(CONVERSATION)


def test_template_cannot_escape_the_sandbox(model_dir):
    (model_dir / "chat_template.jinja").write_text("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(RequestRejected):
        Tokenizer.from_dir(model_dir).apply_chat_template(CONVERSATION)


@pytest.mark.parametrize(("generation_eos", "expected"), [
    (0, [0, 2]),
    ([1, 0], [1, 0, 2]),
    (None, [2]),
])
def test_eos_ids_from_generation_config(model_dir, generation_eos, expected):
    if generation_eos is None:
        (model_dir / "generation_config.json").unlink()
    else:
        _edit_json(model_dir / "generation_config.json", eos_token_id=generation_eos)
    assert Tokenizer.from_dir(model_dir).eos_token_ids == expected


def test_eos_token_as_added_token_dict(model_dir):
    (model_dir / "generation_config.json").unlink()
    _edit_json(model_dir / "tokenizer_config.json",
               eos_token={"content": "<|endoftext|>", "special": True})
    assert Tokenizer.from_dir(model_dir).eos_token_ids == [0]


def test_vocab_size_counts_added_tokens(model_dir):
    tokenizer = Tokenizer.from_dir(model_dir)
    tokenizer.backend.add_tokens(["<|a|>", "<|b|>"])
    tokenizer.backend.save(str(model_dir / "tokenizer.json"))
    assert Tokenizer.from_dir(model_dir).vocab_size == tokenizer.vocab_size + 2


def test_missing_tokenizer_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_agrees_with_transformers(tiny_dir):
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(str(tiny_dir))
    tokenizer = Tokenizer.from_dir(tiny_dir)
    text = "A question is a door, said the teacher: 42 doors!"
    assert tokenizer.encode(text) == reference.encode(text)
    assert tokenizer.apply_chat_template(CONVERSATION) == reference.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True)


def test_special_tokens_only_in_tokenizer_config(model_dir):
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["added_tokens_decoder"]["2048"] = {"content": "<|tool|>", "special": True}
    config["added_tokens_decoder"]["4000"] = {"content": "<|far|>", "special": True}
    config_path.write_text(json.dumps(config))
    tokenizer = Tokenizer.from_dir(model_dir)
    assert tokenizer.encode("<|tool|>") == [2048]
    assert 2048 in tokenizer.all_special_ids
    assert tokenizer.backend.token_to_id("<|far|>") is None  # its id would not match
    assert tokenizer.vocab_size == 2049
