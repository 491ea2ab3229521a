"""The `trio-llm` command: generate, serve, bench throughput, bench serve."""

from __future__ import annotations

import argparse
import logging
import sys

from trio_llm.actors.config import EngineConfig

# Engine flags, named as `vllm serve` names them: (flag, type, help). Each flag's
# EngineConfig field is its name in snake case, as argparse stores it.
_ENGINE_FLAGS: list[tuple[str, type, str]] = [
    ("--model", str, "model directory, Hugging Face id ORG/NAME in the local cache, or "
                     "built-in name (tiny, qwen3-0.6b, qwen3-8b)"),
    ("--revision", str, "revision of a Hugging Face id (branch, tag or commit)"),
    ("--tokenizer", str, "tokenizer directory (default: the model's)"),
    ("--chat-template", str, "chat template replacing the model's: a file, or the template "
                             "itself"),
    ("--generation-config", str, "default sampling parameters: 'auto' (the model's "
                                 "generation_config.json), 'vllm' (none) or a directory"),
    ("--max-logprobs", int, "most logprobs a request may ask for (-1: the vocabulary)"),
    ("--served-model-name", str, "model name reported by the API"),
    ("--dtype", str, "auto, float32, bfloat16 or float16"),
    ("--device", str, "auto, cpu or cuda"),
    ("--load-format", str, "auto, safetensors or dummy (random weights)"),
    ("--seed", int, "seed for requests that give none"),
    ("--max-num-seqs", int, "most requests running at once"),
    ("--max-num-batched-tokens", int, "token budget of one step"),
    ("--max-model-len", int, "longest prompt + output"),
    ("--block-size", int, "tokens per KV cache block"),
    ("--num-kv-blocks", int, "KV cache blocks (default: sized from memory)"),
    ("--gpu-memory-utilization", float, "share of GPU memory for weights + KV cache"),
    ("--cpu-kv-cache-gib", float, "KV cache size on the CPU"),
    ("--scheduling-policy", str, "fcfs or priority"),
    ("--priority-preemption-threshold", int, "priority gap at which a waiting request preempts"),
    ("--max-waiting-requests", int, "bound of the waiting queue"),
    ("--tensor-parallel-size", int, "worker processes (GPUs) the model is split over"),
    ("--runner", str, "generate (default), or pooling: serve the model as an embedding model "
                      "(/v1/embeddings)"),
]
# vLLM's older flag for the runner: --task embed is --runner pooling.
_TASK_RUNNERS = {"generate": "generate", "embed": "pooling"}

