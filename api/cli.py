"""The `trio-llm` command: generate, serve, bench throughput, bench serve."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from functools import partial
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import msgspec

from trio_llm.actors.config import EngineConfig
from trio_llm.api.reasoning_parsers import REASONING_PARSERS
from trio_llm.api.server import DEFAULT_MAX_BODY_BYTES, ServerConfig
from trio_llm.api.stats_log import DEFAULT_STATS_INTERVAL_SECONDS
from trio_llm.api.tool_parsers import TOOL_PARSERS

logger = logging.getLogger(__name__)

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
    ("--quantization", str, "fp8: round an unquantized checkpoint's linear weights to e4m3 "
                            "(per-row scales); FP8 checkpoints need no flag"),
    ("--kv-cache-dtype", str, "auto (the model's dtype), or fp8 / fp8_e4m3: keys and values "
                              "in e4m3 with per-layer scales (the checkpoint's, else 1.0): "
                              "twice the tokens"),
    ("--seed", int, "seed for requests that give none"),
    ("--max-num-seqs", int, "most requests running at once"),
    ("--max-num-batched-tokens", int, "token budget of one step"),
    ("--long-prefill-token-threshold", int, "most tokens of one prompt in a step (0: no "
                                            "cap but the budget); vLLM's"),
    ("--max-model-len", int, "longest prompt + output"),
    ("--block-size", int, "tokens per KV cache block"),
    ("--num-kv-blocks", int, "KV cache blocks (default: sized from memory)"),
    ("--gpu-memory-utilization", float, "share of GPU memory for weights + KV cache"),
    ("--cpu-kv-cache-gib", float, "KV cache size on the CPU"),
    ("--scheduling-policy", str, "fcfs or priority"),
    ("--priority-preemption-threshold", int, "priority gap at which a waiting request preempts"),
    ("--max-waiting-requests", int, "bound of the waiting queue"),
    ("--max-state-snapshots", int, "models with linear-attention layers: prefix-cache states "
                                   "kept (default: sized from memory)"),
    ("--decode-snapshot-interval", int, "models with linear-attention layers: tokens between "
                                        "a decoding request's state saves (whole blocks)"),
    ("--tensor-parallel-size", int, "worker processes (GPUs) the model is split over"),
    # what one request may cost (docs/http-api.md, "Limits")
    ("--max-seq-share", float, "share of --max-num-seqs one request's choices may hold"),
    ("--max-request-choices", int, "most generations one request may ask for (prompts "
                                   "times max(n, best_of))"),
    ("--structured-outputs-max-bytes", int, "longest constraint text (schema, regex, "
                                            "grammar, choices)"),
    ("--structured-outputs-max-depth", int, "deepest nesting of a JSON schema"),
    ("--structured-outputs-max-nodes", int, "most subschemas in a JSON schema"),
    ("--structured-outputs-max-properties", int, "most optional object properties in a "
                                                 "JSON schema"),
    ("--structured-outputs-max-alternatives", int, "most enum, const and choice values"),
    ("--structured-outputs-max-repeat", int, "largest bounded repetition"),
    ("--structured-outputs-compile-timeout", float, "seconds a constraint may take to compile"),
    ("--structured-outputs-cache-mb", int, "memory of compiled grammars kept"),
    ("--runner", str, "generate (default), or pooling: serve the model as an embedding model "
                      "(/v1/embeddings)"),
]
# vLLM's older flag for the runner: --task embed is --runner pooling.
_TASK_RUNNERS = {"generate": "generate", "embed": "pooling"}

# Short names vLLM also accepts.
_FLAG_ALIASES = {"--tensor-parallel-size": ("-tp",), "--quantization": ("-q",)}


# vLLM's flags for features trio-llm does not have yet: recognized, and refused with
# one line (docs/vllm-compatibility.md lists them). A flag leaves this list when its
# feature lands.
UNSUPPORTED_VLLM_FLAGS: dict[tuple[str, ...], str] = {
    ("--enable-lora",): "LoRA adapters",
    ("--lora-modules",): "LoRA adapters",
    ("--max-loras",): "LoRA adapters",
    ("--speculative-config",): "speculative decoding",
    ("--pipeline-parallel-size", "-pp"): "pipeline parallelism",
    ("--data-parallel-size", "-dp"): "data parallelism",
    ("--enable-expert-parallel",): "expert parallelism",
    ("--trust-remote-code",): "model code from the checkpoint",
    ("--enable-sleep-mode",): "sleep mode",
    ("--cpu-offload-gb",): "weight offload to the CPU",
    ("--swap-space",): "KV swap space on the CPU (preempted requests are recomputed)",
    ("--kv-transfer-config",): "disaggregated prefill (KV transfer)",
    ("--limit-mm-per-prompt",): "multimodal inputs",
    ("--tokenizer-mode",): "tokenizer modes (the Hugging Face tokenizer is used)",
    ("--load-format-config", "--model-loader-extra-config"): "custom model loaders",
    ("--guided-decoding-backend", "--structured-outputs-config"):
        "a choice of structured-outputs backend (trio-llm has its own)",
    ("--rope-scaling", "--hf-overrides"): "overriding the model's config.json",
    ("--enable-prompt-embeds",): "prompt embeddings",
    ("--otlp-traces-endpoint",): "OpenTelemetry traces",
}


class _NotSupported(argparse.Action):
    """A vLLM flag trio-llm lacks: one line, at parse time."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        feature = next(feature for flags, feature in UNSUPPORTED_VLLM_FLAGS.items()
                       if option_string in flags)
        raise SystemExit(f"trio-llm: {option_string} ({feature}) is not supported by trio-llm "
                         f"yet: leave it out (docs/vllm-compatibility.md lists what "
                         f"trio-llm lacks)")


