"""`trio-llm bench serve`: load a running server over HTTP and measure latencies.

    trio-llm bench serve --base-url http://127.0.0.1:8000 --num-prompts 200 \\
        --random-input-len 512 --random-output-len 128 --request-rate 8

The workload is random token ids drawn from a seed (the same on every
machine), sent as /v1/completions prompts with ignore_eos so every request
produces exactly its output length. Requests start at the times of a Poisson
process (``--request-rate``; inf sends them all at once), at most
``--max-concurrency`` at a time. Reported: TTFT, TPOT (per request, excluding
the first token), ITL (between streamed chunks) and end-to-end latency (mean,
median, p99, in ms), request and token throughput, and the server's prefix
cache hit rate over the run (from its /metrics).

``--dataset-name prefix_repetition`` is vLLM's shared-prefix workload:
``--prefix-repetition-num-prefixes`` random prefixes of
``--prefix-repetition-prefix-len`` tokens, each request one of them plus its
own ``--prefix-repetition-suffix-len`` random tokens, asking for
``--prefix-repetition-output-len`` tokens, in shuffled order.

One Python client process caps near 4-5k streamed tokens/s (it parses every
SSE chunk). ``--num-client-processes P`` spreads the same workload over P
processes: request i goes to process i mod P, each with its share of
``--max-concurrency``, all starting together; their results are merged into
one report, one JSON and one plot, as if one client had sent everything.
(vLLM's `bench serve` has no such flag; this one is ours.)
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import multiprocessing
import queue as queue_module
import random
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Annotated, Any, Literal

import httpx
import msgspec
import trio

from trio_llm.api.client import COMPLETIONS_PATH, CompletionClient, CompletionError

logger = logging.getLogger(__name__)

# Client processes wait this long for each other to be ready before they start.
CLIENT_START_SECONDS = 120.0


class BenchServeOptions(msgspec.Struct, frozen=True, kw_only=True):
    """Everything one run depends on. Prompt ids are drawn below ``vocab_size``;
    None finds the vocabulary (``token_pool``): the server's vocab_size (trio-llm
    reports it), else the tokenizer of ``tokenizer`` or the model (a directory,
    or a Hugging Face id in the local cache), else the ids /tokenize gives."""

    base_url: str
    model: str | None = None
    api_key: str | None = None
    num_prompts: int = 100
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    request_rate: float = math.inf
    max_concurrency: int | None = None
    seed: int = 0
    ignore_eos: bool = True
    vocab_size: int | None = None
    tokenizer: str | None = None
    show_progress: bool = True
    dataset_name: Literal["random", "prefix_repetition", "sharegpt"] = "random"
    # ShareGPT JSON (a list of {"conversations": [{"from", "value"}, ...]}): the first
    # turn is the prompt, the second's length the output's, unless sharegpt_output_len
    dataset_path: str | None = None
    sharegpt_output_len: Annotated[int, msgspec.Meta(ge=1)] | None = None
    # openai: /v1/completions with token ids; openai-chat: /v1/chat/completions with text
    backend: Literal["openai", "openai-chat"] = "openai"
    prefix_repetition_prefix_len: Annotated[int, msgspec.Meta(ge=0)] = 256
    prefix_repetition_suffix_len: Annotated[int, msgspec.Meta(ge=0)] = 256
    prefix_repetition_num_prefixes: Annotated[int, msgspec.Meta(ge=1)] = 10
    prefix_repetition_output_len: Annotated[int, msgspec.Meta(ge=1)] = 128
    num_client_processes: Annotated[int, msgspec.Meta(ge=1)] = 1


class BenchRequest(msgspec.Struct, frozen=True):
    prompt_token_ids: list[int]
    max_tokens: int
    prompt_text: str | None = None  # what a chat message carries (openai-chat)


class TokenPool(msgspec.Struct, frozen=True, kw_only=True):
    """The ids prompts are drawn from: every id below ``vocab_size``, or
    ``token_ids`` (those /tokenize gave); ``source`` says where they came from."""

    vocab_size: int = 0
    token_ids: list[int] = []
    source: str = ""

    def ids(self) -> Sequence[int]:
        return self.token_ids or range(self.vocab_size)


class RequestResult(msgspec.Struct, kw_only=True):
    """One request as the client saw it; times in seconds."""

    success: bool
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    start: float = 0.0  # when it was sent, from the run's start
    ttft: float = 0.0
    itl: list[float] = []
    latency: float = 0.0


class LatencyStats(msgspec.Struct, frozen=True, kw_only=True):
    """Milliseconds."""

    mean: float
    median: float
    p99: float


class BenchServeReport(msgspec.Struct, frozen=True, kw_only=True):
    num_completed: int
    num_failed: int
    duration: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    max_concurrency: int | None
    request_rate: float
    num_client_processes: int
    ttft_ms: LatencyStats
    tpot_ms: LatencyStats
    itl_ms: LatencyStats
    e2e_latency_ms: LatencyStats
    # hits / queries of the server's prefix cache over the run; None if it reports none
    prefix_cache_hit_rate: float | None = None


# -- the workload ------------------------------------------------------------------------


def random_requests(*, seed: int, num_prompts: int, input_len: int, output_len: int,
                    range_ratio: float, vocab_size: int = 0,
                    token_ids: Sequence[int] = ()) -> list[BenchRequest]:
    """Random prompts from a seed, their ids below ``vocab_size`` (or drawn from
    ``token_ids``). Lengths are uniform in [len * (1 - range_ratio),
    len * (1 + range_ratio)], at least 1."""
    rng = random.Random(seed)
    pool = token_ids or range(vocab_size)
    requests = []
    for _ in range(num_prompts):
        num_prompt_tokens = _random_length(rng, input_len, range_ratio)
        requests.append(BenchRequest(
            # choice over a range draws what randrange would: the same prompts
            prompt_token_ids=[rng.choice(pool) for _ in range(num_prompt_tokens)],
            max_tokens=_random_length(rng, output_len, range_ratio),
        ))
    return requests


def prefix_repetition_requests(*, seed: int, num_prompts: int, prefix_len: int,
                               suffix_len: int, num_prefixes: int, output_len: int,
                               vocab_size: int = 0,
                               token_ids: Sequence[int] = ()) -> list[BenchRequest]:
    """vLLM's prefix_repetition shape: request ``i`` is prefix ``i % num_prefixes``
    plus its own random suffix, shuffled. (vLLM makes ``num_prompts // num_prefixes``
    per prefix and drops the rest; here every prompt is made.)"""
    rng = random.Random(seed)
    pool = token_ids or range(vocab_size)
    prefixes = [[rng.choice(pool) for _ in range(prefix_len)]
                for _ in range(num_prefixes)]
    requests = [BenchRequest(
        prompt_token_ids=prefixes[index % num_prefixes]
        + [rng.choice(pool) for _ in range(suffix_len)],
        max_tokens=output_len) for index in range(num_prompts)]
    rng.shuffle(requests)
    return requests


def workload_requests(options: BenchServeOptions, pool: TokenPool) -> list[BenchRequest]:
    if options.dataset_name == "prefix_repetition":
        return prefix_repetition_requests(
            seed=options.seed, num_prompts=options.num_prompts,
            prefix_len=options.prefix_repetition_prefix_len,
            suffix_len=options.prefix_repetition_suffix_len,
            num_prefixes=options.prefix_repetition_num_prefixes,
            output_len=options.prefix_repetition_output_len, token_ids=pool.ids())
    return random_requests(
        seed=options.seed, num_prompts=options.num_prompts,
        input_len=options.random_input_len, output_len=options.random_output_len,
        range_ratio=options.random_range_ratio, token_ids=pool.ids())


def ideal_prefix_cache_hit_rate(options: BenchServeOptions) -> float | None:
    """The hit rate if every request but the first of each prefix found its whole
    prefix cached (block rounding aside); None for workloads without shared prefixes."""
    if options.dataset_name != "prefix_repetition" or options.num_prompts == 0:
        return None
    num_prefixes = min(options.prefix_repetition_num_prefixes, options.num_prompts)
    prompt_len = options.prefix_repetition_prefix_len + options.prefix_repetition_suffix_len
    ideal_hits = (options.num_prompts - num_prefixes) * options.prefix_repetition_prefix_len
    return ideal_hits / max(options.num_prompts * prompt_len, 1)


def _random_length(rng: random.Random, length: int, range_ratio: float) -> int:
    low = max(1, math.floor(length * (1 - range_ratio)))
    high = max(low, math.ceil(length * (1 + range_ratio)))
    return rng.randint(low, high)


def arrival_offsets(*, seed: int, num_requests: int, request_rate: float) -> list[float]:
    """Start times (seconds from the start) of a Poisson process of ``request_rate``
    requests per second; all zero when the rate is infinite."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed + 1)
    offsets, now = [], 0.0
    for _ in range(num_requests):
        offsets.append(now)
        now += rng.expovariate(request_rate)
    return offsets


