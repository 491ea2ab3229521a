"""Warm before ready: at start the engine runs, on dummy inputs and through its own
request path (intake, queue, scheduler, runner, detokenizer), every kind of step
a request will take, so that the first real step pays no first-use cost (kernel
compilation and autotuning, allocator growth, lazy imports, first calls).

Two phases, each a set of requests with token-id prompts:

- the decode ladder: ``num_seqs`` short requests at once, whose ``max_tokens``
  are staggered so that the decode batch shrinks through every size of
  ``DECODE_SIZES`` up to ``max_num_seqs`` (a CUDA executor captures a graph for
  several of them); their prefills arrive together and run as mixed steps with
  the first decodes. The longest of them sample every way a request can (so
  every step has each): greedy, temperature with top-k/top-p/min-p, penalties,
  logit bias, logprobs, a seed, a grammar (structured outputs: its compilation
  and the mask kernel), stop strings (the detokenizer's search);
- the prefill ladder: one prompt at a time of each size class in
  ``PREFILL_SIZES`` up to the step's token budget and the context, so prefill
  steps of each size (and the long-chunk path) run once.

A front of the served layout other than the first only warms its own process
(``WarmUpPlan.front_only``): one request of each sampling kind.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING

import msgspec
import trio

from trio_llm.actors.errors import EngineError, RequestRejected
from trio_llm.actors.messages import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from trio_llm.api.engine import Engine

logger = logging.getLogger(__name__)

# Decode batch sizes visited: every size to 8, then spaced as CUDA graph sizes
# are (gpu/cuda_graphs.py), so each captured size runs at least once.
DECODE_SIZES = (*range(1, 9), *range(16, 65, 8), *range(80, 129, 16), *range(160, 257, 32),
                *range(320, 513, 64))
# Prompt lengths of the prefill ladder (and the token budget, the largest).
PREFILL_SIZES = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# Output tokens of the prefill ladder's requests (and of a front's).
WARM_UP_MAX_TOKENS = 2
# Prompt ids are drawn from the low ids (any vocabulary has them).
MAX_WARM_UP_TOKEN_ID = 100


class WarmUpPlan(msgspec.Struct, frozen=True, kw_only=True):
    """How much to warm: ``front_only`` warms a front's own process (served layout,
    API servers after the first: the core is warmed by the first)."""

    front_only: bool = False


def sampling_kinds(max_tokens: int, vocab_size: int) -> list[SamplingParams]:
    """One SamplingParams for each way a request can sample."""
    greedy = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    replace = msgspec.structs.replace
    return [
        greedy,
        replace(greedy, temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, seed=1),
        replace(greedy, temperature=0.7, presence_penalty=0.5, frequency_penalty=0.5,
                repetition_penalty=1.1, logit_bias={min(5, vocab_size - 1): 1.0}),
        replace(greedy, logprobs=5),
        replace(greedy, stop=["\n\n\n\n"]),
        replace(greedy, ignore_eos=False,
                structured_outputs=StructuredOutputsParams(json_object=True)),
    ]


def decode_ladder(max_num_seqs: int) -> list[int]:
    """Each request's max_tokens, so the decode batch visits every size of
    DECODE_SIZES up to ``max_num_seqs`` (and ``max_num_seqs`` itself), largest first:
    request i runs one step more than there are sizes above i."""
    sizes = sorted({size for size in DECODE_SIZES if size < max_num_seqs} | {max_num_seqs})
    return [1 + sum(1 for size in sizes if size > index) for index in range(max_num_seqs)]


def prefill_ladder(max_num_batched_tokens: int, max_model_len: int) -> list[int]:
    """Prompt lengths of each size class up to the step's budget and the context."""
    longest = min(max_num_batched_tokens, max_model_len - WARM_UP_MAX_TOKENS)
    return sorted({size for size in PREFILL_SIZES if size < longest} | {longest})


async def warm_up(engine: Engine, plan: WarmUpPlan) -> float:
    """Run the plan's requests to their end; returns the seconds it took."""
    start = time.perf_counter()
    vocab_size = engine.tokenizer.vocab_size
    max_token_id = max(1, min(MAX_WARM_UP_TOKEN_ID, vocab_size))
    kinds = sampling_kinds(WARM_UP_MAX_TOKENS, vocab_size)
    if engine.pooling is not None:  # an embedding model: prefills only
        for length in prefill_ladder(engine.config.max_num_batched_tokens,
                                     engine.max_model_len):
            with contextlib.suppress(RequestRejected):
                await engine.embed(_prompt(length, length, max_token_id))
        return time.perf_counter() - start
    if plan.front_only:
        await _run_all(engine, [([1 + index % (max_token_id - 1 or 1)], params)
                                for index, params in enumerate(kinds)])
    else:
        ladder = decode_ladder(engine.config.max_num_seqs)
        # The first requests run longest: one of each sampling kind in every step,
        # the rest greedy (a grammar or penalties per request cost host time).
        requests = [(_prompt(index, 1 + index % 8, max_token_id),
                     msgspec.structs.replace(kinds[index] if index < len(kinds) else kinds[0],
                                             max_tokens=max_tokens))
                    for index, max_tokens in enumerate(ladder)]
        await _run_all(engine, requests)
        for length in prefill_ladder(engine.config.max_num_batched_tokens,
                                     engine.max_model_len):
            await _run_all(engine, [(_prompt(length, length, max_token_id), kinds[0])])
    return time.perf_counter() - start


def _prompt(seed: int, length: int, max_token_id: int) -> list[int]:
    """Distinct prompts (no prefix-cache hits between them): ids from ``seed``."""
    return [(seed * 7919 + position * 31) % max_token_id for position in range(length)]


async def _run_all(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> None:
    """Run ``requests`` at once, each to its end."""
    async def run(prompt: list[int], params: SamplingParams) -> None:
        try:
            async for _ in engine.generate(prompt, params, request_id=_next_id(engine)):
                pass
        except RequestRejected as error:
            # a ladder step this engine cannot take (a small KV cache): not a path
            # a request of it will take either
            logger.debug("warm-up request refused: %s", error)
        except EngineError as error:
            logger.debug("warm-up request ended: %s", error)  # a stop, or a death (logged)

    async with trio.open_nursery() as nursery:
        for prompt, params in requests:
            nursery.start_soon(run, prompt, params)


def _next_id(engine: Engine) -> str:
    return f"warm-up-{engine._new_request_id()}"