def add_unsupported_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Recognize vLLM's flags for features trio-llm lacks, to refuse them clearly
    rather than as "unrecognized arguments"; hidden from --help."""
    for flags in UNSUPPORTED_VLLM_FLAGS:
        parser.add_argument(*flags, nargs="?", action=_NotSupported, help=argparse.SUPPRESS,
                            dest=argparse.SUPPRESS, default=argparse.SUPPRESS)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the engine's flags; unset flags keep EngineConfig's defaults."""
    add_unsupported_vllm_flags(parser)
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
    """EngineConfig from parsed flags, checked (``check_model``); a mistake is a
    SystemExit with one line naming the flag at fault and its fix."""
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
    config = _converted_flags(given, EngineConfig)
    _check_chat_template(config.chat_template)
    check_model(config)
    return config


ConfigT = TypeVar("ConfigT")


def _converted_flags(given: dict[str, Any], kind: type[ConfigT]) -> ConfigT:
    """``given`` flags as ``kind``; an out-of-range value is one line naming its flag:
    msgspec's 'Expected `int` >= 1 - at `$.max_num_seqs`' becomes
    '--max-num-seqs 0: expected int >= 1'."""
    try:
        return msgspec.convert(given, kind)
    except msgspec.ValidationError as error:
        expected, _, location = str(error).rpartition(" - at ")
        name = location.strip("`").removeprefix("$.").split("[")[0].split(".")[0]
        if not expected or name not in given:
            raise SystemExit(f"trio-llm: invalid option: {error}") from None
        flag = "--" + name.replace("_", "-")
        if expected.startswith("Invalid enum value"):  # a Literal field: name its values
            expected = "one of " + ", ".join(map(str, _literal_values(kind, name)))
        raise SystemExit(f"trio-llm: {flag} {given[name]}: must be "
                         f"{expected.replace('`', '').removeprefix('Expected ')}") from None


def _literal_values(kind: type, name: str) -> list[object]:
    """The values field ``name`` of struct ``kind`` takes (its Literal types')."""
    import msgspec.inspect

    info = msgspec.inspect.type_info(kind)
    assert isinstance(info, msgspec.inspect.StructType)
    field_type = next(field.type for field in info.fields if field.name == name)
    types = (field_type.types if isinstance(field_type, msgspec.inspect.UnionType)
             else (field_type,))
    return [value for member in types if isinstance(member, msgspec.inspect.LiteralType)
            for value in member.values]


# vLLM's opt-in to a --max-model-len beyond the model's positions, and trio-llm's own name.
ALLOW_LONG_MAX_MODEL_LEN_VARIABLES = ("VLLM_ALLOW_LONG_MAX_MODEL_LEN",
                                      "TRIO_LLM_ALLOW_LONG_MAX_MODEL_LEN")