# -- measuring -------------------------------------------------------------------------


CHAT_PATH = "/v1/chat/completions"


async def timed_request(client: CompletionClient, request: BenchRequest, *,
                        model: str | None, ignore_eos: bool,
                        clock_start: float = 0.0, backend: str = "openai") -> RequestResult:
    """Stream one request; never raises for a failed request (the result says so).
    ``start`` is when it was sent, from ``clock_start``. ``backend`` openai-chat
    sends the prompt's text as one user message."""
    body: dict[str, Any] = {"max_tokens": request.max_tokens,
                            "ignore_eos": ignore_eos, "temperature": 0.0,
                            "stream_options": {"include_usage": True}}
    if backend == "openai-chat":
        body["messages"] = [{"role": "user", "content": request.prompt_text or ""}]
        path = CHAT_PATH
    else:
        body["prompt"] = request.prompt_token_ids
        path = COMPLETIONS_PATH
    if model is not None:
        body["model"] = model
    start = trio.current_time()
    arrivals: list[float] = []
    num_output_tokens = None
    try:
        async with client.stream(body, path=path) as chunks:
            async for chunk in chunks:
                if chunk.text:
                    arrivals.append(chunk.arrival_time)
                if chunk.usage is not None:
                    num_output_tokens = chunk.usage.completion_tokens
    except (CompletionError, httpx.HTTPError) as error:
        return RequestResult(success=False, error=str(error) or type(error).__name__,
                             prompt_len=len(request.prompt_token_ids),
                             start=start - clock_start)
    return _result(request, start, trio.current_time(), arrivals, num_output_tokens,
                   clock_start)


