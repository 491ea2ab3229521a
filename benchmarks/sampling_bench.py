"""Time one step's sampling with and without penalties, logit bias and allowed ids.

    python3 benchmarks/sampling_bench.py [--rows 8,64] [--vocab-size 151936] [--json PATH]

Every row is seeded sampling at temperature 0.8 (no top-k / top-p, so on CUDA the
fused Triton kernel serves it). Cases: ``plain``; ``penalties`` (presence,
frequency and repetition, each row's counts built from a 512-token prompt and a
256-token output); ``logit_bias`` (300 entries a row); ``allowed`` (1,000 ids a
row). Timed: the device-input sampler (gpu/cuda_sampler.py, the step's path) plus,
for penalties, the count update after it. On CUDA with CUDA events
(``triton.testing.do_bench``, median), on the CPU with the best of five wall-clock
runs (the torch path; the Triton kernel runs only interpreted there).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from trio_llm.actors.messages import SamplingOptions
from trio_llm.gpu.cuda_sampler import (
    SamplingPlan,
    record_on_device,
    sample_on_device,
)
from trio_llm.gpu.penalties import PenaltyCounts
from trio_llm.gpu.sampler import SamplingRow
from trio_llm.gpu.testing import device_sampling_inputs


def options(**fields: object) -> SamplingOptions:
    base: dict[str, object] = dict(temperature=0.8, top_p=1.0, top_k=0, min_p=0.0, seed=1,
                                   num_logprobs=None, min_tokens=0, banned_token_ids=[])
    base.update(fields)
    return SamplingOptions(**base)  # type: ignore[arg-type]


def case_rows(case: str, num_rows: int, vocab_size: int) -> list[SamplingRow]:
    generator = torch.Generator().manual_seed(0)
    if case == "penalties":
        sampling = options(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1)
        return [SamplingRow(sampling, 256, penalty_slot=row) for row in range(num_rows)]
    if case == "logit_bias":
        ids = torch.randperm(vocab_size, generator=generator)[:300].tolist()
        sampling = options(logit_bias_token_ids=ids, logit_bias_values=[1.5] * 300)
        return [SamplingRow(sampling, 256) for _ in range(num_rows)]
    if case == "allowed":
        ids = sorted(torch.randperm(vocab_size, generator=generator)[:1000].tolist())
        return [SamplingRow(options(allowed_token_ids=ids), 256) for _ in range(num_rows)]
    return [SamplingRow(options(), 256) for _ in range(num_rows)]


def time_ms(step: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(step, warmup=25, rep=200))
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def run_case(case: str, num_rows: int, vocab_size: int, device: torch.device) -> float:
    rows = case_rows(case, num_rows, vocab_size)
    counts = PenaltyCounts(vocab_size, device)
    generator = torch.Generator().manual_seed(1)
    for row in range(num_rows):
        counts.register(f"r{row}",
                        torch.randint(0, vocab_size, (512,), generator=generator).to(device),
                        torch.randint(0, vocab_size, (256,), generator=generator).to(device))
    plan = SamplingPlan.from_rows(rows, vocab_size, can_fuse=device.type == "cuda")
    inputs = device_sampling_inputs(plan, device)
    logits = torch.randn(num_rows, vocab_size, generator=generator).to(device)

    def step() -> None:
        sampled = sample_on_device(logits, plan, inputs, counts)
        record_on_device(counts, plan, inputs, sampled)

    with torch.inference_mode():
        step()
        return time_ms(step, device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="8,64")
    parser.add_argument("--vocab-size", type=int, default=151936)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)
    results = []
    for num_rows in [int(value) for value in args.rows.split(",")]:
        for case in ("plain", "penalties", "logit_bias", "allowed"):
            milliseconds = run_case(case, num_rows, args.vocab_size, device)
            results.append({"device": device.type, "rows": num_rows, "case": case,
                            "ms": round(milliseconds, 3)})
            print(f"{device.type} rows={num_rows:4d} {case:11s} {milliseconds:9.3f} ms")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(results, file, indent=1)


if __name__ == "__main__":
    main()