def check_model(config: EngineConfig) -> None:
    """The start-up mistakes about the model, each one line naming the fault and its
    fix, before any process starts: a model that is not there, a folder that is
    not a model, an architecture trio-llm does not run, a --max-model-len beyond
    the model's positions, --device cuda without a GPU."""
    from trio_llm.gpu.builtin import resolve_model
    from trio_llm.gpu.loader import check_online_quantization
    from trio_llm.gpu.models import ModelLoadError, read_model_config

    try:
        directory = resolve_model(config.model, config.revision)
    except ValueError as error:
        raise SystemExit(f"trio-llm: {error}") from None
    try:
        model_config = read_model_config(directory)
    except ModelLoadError as error:
        raise SystemExit(f"trio-llm: --model {config.model} is not a model trio-llm can "
                         f"run: {error}; give a model directory, a built-in name or a "
                         f"Hugging Face id ORG/NAME") from None
    try:
        check_online_quantization(config.quantization, model_config.quantization, directory)
    except ModelLoadError as error:
        raise SystemExit(f"trio-llm: {error}") from None
    _check_max_model_len(config, model_config.max_position_embeddings)
    _check_device(config.device)
    _check_pooling(config, directory)


def _check_pooling(config: EngineConfig, directory: Path) -> None:
    """A model run as an embedding model pools as its checkpoint says, or not at all."""
    from trio_llm.actors.pooling import PoolingConfigError, read_pooling_config

    if config.runner != "pooling":
        return
    try:
        read_pooling_config(directory)
    except PoolingConfigError as error:
        raise SystemExit(f"trio-llm: --runner pooling: {error}") from None


def _check_max_model_len(config: EngineConfig, max_position_embeddings: int) -> None:
    """vLLM's rule: no context beyond the model's positions, unless the user opts in."""
    if config.max_model_len is None or config.max_model_len <= max_position_embeddings:
        return
    if any(os.environ.get(name, "").lower() in ("1", "true")
           for name in ALLOW_LONG_MAX_MODEL_LEN_VARIABLES):
        logger.warning("--max-model-len %d is beyond the model's max_position_embeddings "
                       "(%d): outputs past it may be garbage", config.max_model_len,
                       max_position_embeddings)
        return
    raise SystemExit(
        f"trio-llm: --max-model-len {config.max_model_len} is beyond the model's "
        f"max_position_embeddings ({max_position_embeddings}): give at most "
        f"{max_position_embeddings}, or set VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 to allow it")


def _check_device(device: str) -> None:
    if device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(f"trio-llm: --device cuda, but torch {torch.__version__} finds no "
                         f"CUDA device: leave --device out (auto) or give --device cpu")


def _check_chat_template(template: str | None) -> None:
    """Fail at the command line, not when the engine starts."""
    from trio_llm.actors.tokenizer import load_chat_template

    if template is not None:
        try:
            load_chat_template(template)
        except ValueError as error:
            raise SystemExit(f"trio-llm: {error}") from None


# -- `trio-llm serve` ---------------------------------------------------------------

