"""The engine flags of `trio-llm serve`, `generate` and `bench` become one EngineConfig."""

import argparse

import pytest

from trio_llm.api.cli import add_engine_arguments, engine_config_from_args


def config_from(*flags: str):
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return engine_config_from_args(parser.parse_args(list(flags)))


@pytest.mark.parametrize(("flags", "depth"), [((), 2), (("--async-scheduling",), 2),
                                              (("--no-async-scheduling",), 1)])
def test_async_scheduling_is_the_pipeline_depth(flags: tuple[str, ...], depth: int) -> None:
    assert config_from(*flags).pipeline_depth == depth


def test_a_pipeline_depth_other_than_1_or_2_is_refused() -> None:
    import msgspec

    from trio_llm.actors.config import EngineConfig

    with pytest.raises(msgspec.ValidationError, match="pipeline_depth"):
        msgspec.convert({"pipeline_depth": 3}, EngineConfig)


@pytest.mark.parametrize("flags", [("--tensor-parallel-size", "2"), ("-tp", "2")])
def test_tensor_parallel_size_has_vllm_s_flag_and_short_name(flags: tuple[str, ...]) -> None:
    assert config_from().tensor_parallel_size == 1
    assert config_from(*flags).tensor_parallel_size == 2


def test_max_state_snapshots_is_sized_from_memory_unless_given() -> None:
    assert config_from().max_state_snapshots is None
    assert config_from("--max-state-snapshots", "64").max_state_snapshots == 64


def test_max_state_snapshots_must_be_positive() -> None:
    with pytest.raises(SystemExit, match="--max-state-snapshots 0: must be int >= 1"):
        config_from("--max-state-snapshots", "0")


def test_decode_snapshot_interval_reaches_the_config() -> None:
    assert config_from().decode_snapshot_interval == 64
    assert config_from("--decode-snapshot-interval", "16").decode_snapshot_interval == 16
    with pytest.raises(SystemExit, match="--decode-snapshot-interval 0: must be int >= 1"):
        config_from("--decode-snapshot-interval", "0")
