"""Greedy tokens with prefix caching on against off, on one model: the match rate.

A shared-prefix workload (``--num-prefixes`` system prompts of ``--prefix-len`` random
tokens, each request one of them plus ``--suffix-len`` tokens of its own, greedy,
``--output-len`` tokens, ignore_eos) runs through the in-process engine twice, caching
off then on, all requests at once. Reported: the share of requests whose output is
identical, the share of output tokens equal before each request's first divergence,
and the prefix cache hit rate of the cached run. On the CPU the match must be
complete; on CUDA a cached prefix's KV comes from another request's prefill (other
GEMM shapes), so near-ties can flip.

    python benchmarks/prefix_match.py --model qwen3-0.6b --load-format dummy
"""

from __future__ import annotations

import argparse
import json
import random

import trio
from msgspec.structs import replace

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.messages import SamplingParams
from trio_llm.api.engine import Engine


def workload(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(vocab_size) for _ in range(args.prefix_len)]
                for _ in range(args.num_prefixes)]
    return [prefixes[index % args.num_prefixes]
            + [rng.randrange(vocab_size) for _ in range(args.suffix_len)]
            for index in range(args.num_requests)]


async def generate_all(config: EngineConfig, prompts: list[list[int]],
                       output_len: int) -> tuple[list[list[int]], float]:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    outputs: list[list[int]] = [[] for _ in prompts]
    async with Engine.open(config) as engine:

        async def one(index: int) -> None:
            async for output in engine.generate(prompts[index], params):
                outputs[index] += output.token_ids

        async with trio.open_nursery() as nursery:
            for index in range(len(prompts)):
                nursery.start_soon(one, index)
        statistics = engine.statistics()
    hit_rate = statistics.num_prefix_cache_hits / max(statistics.num_prefix_cache_queries, 1)
    return outputs, hit_rate


def first_divergence(ours: list[int], theirs: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b),
                len(theirs))


async def main(args: argparse.Namespace) -> None:
    # A fixed cache: the engine with caching off still holds its memory when the one
    # with caching on is sized, so sizing from free memory would leave the second none.
    config = EngineConfig(model=args.model, load_format=args.load_format, device=args.device,
                          max_model_len=args.prefix_len + args.suffix_len + args.output_len,
                          num_kv_blocks=args.num_kv_blocks)
    from trio_llm.gpu.executor import ModelExecutor

    vocab_size = min(ModelExecutor.describe(config).vocab_size, 10000)
    prompts = workload(args, vocab_size)
    off, _ = await generate_all(replace(config, enable_prefix_caching=False), prompts,
                                args.output_len)
    on, hit_rate = await generate_all(config, prompts, args.output_len)
    divergences = [first_divergence(a, b) for a, b in zip(on, off, strict=True)]
    report = {
        "model": args.model, "device": args.device, "num_requests": len(prompts),
        "identical_requests": sum(a == b for a, b in zip(on, off, strict=True)) / len(prompts),
        "tokens_equal_before_first_divergence": sum(divergences) / (len(prompts)
                                                                    * args.output_len),
        "earliest_divergence": min(divergences),
        "prefix_cache_hit_rate": hit_rate,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--num-prefixes", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-kv-blocks", type=int, default=8192)
    trio.run(main, parser.parse_args())