# `trio-llm serve` without --api-server-count: one API server for every
# CPU_CORES_PER_API_SERVER cores this process may run on, 1 to MAX_DEFAULT_API_SERVERS
# (measured, docs/performance.md, "Process layouts": on the H200 machine's 16 cores
# four API servers served 42,258 tok/s, two 25,290, one 12,660, one process 6,454;
# on the 2-core development machine one API server served twice what one process did).
CPU_CORES_PER_API_SERVER = 4
MAX_DEFAULT_API_SERVERS = 4


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the server's flags to `trio-llm serve` (the engine's are added separately)."""
    # --shutdown-grace-seconds is the engine's (EngineConfig), as --served-model-name is.
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on")
    group.add_argument("--port", type=int, default=8000,
                       help="port to listen on (0: any free port)")
    group.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    group.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                       help="largest request body accepted (HTTP 413 above)")
    group.add_argument("--shutdown-grace-seconds", type=float, default=None,
                       help="how long open requests may finish on SIGTERM (default 5)")
    group.add_argument("--enable-auto-tool-choice", action="store_true", default=None,
                       help='serve tool_choice "auto" (needs --tool-call-parser)')
    group.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                       help="how tool calls are found in generated text")
    group.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                       help="split reasoning (<think>...</think>) into reasoning_content")
    group.add_argument("--api-server-count", type=int, default=None,
                       help="API-server processes in front of one engine-core process "
                            "(0: serve everything from this one process; default: one "
                            f"per {CPU_CORES_PER_API_SERVER} CPU cores, 1 to "
                            f"{MAX_DEFAULT_API_SERVERS})")
    group.add_argument("--root-path", default=None,
                       help="path prefix stripped by a proxy in front (ASGI root_path)")
    group.add_argument("--allowed-origins", type=_string_list, default=None,
                       help='CORS: origins allowed, a JSON list (\'["*"]\') or comma '
                            "separated (default: none, CORS off)")
    group.add_argument("--allow-credentials", action="store_true", default=None,
                       help="CORS: allow credentials")
    group.add_argument("--allowed-methods", type=_string_list, default=None,
                       help='CORS: methods allowed (default ["*"])')
    group.add_argument("--allowed-headers", type=_string_list, default=None,
                       help='CORS: headers allowed (default ["*"])')
    group.add_argument("--disable-log-requests", action="store_true", default=None,
                       help="no log line per request")
    group.add_argument("--disable-log-stats", action="store_true", default=None,
                       help="no periodic stats line")
    group.add_argument("--log-stats-interval", type=float, default=None,
                       help=f"seconds between stats lines (default "
                            f"{DEFAULT_STATS_INTERVAL_SECONDS:g})")
    group.add_argument("--uvicorn-log-level", default=None,
                       choices=["critical", "error", "warning", "info", "debug", "trace"],
                       help="log level of the web server (Hypercorn); vLLM's name")


def _string_list(text: str) -> list[str]:
    """A flag's list: JSON (vLLM's form, '["a", "b"]') or comma separated."""
    if text.lstrip().startswith("["):
        try:
            return msgspec.json.decode(text, type=list[str])
        except msgspec.DecodeError as error:
            raise argparse.ArgumentTypeError(f"not a JSON list of strings: {error}") from None
    return [item.strip() for item in text.split(",") if item.strip()]


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """ServerConfig from parsed flags; raises SystemExit with the field at fault."""
    given = {field.name: getattr(args, field.name, None)
             for field in msgspec.structs.fields(ServerConfig)}
    return _converted_flags({k: v for k, v in given.items() if v is not None}, ServerConfig)


def default_api_server_count(num_cpus: int) -> int:
    """The API servers `trio-llm serve` starts unless told: see CPU_CORES_PER_API_SERVER."""
    return max(1, min(MAX_DEFAULT_API_SERVERS, num_cpus // CPU_CORES_PER_API_SERVER))


def _num_usable_cpus() -> int:
    """The cores this process may run on (a container's share, not the host's)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def run_serve(args: argparse.Namespace) -> int:
    """`trio-llm serve`: 0 after a graceful stop, 1 if the engine died. The port is
    bound first, then the model checked, so a busy port fails at once."""
    import trio

    from trio_llm.actors.errors import EngineDead
    from trio_llm.api.serving import listening_socket, serve

    config = server_config_from_args(args)
    num_api_servers = args.api_server_count
    if num_api_servers is None:
        num_api_servers = default_api_server_count(_num_usable_cpus())
    if num_api_servers < 0:
        raise SystemExit(f"trio-llm: --api-server-count {num_api_servers}: must be 0 or more")
    try:
        listener = listening_socket(config.host, config.port)
    except OSError as error:
        raise SystemExit(f"trio-llm: cannot listen on {config.host} port {config.port} "
                         f"({error.strerror}): is another server on it? Stop it, or give "
                         f"another --port") from None
    with listener:
        engine_config = engine_config_from_args(args)
        if num_api_servers > 0:
            from trio_llm.api.processes import run_served

            return run_served(engine_config, config, listener, num_api_servers=num_api_servers)
        try:
            trio.run(partial(serve, engine_config, config, listen_fd=listener.detach()))
        except EngineDead as error:
            logger.error("the engine died: %s", error)
            return 1
    return 0


# -- `trio-llm generate` ---------------------------------------------------------------


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


