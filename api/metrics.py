"""Prometheus metrics of one server, under vLLM's names and labels.

A metric vLLM has carries vLLM's name (``vllm:...``) and labels (``model_name``,
``engine``), so dashboards and alerts built for vLLM read trio-llm unchanged;
what only trio-llm reports keeps a ``trio_llm:`` prefix.

Gauges and counters the engine already keeps (running, waiting, KV usage,
preemptions, token totals, prefix cache queries and hits) are read from the
engine's statistics at scrape time (``engine.fetch_statistics()``, which an API
server asks of the engine core: the one source, whatever the layout), so they
can never drift from the engine; its totals restart at zero when its warm-up is
done (``Scheduler.restart_counters``). Latency histograms are observed by the HTTP
handlers through ``RequestTimer``.

Each app gets its own CollectorRegistry: two servers in one process (tests)
never share or collide on metrics. With several API-server processes
(``--api-server-count``), the histograms and counters are summed over all of
them by prometheus-client's multiprocess mode: the process supervisor sets
``PROMETHEUS_MULTIPROC_DIR`` for every API server, each writes its samples
there, and any of them answers /metrics with the totals.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Protocol

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST
MULTIPROCESS_DIR_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"

# Bucket edges as vLLM publishes them, so dashboards built for it read ours too.
TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
INTER_TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)


class Statistics(Protocol):
    """The part of EngineStatistics the metrics read."""

    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def kv_cache_usage(self) -> float: ...
    @property
    def num_preemptions(self) -> int: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_generation_tokens(self) -> int: ...
    @property
    def num_prefix_cache_queries(self) -> int: ...
    @property
    def num_prefix_cache_hits(self) -> int: ...


# vLLM's labels: the served model's name and the engine core's index (one core: "0").
LABEL_NAMES = ("model_name", "engine")
ENGINE_INDEX = "0"


def token_count_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's 1-2-5 buckets of token counts up to ``max_model_len``: 1, 2, 5, 10, 20, ..."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class EngineCollector:
    """Reports the engine's counters (see the module docstring) from the snapshot
    taken for the scrape; nothing when the engine is dead."""

    def __init__(self, model_name: str) -> None:
        self._model_name = model_name
        self.statistics: Statistics | None = None

    def collect(self) -> Iterator[Metric]:
        stats = self.statistics
        if stats is None:
            return
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        yield self._family(gauge, "num_requests_running",
                           "Number of requests in model execution batches.", stats.num_running)
        yield self._family(gauge, "num_requests_waiting",
                           "Number of requests waiting to be processed.", stats.num_waiting)
        yield self._family(gauge, "kv_cache_usage_perc",
                           "KV-cache usage. 1 means 100 percent usage.", stats.kv_cache_usage)
        yield self._family(counter, "num_preemptions",
                           "Cumulative number of preemption from the engine.",
                           stats.num_preemptions)
        yield self._family(counter, "prompt_tokens", "Number of prefill tokens processed.",
                           stats.num_prompt_tokens)
        yield self._family(counter, "generation_tokens",
                           "Number of generation tokens processed.", stats.num_generation_tokens)
        yield self._family(counter, "prefix_cache_queries",
                           "Prefix cache queries, in terms of number of queried tokens.",
                           stats.num_prefix_cache_queries)
        yield self._family(counter, "prefix_cache_hits",
                           "Prefix cache hits, in terms of number of cached tokens.",
                           stats.num_prefix_cache_hits)

    def _family(self, kind: type[GaugeMetricFamily] | type[CounterMetricFamily], name: str,
                documentation: str, value: float) -> Metric:
        family = kind(f"vllm:{name}", documentation, labels=list(LABEL_NAMES))
        family.add_metric([self._model_name, ENGINE_INDEX], value)
        return family


class ServerMetrics:
    """Every metric of one server, in its own registry. ``max_model_len`` sets
    the token-count histograms' buckets, as in vLLM."""

    def __init__(self, model_name: str, *, max_model_len: int = 2048) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._engine_collector = EngineCollector(model_name)
        # What a scrape reads: this registry, or in multiprocess mode every API
        # server's samples from the shared directory (never this registry as
        # well: its samples are among them).
        self._scrape_registry = self.registry
        multiprocess_dir = os.environ.get(MULTIPROCESS_DIR_VARIABLE)
        if multiprocess_dir:
            self._scrape_registry = CollectorRegistry()
            MultiProcessCollector(self._scrape_registry, path=multiprocess_dir)
        self._scrape_registry.register(self._engine_collector)
        self.time_to_first_token = self._histogram(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            TIME_TO_FIRST_TOKEN_BUCKETS)
        self.inter_token_latency = self._histogram(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            INTER_TOKEN_LATENCY_BUCKETS)
        # vLLM's older name of the same observations, which its dashboards still chart.
        self.time_per_output_token = self._histogram(
            "time_per_output_token_seconds", "Histogram of time per output token in seconds.",
            INTER_TOKEN_LATENCY_BUCKETS)
        self.e2e_request_latency = self._histogram(
            "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = self._histogram(
            "request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS)
        token_buckets = token_count_buckets(max_model_len)
        self.request_prompt_tokens = self._histogram(
            "request_prompt_tokens", "Number of prefill tokens processed.", token_buckets)
        self.request_generation_tokens = self._histogram(
            "request_generation_tokens", "Number of generation tokens processed.", token_buckets)
        self._request_success = Counter(
            "vllm:request_success", "Count of successfully processed requests.",
            [*LABEL_NAMES, "finished_reason"], registry=self.registry,
        )

    def _histogram(self, name: str, documentation: str,
                   buckets: tuple[float, ...]) -> Histogram:
        """This server's child of a new ``vllm:`` histogram with vLLM's labels."""
        histogram = Histogram(f"vllm:{name}", documentation, list(LABEL_NAMES),
                              registry=self.registry, buckets=buckets)
        return histogram.labels(self.model_name, ENGINE_INDEX)

    def count_finished(self, finish_reason: str) -> None:
        self._request_success.labels(self.model_name, ENGINE_INDEX, finish_reason).inc()

    def render(self, statistics: Statistics | None) -> bytes:
        """Every metric in Prometheus' text format, the engine's counters from
        ``statistics`` (None: the engine is dead, only the histograms)."""
        self._engine_collector.statistics = statistics
        try:
            return prometheus_client.generate_latest(self._scrape_registry)
        finally:
            self._engine_collector.statistics = None

    def timer(self, arrival_time: float) -> RequestTimer:
        return RequestTimer(self, arrival_time)


class RequestTimer:
    """Observes one request's latencies as its outputs arrive.

    Times are passed in (any monotonic clock), so tests drive it without a clock.
    An output that carries several tokens (coalesced for a slow reader) spreads
    its interval evenly over them: one inter-token observation per token.
    """

    def __init__(self, metrics: ServerMetrics, arrival_time: float) -> None:
        self._metrics = metrics
        self._arrival_time = arrival_time
        self._first_token_time: float | None = None
        self._last_token_time: float | None = None
        self.num_output_tokens = 0
        self.summary: str | None = None  # how it finished, for the request's log line

    def on_output(self, now: float, *, num_new_tokens: int, queue_time: float | None) -> None:
        if queue_time is not None:
            self._metrics.request_queue_time.observe(queue_time)
        if num_new_tokens <= 0:
            return
        self.num_output_tokens += num_new_tokens
        if self._last_token_time is None:
            self._first_token_time = now
            self._metrics.time_to_first_token.observe(now - self._arrival_time)
        else:
            interval = (now - self._last_token_time) / num_new_tokens
            for _ in range(num_new_tokens):
                self._metrics.inter_token_latency.observe(interval)
                self._metrics.time_per_output_token.observe(interval)
        self._last_token_time = now

    def on_finish(self, now: float, finish_reason: str | None, *, num_prompt_tokens: int,
                  num_output_tokens: int) -> None:
        self._metrics.e2e_request_latency.observe(now - self._arrival_time)
        self._metrics.request_prompt_tokens.observe(num_prompt_tokens)
        self._metrics.request_generation_tokens.observe(num_output_tokens)
        self._metrics.count_finished(finish_reason or "unknown")
        first_token = ("" if self._first_token_time is None
                       else f", first token {self._first_token_time - self._arrival_time:.3f} s")
        self.summary = (f"finished ({finish_reason}), {num_prompt_tokens} prompt + "
                        f"{num_output_tokens} output tokens{first_token}, "
                        f"{now - self._arrival_time:.3f} s in all")
