"""benchmarks/fast_core_serve.py, the served layout's CPU stand-in for a GPU's pace:
its executor is the one the engine creates, and its steps run one at a time."""

import importlib.util
import signal
import sys
from pathlib import Path

import pytest
import trio

import trio_llm.actors.scheduler as scheduler_module
import trio_llm.actors.supervisor as supervisor_module
import trio_llm.api.engine as engine_module
import trio_llm.api.processes as processes
from trio_llm.actors.config import EngineConfig
from trio_llm.actors.messages import SamplingParams

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "fast_core_serve.py"


@pytest.fixture
def fast_core(monkeypatch: pytest.MonkeyPatch):
    """The script, installed; everything it patches is put back afterwards."""
    for target, name in ((engine_module, "create_executor"), (processes, "_child_command"),
                         (scheduler_module.Scheduler, "__init__"),
                         (supervisor_module.WaitingQueue, "__init__")):
        monkeypatch.setattr(target, name, getattr(target, name))
    monkeypatch.setattr(signal, "signal", lambda *args: None)
    spec = importlib.util.spec_from_file_location("fast_core_serve", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.install()
    return module


async def test_the_engine_runs_on_the_fast_executor(fast_core) -> None:
    config = EngineConfig(model="tiny", num_kv_blocks=64)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with trio.fail_after(60):
        async with engine_module.Engine.open(config) as engine:
            tokens = [token for output in [o async for o in engine.generate([3, 4, 5], params)]
                      for token in output.token_ids]
    assert tokens == [fast_core.TOKEN_ID] * 6
    assert fast_core.POLICIES["scheduler"].statistics().num_steps >= 6
    command = processes._child_command("core", config)
    assert command[:2] == [sys.executable, str(SCRIPT)] and command[2] == "core"


def test_steps_launched_together_finish_one_after_another(fast_core) -> None:
    first = fast_core.PendingStep(None)
    first_done_at = fast_core.PendingStep.device_free_at
    fast_core.PendingStep(None)
    # at least a step after the first, however late the second launch came
    assert fast_core.PendingStep.device_free_at >= first_done_at + fast_core.STEP_SECONDS
    first.wait()