def _result(request: BenchRequest, start: float, end: float, arrivals: list[float],
            num_output_tokens: int | None, clock_start: float) -> RequestResult:
    if not arrivals:
        return RequestResult(success=False, error="no output",
                             prompt_len=len(request.prompt_token_ids),
                             start=start - clock_start)
    return RequestResult(
        success=True, prompt_len=len(request.prompt_token_ids),
        output_len=num_output_tokens if num_output_tokens is not None else len(arrivals),
        start=start - clock_start, ttft=arrivals[0] - start,
        itl=[later - earlier for earlier, later in zip(arrivals, arrivals[1:], strict=False)],
        latency=end - start,
    )


async def run_benchmark(options: BenchServeOptions, *,
                        progress: Any = None) -> tuple[BenchServeReport, list[RequestResult]]:
    """Run the workload against ``options.base_url``; the report and every result."""
    async with CompletionClient(options.base_url, api_key=options.api_key) as client:
        model, pool = await _served_model(client, options)
        logger.info("prompt ids drawn from %s", pool.source)
        counters_before = await prefix_cache_counters(options)
        indices = list(range(options.num_prompts))
        start = trio.current_time()
        results = await _run_requests(client, options, model, pool, indices,
                                      options.max_concurrency, progress)
        duration = trio.current_time() - start
        counters_after = await prefix_cache_counters(options)
    return with_prefix_hit_rate(summarize(results, duration, options), counters_before,
                                counters_after), results


def with_prefix_hit_rate(report: BenchServeReport, before: tuple[float, float] | None,
                         after: tuple[float, float] | None) -> BenchServeReport:
    """The report with the server's prefix cache hit rate between two counter reads."""
    if before is None or after is None:
        return report
    num_queries, num_hits = after[0] - before[0], after[1] - before[1]
    return msgspec.structs.replace(
        report, prefix_cache_hit_rate=num_hits / num_queries if num_queries else 0.0)


async def prefix_cache_counters(options: BenchServeOptions) -> tuple[float, float] | None:
    """The server's (prefix cache queries, hits) counters, summed over its models, or
    None if its /metrics has none."""
    headers = {} if options.api_key is None else {"Authorization": f"Bearer {options.api_key}"}
    try:
        async with httpx.AsyncClient(base_url=options.base_url, headers=headers) as client:
            response = await client.get("/metrics")
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    totals = {"queries": 0.0, "hits": 0.0}
    found = set()
    for line in response.text.splitlines():
        for name in totals:
            if line.startswith(f"vllm:prefix_cache_{name}_total"):
                totals[name] += float(line.rsplit(" ", 1)[1])
                found.add(name)
    return (totals["queries"], totals["hits"]) if len(found) == 2 else None


# ShareGPT conversations vLLM's benchmark leaves out: too short to measure, or too long.
MIN_SHAREGPT_TOKENS = 4
MAX_SHAREGPT_PROMPT_TOKENS = 1024
MAX_SHAREGPT_TOTAL_TOKENS = 2048


def sharegpt_conversations(path: str, seed: int) -> list[tuple[str, str]]:
    """(prompt, reply) of every conversation of a ShareGPT JSON file with two turns
    or more, shuffled by ``seed`` as vLLM's benchmark does."""
    try:
        entries = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise SystemExit(f"trio-llm bench serve: --dataset-path {path}: {error}") from None
    pairs = [(entry["conversations"][0]["value"], entry["conversations"][1]["value"])
             for entry in entries
             if isinstance(entry, dict) and len(entry.get("conversations") or []) >= 2]
    random.Random(seed).shuffle(pairs)
    return pairs


async def sharegpt_requests(client: CompletionClient, options: BenchServeOptions,
                            model: str | None) -> list[BenchRequest]:
    """``num_prompts`` requests from the ShareGPT file, tokenized by the server: the
    prompt's ids and the reply's length as max_tokens (or --sharegpt-output-len)."""
    assert options.dataset_path is not None
    requests: list[BenchRequest] = []
    for prompt, reply in sharegpt_conversations(options.dataset_path, options.seed):
        if len(requests) == options.num_prompts:
            break
        prompt_ids = (await client.tokenize({"prompt": prompt, "model": model}))["tokens"]
        output_len = options.sharegpt_output_len or (
            await client.tokenize({"prompt": reply, "model": model}))["count"]
        if len(prompt_ids) < MIN_SHAREGPT_TOKENS or output_len < MIN_SHAREGPT_TOKENS:
            continue
        if (len(prompt_ids) > MAX_SHAREGPT_PROMPT_TOKENS
                or len(prompt_ids) + output_len > MAX_SHAREGPT_TOTAL_TOKENS):
            continue
        requests.append(BenchRequest(prompt_token_ids=prompt_ids, max_tokens=output_len,
                                     prompt_text=prompt))
    if len(requests) < options.num_prompts:
        raise SystemExit(f"trio-llm bench serve: {options.dataset_path} has "
                         f"{len(requests)} usable conversations, fewer than --num-prompts "
                         f"{options.num_prompts}")
    return requests


async def prepared_requests(client: CompletionClient, options: BenchServeOptions,
                            model: str | None, pool: TokenPool) -> list[BenchRequest]:
    """The workload's requests; for the chat backend, with their prompts as text
    (random ids decoded by the server)."""
    if options.dataset_name == "sharegpt":
        return await sharegpt_requests(client, options, model)
    requests = workload_requests(options, pool)
    if options.backend == "openai-chat":
        requests = [msgspec.structs.replace(request, prompt_text=(await client.detokenize(
            {"tokens": request.prompt_token_ids, "model": model}))["prompt"])
            for request in requests]
    return requests


