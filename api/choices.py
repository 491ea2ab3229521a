"""Several choices in one response: ``n``, ``best_of`` and batched prompts.

Each choice is a request of its own in the engine (``Engine.generate_many`` /
``chat_many`` read them as one stream): the children of one prompt share its
KV blocks through the prefix cache, and each child is exactly the request a
client would send alone. Choices are numbered prompt by prompt, ``n`` per
prompt (vLLM's order); with ``best_of`` each prompt runs ``best_of`` children
and returns the ``n`` whose sampled tokens have the highest cumulative logprob.

Seeds: child 0 of a prompt keeps the request's seed (so ``n=1`` is the request
alone), child ``i`` samples with ``derive_seed(seed, i)``, so seeded children
differ from each other and a rerun gives the same choices. Unseeded children
get their own seeds at intake, as every request does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from trio_llm.actors.errors import RequestRejected
from trio_llm.actors.intake import derive_seed
from trio_llm.actors.messages import RequestOutput, SamplingParams
from trio_llm.api.protocol import (
    ChatBuilder,
    ChatCompletionResponse,
    CompletionBuilder,
    CompletionResponse,
    Usage,
)

# Engine requests per HTTP request (prompts times max(n, best_of)): the default of
# --max-request-choices (EngineConfig.max_request_choices); ours.
MAX_CHILD_REQUESTS = 256


@dataclass(frozen=True, slots=True)
class ChoicePlan:
    """How one HTTP request fans out: ``num_prompts`` prompts, ``num_candidates``
    children each, of which ``num_choices`` are returned."""

    num_prompts: int
    num_choices: int
    num_candidates: int

    @classmethod
    def of(cls, num_prompts: int, n: int, best_of: int | None, *,
           max_waiting_requests: int, max_children: int = MAX_CHILD_REQUESTS) -> ChoicePlan:
        """Refuses more children than ``max_children`` (--max-request-choices), or than
        the engine's queue holds: a request that could never be queued whole is a 400,
        not a 503."""
        plan = cls(num_prompts=num_prompts, num_choices=n, num_candidates=max(n, best_of or 1))
        limit = min(max_children, max_waiting_requests)
        if plan.num_children > limit:
            param = "n" if num_prompts == 1 else "prompt"
            flag = ("--max-request-choices" if limit == max_children
                    else "--max-waiting-requests")
            raise RequestRejected(
                f"this request asks for {plan.num_children} generations ({num_prompts} "
                f"prompts, {plan.num_candidates} each); at most {limit} ({flag})",
                param=param)
        return plan

    @property
    def num_children(self) -> int:
        return self.num_prompts * self.num_candidates

    @property
    def is_single(self) -> bool:
        """One prompt, one child: the request runs as it always did."""
        return self.num_children == 1

    @property
    def ranks_candidates(self) -> bool:
        return self.num_candidates > self.num_choices

    def prompt_of(self, child_index: int) -> int:
        return child_index // self.num_candidates

    def child_params(self, params: SamplingParams) -> list[SamplingParams]:
        """One prompt's children. Ranking needs the sampled tokens' logprobs: asked
        for even when the client did not (``strips_logprobs`` then drops them)."""
        if self.ranks_candidates and params.logprobs is None:
            params = msgspec.structs.replace(params, logprobs=0)
        return [params if index == 0 or params.seed is None
                else msgspec.structs.replace(params, seed=derive_seed(params.seed, index))
                for index in range(self.num_candidates)]


class ChoiceOutputs:
    """The outputs of every child, fed as they come; which are returned, and their usage."""

    def __init__(self, plan: ChoicePlan, *, strips_logprobs: bool) -> None:
        self.plan = plan
        self.strips_logprobs = strips_logprobs
        self.cumulative_logprobs = [0.0] * plan.num_children
        self.last_outputs: list[RequestOutput | None] = [None] * plan.num_children

    def take(self, child_index: int, output: RequestOutput) -> RequestOutput:
        """Record ``output``; returned as the client should see it."""
        self.last_outputs[child_index] = output
        if self.plan.ranks_candidates:
            self.cumulative_logprobs[child_index] += sum(
                entry.logprob for entry in output.logprobs or [] if entry is not None)
        if self.strips_logprobs and output.logprobs is not None:
            return msgspec.structs.replace(output, logprobs=None)
        return output

    def returned(self) -> list[int]:
        """The children returned, in choice order: per prompt, all of them, or with
        best_of the ``n`` of highest cumulative logprob, best first."""
        plan, chosen = self.plan, []
        for prompt_index in range(plan.num_prompts):
            children = list(range(prompt_index * plan.num_candidates,
                                  (prompt_index + 1) * plan.num_candidates))
            if plan.ranks_candidates:
                children.sort(key=lambda child: -self.cumulative_logprobs[child])
            chosen += children[:plan.num_choices]
        return chosen

    def usage(self, returned: Sequence[int]) -> Usage:
        """As vLLM counts: each prompt once, the output of the returned choices."""
        plan = self.plan
        num_prompt_tokens = sum(_last(self.last_outputs[index * plan.num_candidates])
                                .num_prompt_tokens for index in range(plan.num_prompts))
        num_output_tokens = sum(_last(self.last_outputs[child]).num_output_tokens
                                for child in returned)
        return Usage(prompt_tokens=num_prompt_tokens, completion_tokens=num_output_tokens,
                     total_tokens=num_prompt_tokens + num_output_tokens)


def _last(output: RequestOutput | None) -> RequestOutput:
    if output is None:
        raise RuntimeError("a child request produced no output")
    return output


def combined_completion(builders: Sequence[CompletionBuilder],
                        outputs: ChoiceOutputs) -> CompletionResponse:
    first = builders[0]
    choices, usage = _returned_choices(builders, outputs)
    return CompletionResponse(id=first.response_id, created=first.created, model=first.model,
                              choices=choices, usage=usage)


def combined_chat(builders: Sequence[ChatBuilder],
                  outputs: ChoiceOutputs) -> ChatCompletionResponse:
    first = builders[0]
    choices, usage = _returned_choices(builders, outputs)
    return ChatCompletionResponse(id=first.response_id, created=first.created,
                                  model=first.model, choices=choices, usage=usage,
                                  prompt_token_ids=first.prompt_token_ids_returned())


def _returned_choices(builders: Sequence[Any], outputs: ChoiceOutputs) -> tuple[list[Any], Usage]:
    """The returned children's choices, renumbered in the order returned, and their usage."""
    returned = outputs.returned()
    choices = []
    for index, child in enumerate(returned):
        choice = builders[child].response().choices[0]
        choice.index = index
        choices.append(choice)
    return choices, outputs.usage(returned)
