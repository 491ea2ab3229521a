"""benchmarks/cpu_bench.py's parts, on tiny inputs: the model it builds loads in both
engines, the padded transformers run and the engine agree token for token, and the
summary compares what it says it compares."""

import importlib.util
from pathlib import Path

import pytest
import torch

from trio_llm.actors.config import EngineConfig
from trio_llm.api.bench import WorkloadItem
from trio_llm.gpu.models import read_model_config

BENCH_PATH = Path(__file__).parent.parent / "benchmarks" / "cpu_bench.py"


@pytest.fixture(scope="module")
def cpu_bench():
    spec = importlib.util.spec_from_file_location("cpu_bench", BENCH_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def small_model(cpu_bench, tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRIO_LLM_CACHE", str(tmp_path_factory.mktemp("cache")))
        return cpu_bench.build_small_model(tmp_path_factory.mktemp("small"))


def test_builds_the_issues_model(small_model):
    config = read_model_config(small_model)
    assert (config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads,
            config.head_dim, config.vocab_size) == (256, 4, 8, 4, 32, 2048)


def test_workloads_have_the_issues_lengths(cpu_bench):
    first, second = cpu_bench.workload("first", 0), cpu_bench.workload("second", 0)
    assert len(first) == len(second) == 64
    assert all(32 <= len(item.prompt_token_ids) <= 256 and 64 <= item.max_tokens <= 128
               for item in first)
    assert all(16 <= len(item.prompt_token_ids) <= 128 and 32 <= item.max_tokens <= 128
               for item in second)


def test_engine_and_padded_transformers_give_the_same_tokens(cpu_bench, small_model):
    items = [WorkloadItem(prompt_token_ids=[(7 * index + 3 * length) % 2000 + 3
                                            for index in range(length)], max_tokens=max_tokens)
             for length, max_tokens in ((5, 9), (23, 4), (12, 12))]
    config = EngineConfig(model=str(small_model), device="cpu", dtype="float32",
                          num_kv_blocks=64)
    engine = cpu_bench.run_engine(config, items)
    transformers = cpu_bench.run_transformers(cpu_bench.load_transformers(small_model), items)
    assert [len(tokens) for tokens in engine["token_ids"]] == [9, 4, 12]
    assert engine["token_ids"] == transformers["token_ids"]
    # transformers computes the longest output for every row; only the asked-for count
    assert transformers["num_output_tokens"] == 25
    assert transformers["num_computed_tokens"] == 3 * 12


def test_count_matching_stops_at_the_first_difference(cpu_bench):
    assert cpu_bench.count_matching([[1, 2, 3], [4, 5]], [[1, 9, 3], [4, 5]]) == (3, 5)


def test_summary_takes_the_best_of_each_side(cpu_bench):
    def run(tokens_per_second, token_ids):
        return {"output_tokens_per_second": tokens_per_second, "token_ids": token_ids,
                "num_output_tokens": 2, "cpu_seconds": 0.5, "load_average": 1.0}

    rounds = [{"second/transformers/threads=1": run(100.0, [[1, 2]]),
               "second/transformers/threads=2": run(50.0, [[1, 2]]),
               "second/trio-llm/threads=1": run(300.0, [[1, 3]])}]
    summary = cpu_bench.summarise(rounds)
    assert summary["second/speedup_over_best_transformers"] == 3.0
    assert summary["second/greedy_tokens_equal_to_transformers"] == "1/2"
    assert summary["second/target_met"]
    torch.testing.assert_close(summary["second/trio-llm/threads=1"]["median"], 300)
    assert "second: second/trio-llm/threads=1 against" in cpu_bench.side_by_side(summary)


def test_summary_sets_the_first_workload_against_vllms_recorded_figure(cpu_bench):
    def run(tokens_per_second):
        return {"output_tokens_per_second": tokens_per_second, "token_ids": [[1]],
                "num_output_tokens": 2, "cpu_seconds": 0.5, "load_average": 1.0}

    rounds = [{"first/trio-llm/threads=1": run(1676.0), "first/trio-llm/threads=2": run(900.0)}]
    summary = cpu_bench.summarise(rounds)
    assert summary["first/ratio_to_vllm_cpu"] == 0.5
    assert not summary["first/target_met"]
    assert "first/trio-llm/threads=1 against vLLM" in cpu_bench.side_by_side(summary)
    assert "NOT met" in cpu_bench.side_by_side(summary)