async def _run_requests(client: CompletionClient, options: BenchServeOptions,
                        model: str | None, pool: TokenPool, indices: list[int],
                        max_concurrency: int | None, progress: Any) -> list[RequestResult]:
    """The workload's requests ``indices``, at their arrival times, at most
    ``max_concurrency`` at once; their results in the same order."""
    requests = await prepared_requests(client, options, model, pool)
    offsets = arrival_offsets(seed=options.seed, num_requests=len(requests),
                              request_rate=options.request_rate)
    results: list[RequestResult] = [RequestResult(success=False)] * len(indices)
    seats = trio.Semaphore(max_concurrency or max(1, len(indices)))
    start = trio.current_time()

    async def run_one(position: int, index: int) -> None:
        await trio.sleep_until(start + offsets[index])
        async with seats:
            results[position] = await timed_request(client, requests[index], model=model,
                                                    ignore_eos=options.ignore_eos,
                                                    clock_start=start,
                                                    backend=options.backend)
        if progress is not None:
            progress.update(1)

    async with trio.open_nursery() as nursery:
        for position, index in enumerate(indices):
            nursery.start_soon(run_one, position, index)
    return results


# -- several client processes ---------------------------------------------------------


class ClientShare(msgspec.Struct, frozen=True, kw_only=True):
    """What one client process runs: requests ``indices`` of the workload."""

    options: BenchServeOptions
    model: str | None
    pool: TokenPool
    indices: list[int]
    max_concurrency: int | None


class ClientOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """What one client process measured; times on the host's monotonic clock."""

    indices: list[int]
    results: list[RequestResult]
    start: float
    end: float


def client_shares(options: BenchServeOptions, model: str | None,
                  pool: TokenPool) -> list[ClientShare]:
    """Request i to process i mod P; the concurrency limit split as evenly."""
    num_processes = min(options.num_client_processes, max(1, options.num_prompts))
    shares = []
    for rank in range(num_processes):
        max_concurrency = None
        if options.max_concurrency is not None:
            max_concurrency = max(1, options.max_concurrency // num_processes
                                  + (rank < options.max_concurrency % num_processes))
        shares.append(ClientShare(options=options, model=model, pool=pool,
                                  indices=list(range(rank, options.num_prompts, num_processes)),
                                  max_concurrency=max_concurrency))
    return shares


def merge_outcomes(options: BenchServeOptions, outcomes: list[ClientOutcome],
                   ) -> tuple[BenchServeReport, list[RequestResult]]:
    """One report over every process's results, in workload order; the duration
    from the first start to the last end."""
    results: list[RequestResult] = [RequestResult(success=False)] * options.num_prompts
    first_start = min(o.start for o in outcomes)
    for outcome in outcomes:
        for index, result in zip(outcome.indices, outcome.results, strict=True):
            # each process timed its requests from its own start
            results[index] = msgspec.structs.replace(
                result, start=result.start + outcome.start - first_start)
    duration = max(o.end for o in outcomes) - first_start
    return summarize(results, duration, options), results


def _client_process(share_bytes: bytes, barrier: Any, outcomes: Any) -> None:
    """One client process: set up, wait for the others, run its share, report."""
    share = msgspec.msgpack.decode(share_bytes, type=ClientShare)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # Ctrl-C is the parent's to handle (it ends this process): no traceback here.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    async def run() -> ClientOutcome:
        async with CompletionClient(share.options.base_url,
                                    api_key=share.options.api_key) as client:
            barrier.wait(CLIENT_START_SECONDS)  # every process starts its clock together
            start = time.monotonic()
            results = await _run_requests(client, share.options, share.model,
                                          share.pool, share.indices,
                                          share.max_concurrency, None)
            return ClientOutcome(indices=share.indices, results=results, start=start,
                                 end=time.monotonic())

    outcomes.put(msgspec.msgpack.encode(trio.run(run)))


def run_benchmark_in_processes(options: BenchServeOptions
                               ) -> tuple[BenchServeReport, list[RequestResult]]:
    """The workload spread over ``options.num_client_processes`` processes."""
    async def served_model() -> tuple[str | None, TokenPool]:
        async with CompletionClient(options.base_url, api_key=options.api_key) as client:
            return await _served_model(client, options)

    model, pool = trio.run(served_model)
    logger.info("prompt ids drawn from %s", pool.source)
    counters_before = trio.run(prefix_cache_counters, options)
    shares = client_shares(options, model, pool)
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(len(shares))
    queue = context.Queue()
    # Daemons: a parent that ends however it ends takes them along (multiprocessing
    # joins the others at exit, and these ignore Ctrl-C: the parent would hang).
    processes = [context.Process(target=_client_process, daemon=True,
                                 args=(msgspec.msgpack.encode(share), barrier, queue))
                 for share in shares]
    outcomes: list[ClientOutcome] = []
    try:
        # started inside the try: an interrupt between two starts, or while the
        # line below is logged, stops those already started
        for process in processes:
            process.start()
        logger.info("%d client processes started", len(processes))
        while len(outcomes) < len(processes):
            try:
                outcomes.append(msgspec.msgpack.decode(queue.get(timeout=1.0),
                                                       type=ClientOutcome))
            except queue_module.Empty:
                if any(process.exitcode not in (None, 0) for process in processes):
                    raise CompletionError("a client process failed (see its error above)") from None
    except BaseException:
        for process in _started(processes):  # interrupted, or one failed: the rest stop now
            process.kill()
        raise
    finally:
        for process in _started(processes):
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
    report, results = merge_outcomes(options, outcomes)
    counters_after = trio.run(prefix_cache_counters, options)
    return with_prefix_hit_rate(report, counters_before, counters_after), results


