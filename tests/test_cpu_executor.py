"""The CPU executor's start-up: torch's threads leave a core to the trio thread, and the
attention kernel is compiled before the first step."""

import os

import pytest
import torch

from trio_llm.actors.config import EngineConfig
from trio_llm.gpu import executor as executor_module
from trio_llm.gpu.attention import get_attention_backend


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(("num_cores", "expected"), [(1, 1), (2, 1), (8, 7)])
def test_leaves_one_core_to_the_trio_thread(monkeypatch, restore_threads, num_cores,
                                            expected):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(num_cores)),
                        raising=False)
    assert executor_module.configure_cpu_threads() == expected
    assert torch.get_num_threads() == expected


def test_omp_num_threads_wins(monkeypatch, restore_threads):
    torch.set_num_threads(3)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert executor_module.configure_cpu_threads() == 3


def test_create_warms_up_the_kernel(monkeypatch, restore_threads):
    from trio_llm.gpu import attention, cpu_attention

    calls = []
    monkeypatch.setattr(cpu_attention, "warm_up", lambda: calls.append("warm"))
    # the backend is built anew, with the recording warm-up
    monkeypatch.delitem(attention.ATTENTION_BACKENDS, "cpu", raising=False)
    executor = executor_module.ModelExecutor.create(
        EngineConfig(model="tiny", device="cpu", num_kv_blocks=8))
    assert executor.model.attention_backend.name == "cpu"
    assert calls == ["warm"]
    # the real warm-up runs the kernel once and leaves nothing behind
    monkeypatch.undo()
    get_attention_backend("cpu").warm_up()
