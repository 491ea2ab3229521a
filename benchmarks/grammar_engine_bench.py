"""xgrammar vs llguidance on the CPU: what a constrained step costs the host.

    python benchmarks/grammar_engine_bench.py [--model qwen3-0.6b] [--batch 64] [--steps 40]
    python benchmarks/grammar_engine_bench.py --through-engine [--steps 60]

For each engine: build its tokenizer view once, compile one JSON schema (cold, then
again: the cache), start ``--batch`` matchers on it and run ``--steps`` steps. A step
fills the next-token bitmask of every row (the cost that sits on the engine's critical
path), then each row takes a token drawn with a fixed seed from what its mask allows
(a random-weight model: the walk goes wherever the grammar lets it). Prints per-row
mask microseconds, one batch's milliseconds, sequential and with the engine's own
thread pool, and the compile times.

``--through-engine`` times what the scheduler itself does per step instead
(trio_llm.actors.grammar: GrammarState.next_bitmask for every row, control-character
filter included) on the schema of ``gpu_bench.py structured``; prints each step's ms.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from trio_llm.actors.tokenizer import Tokenizer
from trio_llm.gpu.builtin import resolve_model

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city"]},
        "role": {"enum": ["admin", "user", "guest"]},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "role", "address"],
}


def allowed_ids(words: np.ndarray, vocab_size: int) -> np.ndarray:
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


class Engine:
    name: str
    fill: Callable[[], None]
    fill_parallel: Callable[[], None]
    accept: Callable[[int, int], None]
    bitmask: torch.Tensor


def llguidance_engine(tokenizer: Tokenizer, vocab_size: int, batch: int) -> tuple[Engine, dict]:
    import llguidance
    import llguidance.torch as lltorch

    timings = {}
    start = time.perf_counter()
    lltok = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                   eos_token=tokenizer.eos_token_ids[0])
    timings["tokenizer_s"] = time.perf_counter() - start
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults={"whitespace_flexible": False})
    matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(batch)]
    timings["compile_s"] = time.perf_counter() - start
    assert not matchers[0].is_error(), matchers[0].get_error()
    executor = llguidance.LLExecutor()
    engine = Engine()
    engine.name = "llguidance"
    engine.bitmask = lltorch.allocate_token_bitmask(batch, vocab_size)

    def fill() -> None:
        for index, matcher in enumerate(matchers):
            lltorch.fill_next_token_bitmask(matcher, engine.bitmask, index)

    def fill_parallel() -> None:
        lltorch.fill_next_token_bitmask_par(executor,
                                            list(zip(matchers, range(batch), strict=True)),
                                            engine.bitmask)

    def accept(index: int, token_id: int) -> None:
        assert matchers[index].consume_token(token_id), matchers[index].get_error()

    engine.fill, engine.fill_parallel, engine.accept = fill, fill_parallel, accept
    return engine, timings


def xgrammar_engine(tokenizer: Tokenizer, vocab_size: int, batch: int) -> tuple[Engine, dict]:
    import transformers
    import xgrammar

    timings = {}
    start = time.perf_counter()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size,
                                                   stop_token_ids=tokenizer.eos_token_ids)
    compiler = xgrammar.GrammarCompiler(info, max_threads=1)
    timings["tokenizer_s"] = time.perf_counter() - start
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    timings["compile_s"] = time.perf_counter() - start
    start = time.perf_counter()
    compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    timings["compile_cached_s"] = time.perf_counter() - start
    matchers = [xgrammar.GrammarMatcher(compiled) for _ in range(batch)]
    batch_matcher = xgrammar.BatchGrammarMatcher(max_threads="auto")
    engine = Engine()
    engine.name = "xgrammar"
    engine.bitmask = xgrammar.allocate_token_bitmask(batch, vocab_size)

    def fill() -> None:
        for index, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(engine.bitmask, index)

    def fill_parallel() -> None:
        batch_matcher.batch_fill_next_token_bitmask(matchers, engine.bitmask)

    def accept(index: int, token_id: int) -> None:
        assert matchers[index].accept_token(token_id)

    engine.fill, engine.fill_parallel, engine.accept = fill, fill_parallel, accept
    return engine, timings


def walk(engine: Engine, vocab_size: int, batch: int, steps: int, *, parallel: bool) -> list[float]:
    rng = random.Random(0)
    fill = engine.fill_parallel if parallel else engine.fill
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        fill()
        seconds.append(time.perf_counter() - start)
        words = engine.bitmask.numpy()
        for index in range(batch):
            allowed = allowed_ids(words[index], vocab_size)
            engine.accept(index, int(allowed[rng.randrange(len(allowed))]))
    return seconds


STRUCTURED_BENCH_SCHEMA = {"type": "object", "properties": {"text": {"type": "string"},
                                                           "count": {"type": "integer"}},
                           "required": ["text", "count"]}


def through_engine(tokenizer: Tokenizer, vocab_size: int, batch: int, steps: int) -> None:
    from trio_llm.actors.grammar import Grammars
    from trio_llm.actors.messages import StructuredOutputsParams

    grammars = Grammars(tokenizer, vocab_size)
    constraint = StructuredOutputsParams(json=json.dumps(STRUCTURED_BENCH_SCHEMA))
    start = time.perf_counter()
    grammars.compile(constraint)
    print(f"compile (with the vocabulary view) {time.perf_counter() - start:.2f} s")
    states = [grammars.start(constraint) for _ in range(batch)]
    rng = random.Random(0)
    milliseconds = []
    for _ in range(steps):
        start = time.perf_counter()
        masks = [state.next_bitmask() for state in states]
        milliseconds.append((time.perf_counter() - start) * 1e3)
        for state, mask in zip(states, masks, strict=True):
            allowed = allowed_ids(np.frombuffer(mask, dtype=np.int32), vocab_size)
            state.accept(int(allowed[rng.randrange(len(allowed))]))
    print(f"masks for {batch} rows per step: median {statistics.median(milliseconds):.2f} ms, "
          f"max {max(milliseconds):.2f} ms; every step: "
          + " ".join(f"{value:.2f}" for value in milliseconds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--engines", default="xgrammar,llguidance")
    parser.add_argument("--through-engine", action="store_true")
    args = parser.parse_args()
    model_path = resolve_model(args.model)
    tokenizer = Tokenizer.from_dir(model_path)
    vocab_size = json.loads((model_path / "config.json").read_text())["vocab_size"]
    if args.through_engine:
        through_engine(tokenizer, vocab_size, args.batch, args.steps)
        return
    print(f"model {args.model}: vocab {vocab_size}, batch {args.batch}, steps {args.steps}")
    builders = {"xgrammar": xgrammar_engine, "llguidance": llguidance_engine}
    for name in args.engines.split(","):
        for parallel in (False, True):
            engine, timings = builders[name](tokenizer, vocab_size, args.batch)
            seconds = walk(engine, vocab_size, args.batch, args.steps, parallel=parallel)
            per_batch_ms = statistics.median(seconds) * 1e3
            print(f"{name:10s} {'pool' if parallel else 'seq '}: mask per row "
                  f"{per_batch_ms * 1e3 / args.batch:7.1f} us (median), batch of {args.batch} "
                  f"{per_batch_ms:6.2f} ms median / {max(seconds) * 1e3:6.2f} ms max; "
                  + ", ".join(f"{key} {value:.3f}" for key, value in timings.items()))


if __name__ == "__main__":
    main()
