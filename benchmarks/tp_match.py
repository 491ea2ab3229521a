"""How often tensor parallelism N gives other greedy tokens than one rank.

Row-parallel layers add N partial sums, which rounds differently from one
full-length dot product, so logits can differ in their last bits and a near-tie
can flip a greedy token (after which the sequences diverge). This runs the same
greedy requests at TP 1 and TP N (on the CPU: gloo) and prints, as JSON:

- the share of requests whose tokens are all equal, and of tokens equal up to
  each request's first difference;
- over the steps where both runs sampled the same token from the same prefix:
  the share whose sampled-token logprob is bitwise equal, and the largest
  difference (the size of the rounding).

    python benchmarks/tp_match.py --model tiny --tensor-parallel-size 2
    python benchmarks/tp_match.py --model tiny --load-format dummy   # near-ties
    python3 benchmarks/tp_match.py --model qwen3-0.6b --load-format dummy --device cuda
"""

from __future__ import annotations

import argparse
import json
import random
import sys

import msgspec
import trio

from trio_llm.actors.messages import SamplingParams
from trio_llm.api.engine import Engine, EngineConfig


async def greedy_outputs(config: EngineConfig, prompts: list[list[int]], max_tokens: int
                         ) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    results: list[tuple[list[int], list[float]]] = [([], []) for _ in prompts]

    async def one(index: int) -> None:
        async for output in engine.generate(prompts[index], params):
            results[index][0].extend(output.token_ids)
            results[index][1].extend(entry.logprob for entry in output.logprobs or [])

    async with Engine.open(config) as engine, trio.open_nursery() as nursery:
        for index in range(len(prompts)):
            nursery.start_soon(one, index)
    return results


def compare(expected: list[tuple[list[int], list[float]]],
            found: list[tuple[list[int], list[float]]]) -> dict[str, float | int]:
    num_equal_requests = num_tokens = num_equal_tokens = 0
    num_compared = num_bitwise_equal = 0
    largest_difference = 0.0
    for (expected_ids, expected_logprobs), (found_ids, found_logprobs) in zip(expected, found,
                                                                              strict=True):
        num_equal_requests += expected_ids == found_ids
        num_tokens += len(expected_ids)
        for index, (expected_id, found_id) in enumerate(zip(expected_ids, found_ids,
                                                            strict=True)):
            if expected_id != found_id:
                break
            num_equal_tokens += 1
            num_compared += 1
            difference = abs(expected_logprobs[index] - found_logprobs[index])
            num_bitwise_equal += difference == 0.0
            largest_difference = max(largest_difference, difference)
    return {"num_requests": len(expected), "request_match_rate": num_equal_requests / len(expected),
            "num_tokens": num_tokens, "token_match_rate": num_equal_tokens / num_tokens,
            "logprob_bitwise_equal_rate": num_bitwise_equal / max(num_compared, 1),
            "largest_logprob_difference": largest_difference}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, one GPU a rank)")
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    base = EngineConfig(model=args.model, load_format=args.load_format, device=args.device,
                        num_kv_blocks=args.num_prompts * 8)
    rng = random.Random(args.seed)
    vocab_size = 2048 if args.model == "tiny" else 32000
    prompts = [[rng.randrange(3, vocab_size) for _ in range(args.prompt_len)]
               for _ in range(args.num_prompts)]
    expected = trio.run(greedy_outputs, base, prompts, args.max_tokens)
    parallel = msgspec.structs.replace(base, tensor_parallel_size=args.tensor_parallel_size)
    found = trio.run(greedy_outputs, parallel, prompts, args.max_tokens)
    result = {"model": args.model, "load_format": args.load_format, "device": args.device,
              "tensor_parallel_size": args.tensor_parallel_size, **compare(expected, found)}
    json.dump(result, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
