"""`trio-llm bench serve`: the seeded workload, Poisson arrivals, statistics, and
whole runs against a server on a loopback port."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import msgspec
import pytest
import trio
from test_http_support import FakeEngine, ServerInAThread, running_server

from trio_llm.api.bench_serve import (
    BenchServeOptions,
    PlotUnavailable,
    RequestResult,
    TokenPool,
    add_bench_serve_arguments,
    arrival_offsets,
    client_shares,
    latency_stats,
    percentile,
    plot_latencies,
    random_requests,
    run_bench_serve,
    run_benchmark,
)

TIMEOUT = 20


def test_random_requests_come_from_the_seed_alone() -> None:
    make = dict(num_prompts=50, input_len=20, output_len=10, range_ratio=0.5, vocab_size=100)
    first = random_requests(seed=3, **make)  # type: ignore[arg-type]
    assert first == random_requests(seed=3, **make)  # type: ignore[arg-type]
    assert first != random_requests(seed=4, **make)  # type: ignore[arg-type]
    assert all(10 <= len(r.prompt_token_ids) <= 30 for r in first)
    assert all(5 <= r.max_tokens <= 15 for r in first)
    assert all(0 <= token_id < 100 for r in first for token_id in r.prompt_token_ids)
    assert len({len(r.prompt_token_ids) for r in first}) > 1


def test_fixed_lengths_without_a_range_ratio() -> None:
    requests = random_requests(seed=0, num_prompts=5, input_len=7, output_len=3,
                               range_ratio=0.0, vocab_size=10)
    assert {(len(r.prompt_token_ids), r.max_tokens) for r in requests} == {(7, 3)}


def test_arrivals_are_a_poisson_process_of_the_rate() -> None:
    assert arrival_offsets(seed=0, num_requests=3, request_rate=math.inf) == [0.0] * 3
    offsets = arrival_offsets(seed=0, num_requests=4000, request_rate=20.0)
    gaps = [later - earlier for earlier, later in zip(offsets, offsets[1:], strict=False)]
    assert offsets[0] == 0.0 and min(gaps) >= 0.0
    mean_gap = sum(gaps) / len(gaps)
    assert 0.045 < mean_gap < 0.055
    # Exponential gaps: the standard deviation equals the mean.
    std = math.sqrt(sum((gap - mean_gap) ** 2 for gap in gaps) / len(gaps))
    assert 0.9 < std / mean_gap < 1.1


def test_latency_statistics_in_milliseconds() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)
    stats = latency_stats([0.001 * value for value in range(1, 101)])
    assert stats.mean == pytest.approx(50.5)
    assert stats.median == pytest.approx(50.5)
    assert stats.p99 == pytest.approx(99.01)
    assert latency_stats([]).p99 == 0.0


async def test_a_run_respects_max_concurrency_and_counts_tokens() -> None:
    engine = FakeEngine()
    with trio.fail_after(TIMEOUT):
        async with running_server(engine) as url:
            options = BenchServeOptions(base_url=url, num_prompts=12, random_input_len=6,
                                        random_output_len=4, random_range_ratio=0.5,
                                        max_concurrency=3, seed=1)
            report, results = await run_benchmark(options)
    expected = random_requests(seed=1, num_prompts=12, input_len=6, output_len=4,
                               range_ratio=0.5, vocab_size=256)
    assert (report.num_completed, report.num_failed) == (12, 0)
    assert report.total_output_tokens == sum(r.max_tokens for r in expected)
    assert report.total_input_tokens == sum(len(r.prompt_token_ids) for r in expected)
    assert [r.prompt_len for r in results] == [len(r.prompt_token_ids) for r in expected]
    assert 1 <= engine.max_num_running <= 3
    assert [s["prompt"] for s in engine.submitted] != []
    assert all(s["params"].ignore_eos for s in engine.submitted)
    assert all(len(r.itl) == r.output_len - 1 for r in results)
    assert report.ttft_ms.mean > 0 and report.e2e_latency_ms.p99 >= report.ttft_ms.p99


async def test_failed_requests_are_counted_not_raised() -> None:
    engine = FakeEngine(max_model_len=8)
    with trio.fail_after(TIMEOUT):
        async with running_server(engine) as url:
            options = BenchServeOptions(base_url=url, num_prompts=4, random_input_len=20,
                                        random_output_len=2)
            report, results = await run_benchmark(options)
    assert (report.num_completed, report.num_failed) == (0, 4)
    assert "400" in results[0].error


def test_plot_without_matplotlib_says_so(monkeypatch: pytest.MonkeyPatch,
                                         tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(PlotUnavailable, match="matplotlib"):
        plot_latencies(tmp_path / "plot.png", [])
    args = _parse(["--base-url", "http://127.0.0.1:9", "--plot", str(tmp_path / "p.png")])
    with pytest.raises(SystemExit, match="matplotlib, which is not installed"):
        run_bench_serve(args)


def test_plot_draws_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    result = RequestResult(success=True, prompt_len=3, output_len=3, ttft=0.1,
                           itl=[0.01, 0.02], latency=0.2)
    plot_latencies(tmp_path / "plot.png", [result, result])
    assert (tmp_path / "plot.png").read_bytes().startswith(b"\x89PNG")


def test_the_command_prints_the_report_and_writes_json(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str],
                                                       ) -> None:
    with ServerInAThread(FakeEngine()) as url:
        args = _parse(["--base-url", url, "--num-prompts", "5", "--random-input-len", "4",
                       "--random-output-len", "3", "--request-rate", "500",
                       "--json", str(tmp_path / "bench.json"), "--disable-tqdm"])
        assert run_bench_serve(args) == 0
    printed = capsys.readouterr().out
    for label in ("Mean TTFT (ms)", "Median TPOT (ms)", "P99 ITL (ms)", "Mean E2E (ms)",
                  "Request throughput (req/s)", "Output token throughput (tok/s)"):
        assert label in printed
    document = json.loads((tmp_path / "bench.json").read_text())
    assert document["report"]["num_completed"] == 5
    assert document["report"]["total_output_tokens"] == 15
    assert document["options"]["request_rate"] == 500
    assert len(document["requests"]) == 5


def test_several_client_processes_make_one_report(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    engine = FakeEngine()
    with ServerInAThread(engine) as url:
        args = _parse(["--base-url", url, "--num-prompts", "7", "--random-input-len", "4",
                       "--random-output-len", "3", "--max-concurrency", "3",
                       "--num-client-processes", "2", "--json", str(tmp_path / "bench.json"),
                       "--disable-tqdm"])
        assert run_bench_serve(args) == 0
    document = json.loads((tmp_path / "bench.json").read_text())
    report = document["report"]
    assert (report["num_completed"], report["num_failed"]) == (7, 0)
    assert report["total_output_tokens"] == 21 and report["num_client_processes"] == 2
    # Every request of the seeded workload was sent once, in whichever process.
    prompts = sorted(submitted["prompt"] for submitted in engine.submitted)
    expected = random_requests(seed=0, num_prompts=7, input_len=4, output_len=3,
                               range_ratio=0.0, vocab_size=256)
    assert prompts == sorted(request.prompt_token_ids for request in expected)
    assert [r["output_len"] for r in document["requests"]] == [3] * 7
    assert engine.max_num_running <= 3
    assert "Client processes" in capsys.readouterr().out


def test_client_shares_split_requests_and_concurrency() -> None:
    options = BenchServeOptions(base_url="http://x", num_prompts=10, max_concurrency=5,
                                num_client_processes=3)
    shares = client_shares(options, "m", TokenPool(vocab_size=100))
    assert [share.indices for share in shares] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert [share.max_concurrency for share in shares] == [2, 2, 1]


def test_an_unreachable_server_is_a_clear_failure(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parse(["--host", "127.0.0.1", "--port", "9", "--disable-tqdm"])
    assert run_bench_serve(args) == 1
    assert "cannot reach http://127.0.0.1:9" in capsys.readouterr().err


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_serve_arguments(parser)
    return parser.parse_args(argv)


def test_bench_throughput_prints_a_table_and_json_on_request() -> None:
    from trio_llm.api.bench import summary_table

    result = {"executor": "null", "num_requests": 256, "output_tokens_per_second": 1234.5678,
              "config": {"model": "tiny"}}
    lines = summary_table(result).splitlines()
    assert lines[0] == "trio-llm bench throughput"
    assert [line.split()[-1] for line in lines[2:]] == ["null", "256", "1,234.57"]
    assert "tiny" not in summary_table(result)


# -- any OpenAI-compatible server: the vocabulary without --vocab-size -----------------


class StubClient:
    """/v1/models and /tokenize as another server answers them."""

    def __init__(self, cards: list[dict[str, object]], tokens: list[int] | None) -> None:
        self.cards, self.tokens = cards, tokens

    async def models(self) -> list[dict[str, object]]:
        return self.cards

    async def tokenize(self, body: dict[str, object]) -> dict[str, object]:
        from trio_llm.api.client import CompletionError

        if self.tokens is None:
            raise CompletionError("Not Found", status=404)
        return {"tokens": self.tokens, "count": len(self.tokens)}


async def test_the_vocabulary_comes_from_the_tokenizer_then_from_tokenize() -> None:
    from tokenizers import Tokenizer

    from trio_llm.api.bench_serve import _served_model
    from trio_llm.api.client import CompletionError
    from trio_llm.gpu.builtin import resolve_model

    tiny = str(resolve_model("tiny"))
    vllm_card = {"id": "served", "object": "model", "root": "/nowhere/on/this/machine",
                 "max_model_len": 4096}
    options = BenchServeOptions(base_url="http://x")
    model, pool = await _served_model(
        StubClient([vllm_card], None), msgspec.structs.replace(options, tokenizer=tiny))
    expected = Tokenizer.from_file(f"{tiny}/tokenizer.json").get_vocab_size(
        with_added_tokens=False)
    assert (model, pool.vocab_size, pool.source) == ("served", expected,
                                                     f"the tokenizer of {tiny}")
    model, pool = await _served_model(StubClient([vllm_card], [9, 3, 9, 4]), options)
    assert (pool.token_ids, pool.source) == ([3, 4, 9], "/tokenize")
    with pytest.raises(CompletionError) as raised:
        await _served_model(StubClient([vllm_card], None), options)
    message = str(raised.value)
    assert "the server reports no vocab_size for 'served'" in message
    assert "no tokenizer of '/nowhere/on/this/machine' in the local Hugging Face cache" in message
    assert "POST /tokenize answered 404: Not Found" in message
    assert "--vocab-size" in message


async def test_a_run_against_a_server_without_vocab_size_draws_from_tokenize(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from quart_trio.wrappers.response import TrioResponse

    from trio_llm.api.bench_serve import POOL_TEXT
    from trio_llm.api.server import OpenAIServer

    async def vllm_models(self: OpenAIServer) -> TrioResponse:  # vLLM's card: no vocab_size
        body = {"object": "list", "data": [{"id": self.model_name, "object": "model",
                                            "root": "/not/here", "max_model_len": 64}]}
        return TrioResponse(json.dumps(body), content_type="application/json")

    monkeypatch.setattr(OpenAIServer, "models", vllm_models)
    engine = FakeEngine()
    with trio.fail_after(TIMEOUT):
        async with running_server(engine) as url:
            options = BenchServeOptions(base_url=url, num_prompts=4, random_input_len=5,
                                        random_output_len=2, seed=2)
            report, _ = await run_benchmark(options)
    assert (report.num_completed, report.num_failed) == (4, 0)
    pool = sorted({ord(char) for char in POOL_TEXT})  # the fake tokenizer's ids
    expected = random_requests(seed=2, num_prompts=4, input_len=5, output_len=2,
                               range_ratio=0.0, token_ids=pool)
    assert sorted(s["prompt"] for s in engine.submitted) == sorted(
        r.prompt_token_ids for r in expected)


async def test_errors_say_whether_the_server_was_reached() -> None:
    from trio_llm.api.bench_serve import failure_message
    from trio_llm.api.client import CompletionError

    with trio.fail_after(TIMEOUT):
        async with running_server(FakeEngine(), api_key="k") as url:
            with pytest.raises(CompletionError) as raised:
                await run_benchmark(BenchServeOptions(base_url=url, api_key="wrong"))
    message = failure_message(url, raised.value)
    assert "cannot reach" not in message  # it answered
    assert message.startswith(f"{url}: GET /v1/models answered 401: missing or wrong API key")


def test_plot_has_percentile_lines_and_a_panel_over_time(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from trio_llm.api.bench_serve import throughput_over_time

    results = [RequestResult(success=True, prompt_len=3, output_len=3, start=start, ttft=0.5,
                             itl=[0.25, 0.25], latency=1.0) for start in (0.0, 0.5, 1.0)]
    times, rates, running = throughput_over_time(results, num_bins=4)
    assert times == [0.0, 0.5, 1.0, 1.5]
    # 9 tokens in all over 2 s; at most two requests overlap
    assert sum(rate * 0.5 for rate in rates) == pytest.approx(9.0)
    assert running == [1, 2, 2, 1]
    plot_latencies(tmp_path / "plot.png", results)
    assert (tmp_path / "plot.png").read_bytes().startswith(b"\x89PNG")


# -- vLLM's habits: ShareGPT, --backend, --save-result, failures first, the plot ----------

SHAREGPT_SAMPLE = Path(__file__).parent / "data" / "sharegpt_sample.json"


def test_sharegpt_conversations_are_read_in_a_seeded_order() -> None:
    from trio_llm.api.bench_serve import sharegpt_conversations

    pairs = sharegpt_conversations(str(SHAREGPT_SAMPLE), seed=0)
    assert len(pairs) == 9  # the one-turn conversation is left out
    assert pairs == sharegpt_conversations(str(SHAREGPT_SAMPLE), seed=0)
    assert pairs != sharegpt_conversations(str(SHAREGPT_SAMPLE), seed=1)


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
async def test_a_sharegpt_run_sends_its_prompts_and_reply_lengths(backend: str) -> None:
    from trio_llm.api.bench_serve import sharegpt_conversations

    engine = FakeEngine(max_model_len=256)
    with trio.fail_after(TIMEOUT):
        async with running_server(engine) as url:
            options = BenchServeOptions(base_url=url, num_prompts=4, dataset_name="sharegpt",
                                        dataset_path=str(SHAREGPT_SAMPLE), backend=backend)
            report, _ = await run_benchmark(options)
    assert (report.num_completed, report.num_failed) == (4, 0)
    # the fake tokenizer: one token per character; "hi" (too short) is skipped
    expected = [(prompt, len(reply)) for prompt, reply in
                sharegpt_conversations(str(SHAREGPT_SAMPLE), seed=0) if len(prompt) >= 4][:4]
    sent = sorted((submitted["prompt"], submitted["params"].max_tokens)
                  for submitted in engine.submitted)
    if backend == "openai":  # token ids: the fake tokenizer's code points
        expected = [([ord(c) % 256 for c in prompt], n) for prompt, n in expected]
        assert sent == sorted(expected)
    else:  # chat: the prompt in one user turn
        assert sorted(n for _, n in sent) == sorted(n for _, n in expected)
        assert all("<user>" in prompt for prompt, _ in sent)


def test_save_result_writes_into_the_result_dir_and_failures_come_first(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with ServerInAThread(FakeEngine(max_model_len=8)) as url:
        args = _parse(["--base-url", url, "--num-prompts", "3", "--random-input-len", "20",
                       "--random-output-len", "2", "--save-result", "--result-dir",
                       str(tmp_path / "results"), "--result-filename", "run.json",
                       "--disable-tqdm"])
        assert run_bench_serve(args) == 1
    captured = capsys.readouterr()
    assert "3 of 3 requests failed" in captured.err and "400" in captured.err
    document = json.loads((tmp_path / "results" / "run.json").read_text())
    assert document["report"]["num_failed"] == 3
    default_name = _parse(["--save-result"])
    assert default_name.result_dir == Path(".")


def test_help_shows_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    from trio_llm.api.cli import _build_parser

    with pytest.raises(SystemExit):
        _build_parser().parse_args(["bench", "serve", "--help"])
    help_text = capsys.readouterr().out
    assert "(default: 8000)" in help_text and "(default: random)" in help_text


def test_the_plot_title_says_what_was_measured_and_axes_clip_at_p99_9() -> None:
    from trio_llm.api.bench_serve import clipped, plot_title, summarize

    options = BenchServeOptions(base_url="http://x", model="qwen3-8b", random_input_len=1024,
                                random_output_len=128, max_concurrency=64)
    report = summarize([], 1.0, options)
    title = plot_title(options, report)
    for part in ("qwen3-8b", "random 1024 in, 128 out", "concurrency 64", "20"):
        assert part in title
    inliers, outliers = clipped([1.0] * 2000 + [500.0])
    assert outliers == [500.0] and max(inliers) == 1.0


def test_bench_throughput_plots_tokens_over_time(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from trio_llm.api.bench import plot_throughput

    plot_throughput(tmp_path / "t.png", [(0.1, 3), (0.5, 2), (1.0, 4)], title="t")
    assert (tmp_path / "t.png").read_bytes().startswith(b"\x89PNG")
