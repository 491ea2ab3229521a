"""Intake: validation with clear rejections, tokenization, chat templates, resolution."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import trio
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.errors import RequestRejected
from trio_llm.actors.intake import Intake, derive_seed, run_intake
from trio_llm.actors.messages import Abort, Admit, Request, SamplingParams, Submit
from trio_llm.actors.streams import RequestStreams
from trio_llm.actors.tokenizer import Tokenizer

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
MAX_MODEL_LEN = 64
NUM_KV_TOKENS = 48


@functools.cache
def backend() -> BackendTokenizer:
    tokenizer = BackendTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(["Hello world, the quick brown fox."] * 8, trainer)
    return tokenizer


def make_tokenizer(*, chat_template: str | None = CHATML_TEMPLATE) -> Tokenizer:
    return Tokenizer(backend(), special_tokens={"eos_token": "<|im_end|>"},
                     chat_template=chat_template, generation_eos_ids=[2, 0])


def make_intake(*, tokenizer: Tokenizer | None = None, **config: Any) -> Intake:
    tokenizer = tokenizer or make_tokenizer()
    return Intake(EngineConfig(**config), tokenizer, max_model_len=MAX_MODEL_LEN,
                  num_kv_tokens=NUM_KV_TOKENS, vocab_size=tokenizer.vocab_size)


def submit(prompt: Any = "Hello world", *, request_id: str = "r", **fields: Any) -> Submit:
    params = fields.pop("params", SamplingParams())
    if isinstance(prompt, list):
        return Submit(request_id=request_id, prompt_token_ids=prompt, params=params,
                      arrival_time=1.0, **fields)
    return Submit(request_id=request_id, prompt=prompt, params=params, arrival_time=1.0,
                  **fields)


def rejection(intake: Intake, request: Submit) -> RequestRejected:
    with pytest.raises(RequestRejected) as caught:
        intake.admit(request)
    return caught.value


# -- rejections ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_fields", "param", "words"),
    [
        ({"prompt": ""}, "prompt", "empty"),
        ({"prompt": []}, "prompt", "empty"),
        ({"prompt": [1, 2, 300]}, "prompt", "outside the vocabulary"),
        ({"prompt": [1, -1]}, "prompt", "outside the vocabulary"),
        ({"prompt": [1] * (MAX_MODEL_LEN + 1)}, "prompt", "maximum context length is 64"),
        ({"prompt": [1] * 50, "params": dict(max_tokens=20)}, "max_tokens",
         "70 were requested (50 in the prompt, max_tokens 20)"),
        ({"prompt": [1] * 40, "params": dict(max_tokens=10)}, "max_tokens",
         "could never be scheduled"),
        ({"params": dict(max_tokens=0)}, "max_tokens", ">= 1"),
        ({"params": dict(min_tokens=5, max_tokens=4)}, "min_tokens",
         "min_tokens (5) must not exceed max_tokens (4)"),
        ({"params": dict(logprobs=21)}, "logprobs", "greater than max allowed: 20"),
        ({"params": dict(temperature=-0.5)}, "temperature", ">= 0"),
        ({"params": dict(top_p=0.0)}, "top_p", "> 0"),
        ({"params": dict(top_k=-2)}, "top_k", ">= -1"),
        ({"params": dict(min_p=1.5)}, "min_p", "<= 1"),
        ({"params": dict(stop_token_ids=[-4])}, "stop_token_ids",
         "outside the vocabulary"),
        ({"params": dict(stop_token_ids=[3, 300])}, "stop_token_ids", "[300]"),
        ({"params": dict(stop=[""])}, "stop", "must not be empty"),
        ({"params": dict(stop=[3])}, "stop", "str"),
        ({"params": dict(seed=2**64)}, "seed", "64-bit"),
        ({"params": dict(max_tokens="8")}, "max_tokens", "int"),
    ],
)
def test_bad_input_is_rejected_naming_the_problem(request_fields: dict[str, Any], param: str,
                                                  words: str) -> None:
    """Sampling parameters are refused as they are built (SamplingParams checks
    itself), the rest at intake: the same way either way."""
    with pytest.raises(RequestRejected) as caught:
        if "params" in request_fields:
            request_fields = {**request_fields,
                              "params": SamplingParams(**request_fields["params"])}
        make_intake().admit(submit(**request_fields))
    assert caught.value.param == param
    assert words in caught.value.message


def test_a_prompt_over_the_whole_kv_cache_points_at_the_prompt() -> None:
    intake = Intake(EngineConfig(), make_tokenizer(), max_model_len=1000, num_kv_tokens=32,
                    vocab_size=300)
    error = rejection(intake, submit([1] * 40, params=SamplingParams(max_tokens=1)))
    assert error.param == "prompt"
    assert "the KV cache holds 32 tokens" in error.message


def test_a_priority_that_is_not_an_integer_is_rejected() -> None:
    error = rejection(make_intake(scheduling_policy="priority"), submit(priority="high"))
    assert (error.param, "priority must be an integer" in error.message) == ("priority", True)


def test_params_that_are_not_sampling_params_are_rejected() -> None:
    error = rejection(make_intake(), submit(params={"max_tokens": 3}))
    assert "must be a SamplingParams, not dict" in error.message


def test_exactly_one_prompt_form_is_required() -> None:
    both = Submit(request_id="r", prompt="hi", prompt_token_ids=[1], params=SamplingParams(),
                  arrival_time=0.0)
    neither = Submit(request_id="r", params=SamplingParams(), arrival_time=0.0)
    intake = make_intake()
    assert "got prompt, prompt_token_ids" in rejection(intake, both).message
    assert "got none" in rejection(intake, neither).message


def test_a_request_that_exactly_fits_is_admitted() -> None:
    request = make_intake().admit(submit([1] * 40, params=SamplingParams(max_tokens=8)))
    assert len(request.prompt_token_ids) + request.max_tokens == NUM_KV_TOKENS


@pytest.mark.parametrize(("max_model_len", "num_kv_tokens"), [(30, 1000), (1000, 30)])
def test_no_max_tokens_means_the_room_left_in_context_and_cache(max_model_len: int,
                                                                 num_kv_tokens: int) -> None:
    intake = Intake(EngineConfig(), make_tokenizer(), max_model_len=max_model_len,
                    num_kv_tokens=num_kv_tokens, vocab_size=300)
    request = intake.admit(submit([1] * 12, params=SamplingParams(max_tokens=None)))
    assert request.max_tokens == 30 - 12


def test_no_max_tokens_still_refuses_a_prompt_that_leaves_no_room() -> None:
    intake = Intake(EngineConfig(), make_tokenizer(), max_model_len=30, num_kv_tokens=1000,
                    vocab_size=300)
    error = rejection(intake, submit([1] * 30, params=SamplingParams(max_tokens=None)))
    assert (error.param, "leaves no room for output" in error.message) == ("prompt", True)
    error = rejection(intake, submit([1] * 12, params=SamplingParams(max_tokens=None,
                                                                      min_tokens=20)))
    assert error.param == "min_tokens"


def test_rejections_do_not_use_up_arrival_indexes() -> None:
    intake = make_intake()
    first = intake.admit(submit())
    rejection(intake, submit(""))
    second = intake.admit(submit())
    assert (first.arrival_index, second.arrival_index) == (0, 1)


# -- chat ---------------------------------------------------------------------------


def chat(messages: Any) -> Submit:
    return Submit(request_id="c", messages=messages, params=SamplingParams(), arrival_time=0.0)


def test_chat_messages_are_rendered_with_the_template_and_encoded_without_extra_specials() -> None:
    tokenizer = make_tokenizer()
    messages = [{"role": "user", "content": "Hello world"}]
    request = make_intake(tokenizer=tokenizer).admit(chat(messages))
    expected_text = "<|im_start|>user\nHello world<|im_end|>\n<|im_start|>assistant\n"
    assert request.prompt_token_ids == tokenizer.encode(expected_text, add_special_tokens=False)
    assert tokenizer.decode(request.prompt_token_ids, skip_special_tokens=False) == expected_text


@pytest.mark.parametrize(
    ("messages", "words"),
    [
        ([], "empty"),
        ([{"role": "user"}], "message 0"),
        ([{"role": "user", "content": "hi"}, {"role": 3, "content": "x"}], "message 1"),
        (["hello"], "message 0"),
    ],
)
def test_malformed_conversations_are_rejected(messages: Any, words: str) -> None:
    error = rejection(make_intake(), chat(messages))
    assert error.param == "messages"
    assert words in error.message


def test_chat_without_a_template_is_rejected() -> None:
    intake = make_intake(tokenizer=make_tokenizer(chat_template=None))
    error = rejection(intake, chat([{"role": "user", "content": "hi"}]))
    assert (error.param, "no chat template" in error.message) == ("messages", True)


def test_a_chat_prompt_too_long_points_at_the_messages() -> None:
    long_content = "Hello world, the quick brown fox. " * 20
    error = rejection(make_intake(), chat([{"role": "user", "content": long_content}]))
    assert error.param == "messages"


# -- resolution ---------------------------------------------------------------------


def test_eos_ids_join_the_stop_token_ids() -> None:
    request = make_intake().admit(submit(params=SamplingParams(stop_token_ids=[7, 2])))
    assert request.stop_token_ids == [7, 2, 0]


def test_ignore_eos_leaves_only_the_asked_stop_token_ids() -> None:
    params = SamplingParams(stop_token_ids=[7], ignore_eos=True)
    assert make_intake().admit(submit(params=params)).stop_token_ids == [7]


def test_stop_token_ids_are_banned_below_min_tokens_only_when_min_tokens_is_set() -> None:
    intake = make_intake()
    with_min = intake.admit(submit(params=SamplingParams(min_tokens=3, stop_token_ids=[7])))
    without = intake.admit(submit(params=SamplingParams(stop_token_ids=[7])))
    assert with_min.sampling.banned_token_ids == [7, 2, 0]
    assert with_min.sampling.min_tokens == 3
    assert without.sampling.banned_token_ids == []


def test_top_k_minus_one_means_off_like_zero() -> None:
    request = make_intake().admit(submit(params=SamplingParams(top_k=-1)))
    assert request.params.top_k == 0 and request.sampling.top_k == 0


def test_a_single_stop_string_is_accepted() -> None:
    params = SamplingParams(stop="fox")  # type: ignore[arg-type]
    assert make_intake().admit(submit(params=params)).params.stop == ["fox"]


def test_a_priority_is_kept_under_the_priority_policy() -> None:
    assert make_intake(scheduling_policy="priority").admit(submit(priority=-5)).priority == -5


def test_a_priority_under_fcfs_is_rejected_not_ignored() -> None:
    fcfs = make_intake(scheduling_policy="fcfs")
    assert fcfs.admit(submit(priority=0)).priority == 0
    with pytest.raises(RequestRejected) as caught:
        fcfs.admit(submit(priority=-5))
    error = caught.value
    assert error.param == "priority" and "--scheduling-policy priority" in error.message


def test_the_request_carries_what_the_engine_needs() -> None:
    tokenizer = make_tokenizer()
    params = SamplingParams(max_tokens=5, temperature=0.7, top_p=0.9, min_p=0.1, logprobs=3,
                            seed=11)
    request = make_intake(tokenizer=tokenizer).admit(submit("Hello world", params=params))
    assert request.prompt_token_ids == tokenizer.encode("Hello world")
    assert (request.request_id, request.max_tokens, request.arrival_time) == ("r", 5, 1.0)
    sampling = request.sampling
    assert (sampling.temperature, sampling.top_p, sampling.min_p) == (0.7, 0.9, 0.1)
    assert (sampling.seed, sampling.num_logprobs) == (11, 3)


def test_seeds_are_derived_deterministically_from_the_engine_seed_and_arrival() -> None:
    def seeds(engine_seed: int) -> list[int]:
        intake = make_intake(seed=engine_seed)
        return [intake.admit(submit()).sampling.seed for _ in range(4)]

    assert seeds(0) == seeds(0)
    assert len(set(seeds(0))) == 4
    assert set(seeds(0)).isdisjoint(seeds(1))
    assert all(0 <= seed < 2**63 for seed in seeds(0) + seeds(-7))
    assert seeds(3) == [derive_seed(3, index) for index in range(4)]


def test_an_explicit_seed_is_kept() -> None:
    request = make_intake().admit(submit(params=SamplingParams(seed=-3)))
    assert request.sampling.seed == -3


# -- the actor --------------------------------------------------------------------------


async def test_run_intake_admits_rejects_and_forwards_aborts() -> None:
    streams = RequestStreams()
    inbox_send, inbox_receive = trio.open_memory_channel[Any](8)
    queue_send, queue_receive = trio.open_memory_channel[Any](8)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(run_intake, inbox_receive, queue_send, streams, make_intake())
            rejected_stream = streams.open("bad")
            await inbox_send.send(submit("", request_id="bad"))
            await inbox_send.send(submit("Hello", request_id="good"))
            await inbox_send.send(Abort(request_id="good"))
            admitted = await queue_receive.receive()
            assert isinstance(admitted, Admit) and isinstance(admitted.request, Request)
            assert admitted.request.request_id == "good"
            assert await queue_receive.receive() == Abort(request_id="good")
            with pytest.raises(RequestRejected, match="empty"):
                await rejected_stream.receive()
            await inbox_send.aclose()
        with pytest.raises(trio.EndOfChannel):
            await queue_receive.receive()


# -- truncate_prompt_tokens ---------------------------------------------------------


def truncated(keep: int) -> SamplingParams:
    return SamplingParams(max_tokens=1, truncate_prompt_tokens=keep)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens() -> None:
    intake = make_intake()
    assert intake.admit(submit([5, 6, 7, 8, 9], params=truncated(2))).prompt_token_ids == [8, 9]
    assert intake.admit(submit([5, 6], params=truncated(4))).prompt_token_ids == [5, 6]
    # a text prompt over the context: encoded whole, then its end kept
    text = "the quick brown fox " * MAX_MODEL_LEN
    full = make_tokenizer().encode(text)
    assert len(full) > MAX_MODEL_LEN
    assert rejection(intake, submit(text, params=SamplingParams(max_tokens=1))).param == "prompt"
    assert intake.admit(submit(text, params=truncated(10))).prompt_token_ids == full[-10:]
    # -1: as many as the context holds, which leaves no room for output
    assert "no room for output" in rejection(intake, submit(text, params=truncated(-1))).message


def test_truncate_prompt_tokens_cuts_the_rendered_conversation() -> None:
    intake = make_intake()
    messages = [{"role": "user", "content": "Hello world, the quick brown fox."}]
    whole = intake.admit(submit(None, messages=messages)).prompt_token_ids
    cut = intake.admit(submit(None, messages=messages, params=truncated(5))).prompt_token_ids
    assert len(whole) > 5 and cut == whole[-5:]


@pytest.mark.parametrize("keep", [0, -2, MAX_MODEL_LEN + 1])
def test_a_truncation_of_no_tokens_or_over_the_context_is_rejected(keep: int) -> None:
    """Below -1 as the parameters are built (SamplingParams checks itself), the
    rest at intake."""
    with pytest.raises(RequestRejected) as caught:
        make_intake().admit(submit([5, 6, 7], params=truncated(keep)))
    assert caught.value.param == "truncate_prompt_tokens"


# -- add_special_tokens ---------------------------------------------------------------


def bos_tokenizer() -> Tokenizer:
    """The test tokenizer with a post-processor that puts <|im_start|> (id 1) first."""
    with_bos = BackendTokenizer.from_str(backend().to_str())
    with_bos.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    return Tokenizer(with_bos, special_tokens={"eos_token": "<|im_end|>"},
                     chat_template=CHATML_TEMPLATE, generation_eos_ids=[2, 0])


def admitted_ids(intake: Intake, prompt: Any, add_special_tokens: bool | None,
                 **fields: Any) -> list[int]:
    params = SamplingParams(max_tokens=1, add_special_tokens=add_special_tokens)
    return intake.admit(submit(prompt, params=params, **fields)).prompt_token_ids


def test_add_special_tokens_says_whether_the_tokenizer_adds_its_own() -> None:
    intake = make_intake(tokenizer=bos_tokenizer())
    text = "the quick brown fox"
    plain = admitted_ids(intake, text, False)
    assert admitted_ids(intake, text, None) == admitted_ids(intake, text, True) == [1, *plain]
    messages = [{"role": "user", "content": "Hello world"}]
    rendered = admitted_ids(intake, None, None, messages=messages)
    assert admitted_ids(intake, None, False, messages=messages) == rendered
    assert admitted_ids(intake, None, True, messages=messages) == [1, *rendered]
    # token ids are the prompt as given, with or without
    assert admitted_ids(intake, [5, 6], True) == admitted_ids(intake, [5, 6], False) == [5, 6]