# Short names vLLM also accepts.
_FLAG_ALIASES = {"--tensor-parallel-size": ("-tp",)}


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the engine's flags; unset flags keep EngineConfig's defaults."""
    group = parser.add_argument_group("engine")
    for flag, kind, help_text in _ENGINE_FLAGS:
        group.add_argument(flag, *_FLAG_ALIASES.get(flag, ()), type=kind, default=None,
                           help=help_text)
    group.add_argument(
        "--async-scheduling",
        dest="pipeline_depth",
        action=_PipelineDepthAction,
        default=None,
        help="pipeline depth 2 (default) or 1 (--no-async-scheduling); vLLM's name",
    )
    group.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs")
    group.add_argument("--task", choices=sorted(_TASK_RUNNERS), default=None,
                       help="embed is --runner pooling, generate --runner generate (vLLM's "
                            "older name)")
    group.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reuse the KV cache of cached prompt prefixes (default; "
             "--no-enable-prefix-caching turns it off)",
    )


class _PipelineDepthAction(argparse.BooleanOptionalAction):
    """``--async-scheduling`` / ``--no-async-scheduling`` as EngineConfig.pipeline_depth."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        depth = 1 if option_string is not None and option_string.startswith("--no-") else 2
        setattr(namespace, self.dest, depth)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from parsed flags; raises SystemExit with the field at fault."""
    import msgspec

    fields = {f.name for f in msgspec.structs.fields(EngineConfig)}
    given = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    model_tag = getattr(args, "model_tag", None)
    if model_tag is not None:
        if given.get("model", model_tag) != model_tag:
            raise SystemExit(f"trio-llm: the model is given twice: {model_tag} and "
                             f"--model {given['model']}")
        given["model"] = model_tag
    task = getattr(args, "task", None)
    if task is not None:
        runner = _TASK_RUNNERS[task]
        if given.get("runner", runner) != runner:
            raise SystemExit(f"trio-llm: --task {task} contradicts --runner {given['runner']}")
        given["runner"] = runner
    try:
        config = msgspec.convert(given, EngineConfig)
    except msgspec.ValidationError as error:
        raise SystemExit(f"trio-llm: invalid engine option: {error}") from None
    _check_chat_template(config.chat_template)
    _check_hugging_face_model(config)
    return config


def _check_hugging_face_model(config: EngineConfig) -> None:
    """An ORG/NAME model not in the local cache: one line saying where it was
    looked for, at the command line rather than as a traceback from the engine."""
    from pathlib import Path

    parts = config.model.split("/")
    if Path(config.model).expanduser().exists() or len(parts) != 2 or not all(parts):
        return
    from trio_llm.gpu.builtin import resolve_model

    try:
        resolve_model(config.model, config.revision)
    except ValueError as error:
        raise SystemExit(f"trio-llm: {error}") from None

def _check_chat_template(template: str | None) -> None:
    """Fail at the command line, not when the engine starts."""
    from trio_llm.actors.tokenizer import load_chat_template

    if template is not None:
        try:
            load_chat_template(template)
        except ValueError as error:
            raise SystemExit(f"trio-llm: {error}") from None


def _run_generate(args: argparse.Namespace) -> int:
    import trio

    from trio_llm.actors.messages import SamplingParams
    from trio_llm.api.engine import Engine

    config = engine_config_from_args(args)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.sampling_seed,
        ignore_eos=args.ignore_eos,
    )

    async def generate() -> None:
        async with Engine.open(config) as engine:
            if args.chat:
                outputs = engine.chat([{"role": "user", "content": args.prompt}], params)
            else:
                outputs = engine.generate(args.prompt, params)
            async for output in outputs:
                sys.stdout.write(output.text)
                sys.stdout.flush()
            sys.stdout.write("\n")

    trio.run(generate)
    return 0


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trio-llm", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="print one completion")
    generate.add_argument("prompt")
    generate.add_argument("--max-tokens", type=int, default=32)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--sampling-seed", type=int, default=None)
    generate.add_argument("--ignore-eos", action="store_true",
                          help="go on to --max-tokens past the end-of-sequence token")
    generate.add_argument("--chat", action="store_true", help="apply the chat template")
    _add_log_level(generate)
    add_engine_arguments(generate)
    generate.set_defaults(run=_run_generate)

    from trio_llm.api import bench, server

    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="the model, as --model takes it (vLLM's `serve MODEL`)")
    _add_log_level(serve)
    add_engine_arguments(serve)
    server.add_serve_arguments(serve)
    serve.set_defaults(run=server.run_serve)

    bench_parser = commands.add_parser("bench", help="benchmarks")
    bench_commands = bench_parser.add_subparsers(dest="bench_command", required=True)
    bench.add_bench_commands(bench_commands)
    return parser


def _add_log_level(parser: argparse.ArgumentParser) -> None:
    """``--log-level`` after the command too (`trio-llm serve --log-level debug`)."""
    parser.add_argument("--log-level", dest="command_log_level", default=None,
                        help="log level (debug, info, warning, error)")


# The shell's convention for a command ended by SIGINT.
EXIT_INTERRUPTED = 130


def main(argv: list[str] | None = None) -> int:
    """Ctrl-C ends any command with one line and EXIT_INTERRUPTED, not tracebacks
    (`serve` handles it itself first: a graceful stop)."""
    try:
        args = _build_parser().parse_args(argv)
        level = (getattr(args, "command_log_level", None) or args.log_level).upper()
        logging.basicConfig(level=level, format="%(asctime)s %(name)s %(message)s")
        return int(args.run(args) or 0)
    except BaseException as error:
        if not is_interrupt(error):
            raise
        print("trio-llm: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def is_interrupt(error: BaseException) -> bool:
    """A KeyboardInterrupt, alone or in exception groups (trio's nurseries wrap it),
    with nothing else but the cancellations it caused."""
    if isinstance(error, KeyboardInterrupt):
        return True
    if not isinstance(error, BaseExceptionGroup):
        return False
    import trio

    leaves = [leaf for leaf in _leaves(error) if not isinstance(leaf, trio.Cancelled)]
    return bool(leaves) and all(isinstance(leaf, KeyboardInterrupt) for leaf in leaves)


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    leaves: list[BaseException] = []
    for error in group.exceptions:
        leaves += _leaves(error) if isinstance(error, BaseExceptionGroup) else [error]
    return leaves


if __name__ == "__main__":
    sys.exit(main())