# -- `trio-llm bench` ------------------------------------------------------------------


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """--help with every flag's default, as vLLM's shows them (None and off left out)."""

    def _format_action(self, action: argparse.Action) -> str:
        if (action.option_strings and action.default not in (None, False, argparse.SUPPRESS)
                and "%(default)" not in (action.help or "")
                and action.help is not argparse.SUPPRESS):
            action.help = f"{action.help or ''} (default: %(default)s)".lstrip()
        return super()._format_action(action)


def add_bench_commands(commands: Any) -> None:
    """Add `bench throughput` and `bench serve` to the `trio-llm bench` parser."""
    from trio_llm.api import bench_serve

    throughput = commands.add_parser("throughput", help="in-process engine throughput",
                                     formatter_class=DefaultsHelpFormatter)
    add_engine_arguments(throughput)
    throughput.add_argument("--backend", choices=["trio-llm", "transformers"], default="trio-llm")
    throughput.add_argument("--executor", choices=["model", "null"], default="model",
                            help="null: a model that costs nothing (measures the control plane)")
    throughput.add_argument("--num-prompts", type=int, default=256)
    throughput.add_argument("--min-prompt-len", type=int, default=100)
    throughput.add_argument("--max-prompt-len", type=int, default=1024)
    throughput.add_argument("--min-output-len", type=int, default=100)
    throughput.add_argument("--max-output-len", type=int, default=1024)
    throughput.add_argument("--max-token-id", type=int, default=10000,
                            help="prompt token ids are uniform in [0, this)")
    throughput.add_argument("--temperature", type=float, default=0.6)
    throughput.add_argument("--seed-workload", type=int, default=0)
    throughput.add_argument("--json", metavar="PATH",
                            help="write the results as JSON here ('-': to stdout, no table)")
    throughput.add_argument("--no-progress", action="store_true")
    throughput.add_argument("--plot", type=Path, default=None, metavar="PATH.png",
                            help="plot output tokens/s over the run (needs matplotlib)")
    throughput.set_defaults(run=_run_bench_throughput)

    serve = commands.add_parser("serve", help="benchmark a running server over HTTP",
                                formatter_class=DefaultsHelpFormatter)
    bench_serve.add_bench_serve_arguments(serve)
    serve.set_defaults(run=bench_serve.run_bench_serve)


def _run_bench_throughput(args: argparse.Namespace) -> int:
    from trio_llm.api.bench import run_throughput

    return run_throughput(args, engine_config_from_args(args))


class _OneLineParser(argparse.ArgumentParser):
    """argparse's parser, its mistakes one line (usage is for --help)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="trio-llm", description=__doc__,
                            formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--version", action="version", version=f"trio-llm {_version()}")
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

    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="the model, as --model takes it (vLLM's `serve MODEL`)")
    _add_log_level(serve)
    add_engine_arguments(serve)
    add_serve_arguments(serve)
    serve.set_defaults(run=run_serve)

    bench_parser = commands.add_parser("bench", help="benchmarks")
    bench_commands = bench_parser.add_subparsers(dest="bench_command", required=True)
    add_bench_commands(bench_commands)
    return parser


def _add_log_level(parser: argparse.ArgumentParser) -> None:
    """``--log-level`` after the command too (`trio-llm serve --log-level debug`)."""
    parser.add_argument("--log-level", dest="command_log_level", default=None,
                        help="log level (debug, info, warning, error)")


# The shell's convention for a command ended by SIGINT.
EXIT_INTERRUPTED = 130


def _version() -> str:
    from importlib.metadata import version

    return version("trio-llm")


def main(argv: list[str] | None = None) -> int:
    """Ctrl-C ends any command with one line and EXIT_INTERRUPTED, not tracebacks
    (`serve` handles it itself first: a graceful stop); any other failure is one
    line and exit 1, with its traceback only at ``--log-level debug``."""
    level = "INFO"
    try:
        args = _build_parser().parse_args(argv)
        level = (getattr(args, "command_log_level", None) or args.log_level).upper()
        logging.basicConfig(level=level, format="%(asctime)s %(name)s %(message)s")
        return int(args.run(args) or 0)
    except SystemExit:
        raise
    except BaseException as error:
        if is_interrupt(error):
            print("trio-llm: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        if level == "DEBUG":
            raise
        from trio_llm.api.serving import fault_line

        print(f"trio-llm: {fault_line(error)} (--log-level debug shows where)",
              file=sys.stderr)
        return 1


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