def _started(processes: list[Any]) -> list[Any]:
    return [process for process in processes if process.pid is not None]


async def _served_model(client: CompletionClient,
                        options: BenchServeOptions) -> tuple[str | None, TokenPool]:
    """The model to ask for and the token ids to draw prompts from (see
    BenchServeOptions). Raises CompletionError saying what each source answered."""
    try:
        cards = await client.models()
    except CompletionError as error:
        raise CompletionError(f"GET /v1/models answered {error}") from None
    card = next((c for c in cards if c.get("id") == options.model), cards[0] if cards else {})
    model = options.model or card.get("id")
    if options.vocab_size or card.get("vocab_size"):
        size = int(options.vocab_size or card["vocab_size"])
        source = "--vocab-size" if options.vocab_size else "the server's vocab_size"
        return model, TokenPool(vocab_size=size, source=source)
    tried = [f"the server reports no vocab_size for {model!r}"]
    name = options.tokenizer or card.get("root") or model
    if name:
        size, why = local_vocab_size(name)
        if size:
            return model, TokenPool(vocab_size=size, source=f"the tokenizer of {name}")
        tried.append(why)
    token_ids, why = await _tokenized_ids(client, model)
    if token_ids:
        return model, TokenPool(token_ids=token_ids, source="/tokenize")
    tried.append(why)
    raise CompletionError("no vocabulary to draw prompts from: " + "; ".join(tried)
                          + ". Pass --vocab-size N or --tokenizer DIR")


def local_vocab_size(name: str) -> tuple[int, str]:
    """The size of the base vocabulary (added tokens aside, as vLLM draws its random
    prompts) of the tokenizer at ``name``: a directory or a Hugging Face id in the
    local cache (never downloaded). (0, why) when there is none."""
    import tokenizers

    directory = Path(name).expanduser()
    if not directory.is_dir():
        from huggingface_hub import snapshot_download

        try:
            directory = Path(snapshot_download(name, local_files_only=True))
        except Exception as error:  # any failure means: not found locally
            return 0, (f"no tokenizer of {name!r} in the local Hugging Face cache "
                       f"({type(error).__name__})")
    path = directory / "tokenizer.json"
    if not path.is_file():
        return 0, f"no tokenizer.json in {directory}"
    backend = tokenizers.Tokenizer.from_file(str(path))
    return backend.get_vocab_size(with_added_tokens=False), ""


# Text for /tokenize when nothing else gives a vocabulary: its ids are the pool.
POOL_TEXT = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs! "
    "How vexingly quick daft zebras jump; sphinx of black quartz, judge my vow. "
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ? ! ' \" @ # $ % & _ ~ ^ | "
    "Numbers: 3.14159, 2.71828, 1,000,000; dates: 2026-12-01; code: def f(x): return x ** 2"
)


async def _tokenized_ids(client: CompletionClient, model: str | None) -> tuple[list[int], str]:
    """The distinct ids of POOL_TEXT as the server's /tokenize gives them."""
    body: dict[str, Any] = {"prompt": POOL_TEXT * 4}
    if model is not None:
        body["model"] = model
    try:
        answer = await client.tokenize(body)
    except CompletionError as error:
        return [], f"POST /tokenize answered {error}"
    token_ids = sorted({int(token_id) for token_id in answer.get("tokens", [])})
    return token_ids, "" if token_ids else "POST /tokenize gave no tokens"


# -- reporting -------------------------------------------------------------------------


def summarize(results: list[RequestResult], duration: float,
              options: BenchServeOptions) -> BenchServeReport:
    done = [result for result in results if result.success]
    total_input = sum(result.prompt_len for result in done)
    total_output = sum(result.output_len for result in done)
    safe_duration = max(duration, 1e-9)
    return BenchServeReport(
        num_completed=len(done), num_failed=len(results) - len(done), duration=duration,
        total_input_tokens=total_input, total_output_tokens=total_output,
        request_throughput=len(done) / safe_duration,
        output_throughput=total_output / safe_duration,
        total_token_throughput=(total_input + total_output) / safe_duration,
        max_concurrency=options.max_concurrency, request_rate=options.request_rate,
        num_client_processes=options.num_client_processes,
        ttft_ms=latency_stats([r.ttft for r in done]),
        tpot_ms=latency_stats(time_per_output_token(done)),
        itl_ms=latency_stats([itl for r in done for itl in r.itl]),
        e2e_latency_ms=latency_stats([r.latency for r in done]),
    )


def time_per_output_token(results: list[RequestResult]) -> list[float]:
    """Seconds per output token after the first, of each request with more than one."""
    return [(r.latency - r.ttft) / (r.output_len - 1) for r in results if r.output_len > 1]


def latency_stats(seconds: list[float]) -> LatencyStats:
    """Mean, median and p99 in milliseconds (zeros for no samples)."""
    if not seconds:
        return LatencyStats(mean=0.0, median=0.0, p99=0.0)
    millis = sorted(value * 1000 for value in seconds)
    return LatencyStats(mean=statistics.fmean(millis), median=statistics.median(millis),
                        p99=percentile(millis, 99))


