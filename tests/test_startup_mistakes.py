"""One line per mistake: every start-up mistake a user can make exits non-zero
with one line naming the fault and its fix, in every layout; a traceback only
with --log-level debug."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import trio

TIMEOUT = 120


def busy_port() -> tuple[socket.socket, str]:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    return holder, str(holder.getsockname()[1])


# (name, flags, words the one line must hold: the fault, then the fix)
MISTAKES = [
    ("missing path", ["--model", "/nonexistent/model"], ["/nonexistent/model", "built-in"]),
    ("folder that is not a model", ["--model", "{not_a_model}"],
     ["config.json", "model directory"]),
    ("unknown built-in", ["--model", "tiny2"], ["tiny2", "built-in models: tiny"]),
    ("unsupported architecture", ["--model", "{unsupported}"],
     ["unsupported architecture BertModel", "supported:"]),
    ("busy port", ["--port", "{busy_port}"], ["{busy_port}", "in use", "--port"]),
    ("--device cuda without a GPU", ["--device", "cuda"], ["--device cuda", "--device cpu"]),
    ("out-of-range flag", ["--max-num-seqs", "0"], ["--max-num-seqs 0", ">= 1"]),
    ("out-of-range port", ["--port", "70000"], ["--port 70000", "<= 65535"]),
    ("not a number", ["--port", "eighty"], ["--port", "invalid int value", "--help"]),
    ("--max-model-len beyond the model", ["--max-model-len", "10000000"],
     ["--max-model-len 10000000", "max_position_embeddings (4096)",
      "VLLM_ALLOW_LONG_MAX_MODEL_LEN"]),
    ("vLLM flag for an unsupported feature", ["--pipeline-parallel-size", "2"],
     ["--pipeline-parallel-size", "not supported by trio-llm yet", "leave it out"]),
    ("a KV cache dtype trio-llm lacks", ["--kv-cache-dtype", "fp8_e5m2"],
     ["--kv-cache-dtype fp8_e5m2", "must be one of auto, fp8, fp8_e4m3"]),
    ("a quantization trio-llm lacks", ["--quantization", "awq"],
     ["--quantization awq", "must be one of fp8"]),
    ("vLLM switch for an unsupported feature", ["--enable-lora"],
     ["--enable-lora", "not supported by trio-llm yet"]),
]


@pytest.mark.parametrize("num_api_servers", [0, 2])
@pytest.mark.parametrize(("name", "flags", "words"), MISTAKES, ids=[m[0] for m in MISTAKES])
async def test_a_start_up_mistake_is_one_line_and_a_non_zero_exit(
        name: str, flags: list[str], words: list[str], num_api_servers: int,
        tmp_path: Path) -> None:
    if name == "--device cuda without a GPU" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    not_a_model = tmp_path / "empty"
    not_a_model.mkdir()
    unsupported = tmp_path / "bert"
    unsupported.mkdir()
    (unsupported / "config.json").write_text('{"architectures": ["BertModel"]}')
    holder, port = busy_port()
    values = {"not_a_model": str(not_a_model), "unsupported": str(unsupported),
              "busy_port": port}
    # --port 0 unless the mistake names a port: 8000 may be busy on this machine
    command = [sys.executable, "-m", "trio_llm.api.cli", "serve", "--model", "tiny",
               "--api-server-count", str(num_api_servers), "--port", "0",
               *[flag.format(**values) for flag in flags]]
    env = {key: value for key, value in os.environ.items()
           if key not in ("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "TRIO_LLM_ALLOW_LONG_MAX_MODEL_LEN")}
    with holder, trio.fail_after(TIMEOUT):
        result = await trio.run_process(command, capture_stdout=True, capture_stderr=True,
                                        check=False, env=env)
    lines = result.stderr.decode().strip().splitlines()
    assert result.returncode != 0
    assert len(lines) == 1, result.stderr.decode()
    for word in words:
        assert word.format(**values) in lines[0], lines[0]


async def test_a_long_max_model_len_is_allowed_by_vllms_variable() -> None:
    from trio_llm.api.cli import _build_parser, engine_config_from_args

    args = _build_parser().parse_args(["serve", "--model", "tiny", "--max-model-len", "8192"])
    with pytest.raises(SystemExit, match="max_position_embeddings"):
        engine_config_from_args(args)
    for variable in ("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "TRIO_LLM_ALLOW_LONG_MAX_MODEL_LEN"):
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(variable, "1")
            assert engine_config_from_args(args).max_model_len == 8192


async def test_an_unexpected_failure_is_one_line_unless_debugging(tmp_path: Path) -> None:
    """A fault the checks do not foresee (a tokenizer folder without one): one
    line naming it; --log-level debug shows the traceback."""
    command = [sys.executable, "-m", "trio_llm.api.cli", "generate", "x", "--model", "tiny",
               "--tokenizer", str(tmp_path)]
    with trio.fail_after(TIMEOUT):
        quiet = await trio.run_process(command, capture_stderr=True, check=False,
                                       stdout=subprocess.DEVNULL)
        loud = await trio.run_process([*command[:4], "--log-level", "debug", *command[4:]],
                                      capture_stderr=True, check=False,
                                      stdout=subprocess.DEVNULL)
    assert quiet.returncode == 1
    assert "Traceback" not in quiet.stderr.decode()
    assert quiet.stderr.decode().strip().splitlines()[-1].startswith(
        "trio-llm: FileNotFoundError: ")
    assert loud.returncode != 0
    assert "Traceback" in loud.stderr.decode()


def test_version() -> None:
    from importlib.metadata import version

    result = subprocess.run([sys.executable, "-m", "trio_llm.api.cli", "--version"],
                            capture_output=True, check=True, timeout=TIMEOUT)
    assert result.stdout.decode().strip() == f"trio-llm {version('trio-llm')}"