def percentile(sorted_values: list[float], percent: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    position = (len(sorted_values) - 1) * percent / 100
    lower = math.floor(position)
    upper = min(lower + 1, len(sorted_values) - 1)
    fraction = position - lower
    return sorted_values[lower] * (1 - fraction) + sorted_values[upper] * fraction


def format_report(report: BenchServeReport) -> str:
    rows = [
        ("Successful requests", f"{report.num_completed}"),
        ("Failed requests", f"{report.num_failed}"),
        ("Maximum request concurrency", f"{report.max_concurrency or 'unlimited'}"),
        ("Client processes", f"{report.num_client_processes}"),
        ("Request rate (req/s)", f"{report.request_rate}"),
        ("Benchmark duration (s)", f"{report.duration:.2f}"),
        ("Total input tokens", f"{report.total_input_tokens}"),
        ("Total generated tokens", f"{report.total_output_tokens}"),
        ("Request throughput (req/s)", f"{report.request_throughput:.2f}"),
        ("Output token throughput (tok/s)", f"{report.output_throughput:.2f}"),
        ("Total token throughput (tok/s)", f"{report.total_token_throughput:.2f}"),
    ]
    lines = ["{s:=^60}".format(s=" Serving Benchmark Result ")]
    lines += [f"{name:<44}{value:>16}" for name, value in rows]
    for title, short, stats in (
            ("Time to First Token", "TTFT", report.ttft_ms),
            ("Time per Output Token (excl. 1st token)", "TPOT", report.tpot_ms),
            ("Inter-token Latency", "ITL", report.itl_ms),
            ("End-to-end Latency", "E2E", report.e2e_latency_ms)):
        lines.append("{s:-^60}".format(s=f" {title} "))
        lines += [f"{f'Mean {short} (ms)':<44}{stats.mean:>16.2f}",
                  f"{f'Median {short} (ms)':<44}{stats.median:>16.2f}",
                  f"{f'P99 {short} (ms)':<44}{stats.p99:>16.2f}"]
    if report.prefix_cache_hit_rate is not None:
        lines.append("{s:-^60}".format(s=" Prefix Cache "))
        hit_rate = 100 * report.prefix_cache_hit_rate
        lines.append(f"{'Prefix cache hit rate (%)':<44}{hit_rate:>16.2f}")
    lines.append("=" * 60)
    return "\n".join(lines)


def write_json(path: Path, options: BenchServeOptions, report: BenchServeReport,
               results: list[RequestResult]) -> None:
    """The report, the options and every request's measurements."""
    document = {
        "options": msgspec.to_builtins(options),
        "report": msgspec.to_builtins(report),
        "requests": msgspec.to_builtins(results),
    }
    path.write_text(json.dumps(document, indent=2, default=str) + "\n", encoding="utf-8")


class PlotUnavailable(RuntimeError):
    """--plot needs matplotlib, which is not a dependency of trio-llm."""


def _matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError as error:
        raise PlotUnavailable("--plot needs matplotlib, which is not installed "
                              "(pip install matplotlib)") from error
    return matplotlib


PLOT_PERCENTILES = (50, 90, 99)


def plot_latencies(path: Path, results: list[RequestResult], *, title: str = "") -> None:
    """One PNG: histograms of TTFT, TPOT, ITL and end-to-end latency with their
    p50/p90/p99 lines (each axis clipped at p99.9, the values beyond marked), and
    below them output throughput and requests running over the run."""
    _matplotlib().use("Agg")
    import matplotlib.pyplot as pyplot

    done = [result for result in results if result.success]
    series = {
        "TTFT (ms)": [r.ttft * 1000 for r in done],
        "TPOT (ms)": [tpot * 1000 for tpot in time_per_output_token(done)],
        "ITL (ms)": [itl * 1000 for r in done for itl in r.itl],
        "E2E latency (ms)": [r.latency * 1000 for r in done],
    }
    figure = pyplot.figure(figsize=(11, 10))
    grid = figure.add_gridspec(3, 2)
    for position, (title, values) in enumerate(series.items()):
        axis = figure.add_subplot(grid[position // 2, position % 2])
        _histogram_with_percentiles(axis, values, title)
    _plot_over_time(figure.add_subplot(grid[2, :]), done)
    figure.suptitle(title or f"trio-llm bench serve: {len(done)} requests")
    figure.tight_layout()
    figure.savefig(path)
    pyplot.close(figure)


# Histogram axes end at this percentile: one outlier must not squash the rest.
CLIP_PERCENTILE = 99.9


def clipped(values: list[float]) -> tuple[list[float], list[float]]:
    """``values`` up to their p99.9, and the outliers beyond it."""
    if not values:
        return [], []
    limit = percentile(sorted(values), CLIP_PERCENTILE)
    return [v for v in values if v <= limit], [v for v in values if v > limit]


def _histogram_with_percentiles(axis: Any, values: list[float], title: str) -> None:
    from matplotlib.ticker import MaxNLocator

    inliers, outliers = clipped(values)
    axis.hist(inliers or [0.0], bins=40)
    axis.set_title(title)
    axis.set_ylabel("requests" if "ITL" not in title else "chunks")
    axis.yaxis.set_major_locator(MaxNLocator(integer=True))  # counts are whole
    if outliers:
        right = max(inliers or [0.0])
        axis.plot([right], [0], marker=">", color="red", clip_on=False)
        axis.annotate(f"{len(outliers)} beyond p{CLIP_PERCENTILE:g} (max {max(outliers):.1f})",
                      xy=(1.0, 0.97), xycoords="axes fraction", ha="right", va="top",
                      color="red", fontsize="small")
    ordered = sorted(values)
    for percent, style in zip(PLOT_PERCENTILES, ("--", "-.", ":"), strict=True):
        if ordered:
            value = percentile(ordered, percent)
            axis.axvline(value, color="black", linestyle=style, linewidth=1,
                         label=f"p{percent} {value:.1f}")
    if ordered:
        axis.legend(fontsize="small")


def throughput_over_time(results: list[RequestResult], num_bins: int = 60
                         ) -> tuple[list[float], list[float], list[int]]:
    """Bin starts (s), output tokens/s in each bin, and requests running at each
    bin's start. A chunk's tokens are the request's output spread evenly over
    its chunks."""
    end = max((r.start + r.latency for r in results), default=0.0)
    width = max(end / num_bins, 1e-3)
    times = [index * width for index in range(num_bins)]
    tokens = [0.0] * num_bins
    for result in results:
        arrival = result.start + result.ttft
        arrivals = [arrival]
        for gap in result.itl:
            arrival += gap
            arrivals.append(arrival)
        for moment in arrivals:
            tokens[min(int(moment / width), num_bins - 1)] += result.output_len / len(arrivals)
    running = [sum(r.start <= moment < r.start + r.latency for r in results) for moment in times]
    return times, [count / width for count in tokens], running


def _plot_over_time(axis: Any, results: list[RequestResult]) -> None:
    times, rates, running = throughput_over_time(results)
    axis.plot(times, rates, color="tab:blue", label="output tokens/s")
    axis.set_xlabel("seconds from the start")
    axis.set_ylabel("output tokens/s", color="tab:blue")
    running_axis = axis.twinx()
    running_axis.step(times, running, where="post", color="tab:orange", label="running")
    running_axis.set_ylabel("requests running", color="tab:orange")
    from matplotlib.ticker import MaxNLocator

    running_axis.yaxis.set_major_locator(MaxNLocator(integer=True))
    axis.set_title("Throughput and requests running over time")


# -- the command line -----------------------------------------------------------------


def add_bench_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `trio-llm bench serve`, named as `vllm bench serve` names them."""
    target = parser.add_argument_group("target")
    target.add_argument("--base-url", default=None,
                        help="server URL (default: http://HOST:PORT)")
    target.add_argument("--host", default="127.0.0.1")
    target.add_argument("--port", type=int, default=8000)
    target.add_argument("--model", default=None, help="model name (default: the served one)")
    target.add_argument("--api-key", default=None)
    target.add_argument("--backend", choices=["openai", "openai-chat"], default="openai",
                        help="openai: /v1/completions with token ids; openai-chat: "
                             "/v1/chat/completions with the prompt as text")
    workload = parser.add_argument_group("workload")
    workload.add_argument("--dataset-name", choices=["random", "prefix_repetition", "sharegpt"],
                          default="random")
    workload.add_argument("--dataset-path", default=None,
                          help="the ShareGPT JSON file (--dataset-name sharegpt)")
    workload.add_argument("--sharegpt-output-len", type=int, default=None,
                          help="output tokens of every ShareGPT request (default: its "
                               "reply's length)")
    workload.add_argument("--num-prompts", type=int, default=100)
    workload.add_argument("--random-input-len", type=int, default=1024)
    workload.add_argument("--random-output-len", type=int, default=128)
    workload.add_argument("--random-range-ratio", type=float, default=0.0,
                          help="lengths uniform in len*(1-r) .. len*(1+r)")
    workload.add_argument("--request-rate", type=float, default=math.inf,
                          help="Poisson arrivals per second (default inf: all at once)")
    workload.add_argument("--max-concurrency", type=int, default=None)
    workload.add_argument("--seed", type=int, default=0)
    workload.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    workload.add_argument("--vocab-size", type=int, default=None,
                          help="draw prompt ids below this (default: the server's, else "
                               "the tokenizer's, else the ids /tokenize gives)")
    workload.add_argument("--tokenizer", default=None,
                          help="tokenizer to size the vocabulary by: a directory or a "
                               "Hugging Face id in the local cache (default: the model)")
    prefixes = parser.add_argument_group("prefix_repetition dataset")
    prefixes.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    prefixes.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    prefixes.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    prefixes.add_argument("--prefix-repetition-output-len", type=int, default=128)
    workload.add_argument("--num-client-processes", type=int, default=1,
                          help="spread the load over this many client processes "
                               "(one report)")
    output = parser.add_argument_group("output")
    output.add_argument("--save-result", action="store_true",
                        help="write the results as JSON into --result-dir (vLLM's flags)")
    output.add_argument("--result-dir", type=Path, default=Path("."),
                        help="where --save-result writes")
    output.add_argument("--result-filename", default=None,
                        help="the file --save-result writes (default: "
                             "trio-llm-BACKEND-RATEqps-MODEL-DATE.json)")
    output.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="write the results as JSON to this path")
    output.add_argument("--plot", type=Path, default=None, metavar="PATH.png")
    output.add_argument("--disable-tqdm", action="store_true")


def options_from_args(args: argparse.Namespace) -> BenchServeOptions:
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    try:
        return msgspec.convert({
            "base_url": base_url, "model": args.model, "api_key": args.api_key,
            "num_prompts": args.num_prompts, "random_input_len": args.random_input_len,
            "random_output_len": args.random_output_len,
            "random_range_ratio": args.random_range_ratio, "request_rate": args.request_rate,
            "max_concurrency": args.max_concurrency, "seed": args.seed,
            "ignore_eos": args.ignore_eos, "vocab_size": args.vocab_size,
            "tokenizer": args.tokenizer,
            "show_progress": not args.disable_tqdm, "dataset_name": args.dataset_name,
            "prefix_repetition_prefix_len": args.prefix_repetition_prefix_len,
            "prefix_repetition_suffix_len": args.prefix_repetition_suffix_len,
            "prefix_repetition_num_prefixes": args.prefix_repetition_num_prefixes,
            "prefix_repetition_output_len": args.prefix_repetition_output_len,
            "num_client_processes": args.num_client_processes,
            "dataset_path": args.dataset_path, "sharegpt_output_len": args.sharegpt_output_len,
            "backend": args.backend,
        }, BenchServeOptions)
    except msgspec.ValidationError as error:
        raise SystemExit(f"trio-llm bench serve: {error}") from None


def failure_message(base_url: str, error: Exception) -> str:
    """What went wrong, in a line: the server was not reached, or what it answered."""
    if isinstance(error, httpx.TransportError):
        what = str(error) or type(error).__name__
        return f"cannot reach {base_url}: {what} (is the server running there?)"
    if isinstance(error, httpx.HTTPError):
        return f"{base_url}: {type(error).__name__}: {error}"
    return f"{base_url}: {error}"


def run_bench_serve(args: argparse.Namespace) -> int:
    """`trio-llm bench serve`: 0 if every request succeeded, 1 otherwise."""
    from trio_llm.api.bench import progress_bar

    options = options_from_args(args)
    if options.dataset_name == "sharegpt" and options.dataset_path is None:
        raise SystemExit("trio-llm bench serve: --dataset-name sharegpt needs --dataset-path "
                         "FILE (ShareGPT JSON)")
    if args.plot is not None:
        try:
            _matplotlib()
        except PlotUnavailable as error:
            raise SystemExit(f"trio-llm bench serve: {error}; rerun without --plot "
                             "or install it") from None
    # httpx logs every request at INFO: thousands of lines over the progress bar.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        if options.num_client_processes > 1:
            report, results = run_benchmark_in_processes(options)
        else:
            with progress_bar(total=options.num_prompts, disable=not options.show_progress,
                              file=sys.stderr) as progress:
                report, results = trio.run(partial(run_benchmark, options, progress=progress))
    except (httpx.TransportError, CompletionError, httpx.HTTPError) as error:
        print(f"trio-llm bench serve: {failure_message(options.base_url, error)}",
              file=sys.stderr)
        return 1
    report_failures(results)
    print(format_report(report))
    ideal_hit_rate = ideal_prefix_cache_hit_rate(options)
    if ideal_hit_rate is not None:
        print(f"{'Ideal prefix cache hit rate (%)':<44}{100 * ideal_hit_rate:>16.2f}")
    for path in result_paths(args, options, options.model or "served-model"):
        write_json(path, options, report, results)
    if args.plot is not None:
        plot_latencies(args.plot, results, title=plot_title(options, report))
    return 0 if report.num_failed == 0 else 1


# Failed requests whose error is shown before the table (the rest are counted).
NUM_FAILURES_SHOWN = 5


def report_failures(results: list[RequestResult]) -> None:
    """Failures first, on stderr, before the table: its figures leave them out."""
    failed = [result for result in results if not result.success]
    if not failed:
        return
    print(f"trio-llm bench serve: {len(failed)} of {len(results)} requests failed:",
          file=sys.stderr)
    for result in failed[:NUM_FAILURES_SHOWN]:
        print(f"  {result.error}", file=sys.stderr)


def result_paths(args: argparse.Namespace, options: BenchServeOptions, model: str) -> list[Path]:
    """Where the JSON goes: --json, and --save-result's file in --result-dir."""
    paths = [] if args.json is None else [args.json]
    if args.save_result:
        rate = "inf" if math.isinf(options.request_rate) else f"{options.request_rate:g}"
        name = args.result_filename or (
            f"trio-llm-{options.backend}-{rate}qps-{model.replace('/', '_')}-"
            f"{time.strftime('%Y%m%d-%H%M%S')}.json")
        args.result_dir.mkdir(parents=True, exist_ok=True)
        paths.append(args.result_dir / name)
    return paths


def plot_title(options: BenchServeOptions, report: BenchServeReport) -> str:
    """Model, dataset and lengths, concurrency or rate, and date: a plot read alone
    says what it measured."""
    if options.dataset_name == "sharegpt":
        lengths = f"sharegpt ({Path(options.dataset_path or '').name})"
    elif options.dataset_name == "prefix_repetition":
        lengths = (f"prefix_repetition {options.prefix_repetition_prefix_len}+"
                   f"{options.prefix_repetition_suffix_len} in, "
                   f"{options.prefix_repetition_output_len} out")
    else:
        lengths = f"random {options.random_input_len} in, {options.random_output_len} out"
    load = (f"concurrency {options.max_concurrency}" if options.max_concurrency
            else "all at once" if math.isinf(options.request_rate)
            else f"{options.request_rate:g} req/s")
    return (f"trio-llm bench serve: {options.model or 'served model'}, {lengths}, "
            f"{report.num_completed} requests, {load}, {time.strftime('%Y-%m-%d')}")
