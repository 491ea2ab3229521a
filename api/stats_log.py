"""The periodic stats line and the per-request log line of `trio-llm serve`, as vLLM logs them.

Every ``interval`` seconds the server logs the engine's throughput since the
last line, its running and waiting requests and its KV cache and prefix cache
use (vLLM's line, ``Avg prompt throughput: ... tokens/s, ...``). An idle engine
(no tokens in this interval or the last) logs it at DEBUG, so an idle
production server stays quiet, as vLLM's does.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from trio_llm.actors.errors import EngineError
from trio_llm.api.metrics import Statistics

logger = logging.getLogger("trio_llm.stats")
request_logger = logging.getLogger("trio_llm.requests")

# vLLM's default interval (VLLM_LOG_STATS_INTERVAL).
DEFAULT_STATS_INTERVAL_SECONDS = 10.0


class StatsLine:
    """Turns successive snapshots of the engine's counters into stats lines: the
    throughput is the counters' growth over the time between two snapshots."""

    def __init__(self, first: Statistics, now: float) -> None:
        self._last, self._last_time = first, now
        self._was_idle = True

    def next(self, counters: Statistics, now: float) -> tuple[int, str]:
        """The log level and text of the line for ``counters`` taken at ``now``."""
        elapsed = max(now - self._last_time, 1e-9)
        last = self._last
        prompt_rate = _growth(counters.num_prompt_tokens, last.num_prompt_tokens) / elapsed
        generation_rate = _growth(counters.num_generation_tokens,
                                  last.num_generation_tokens) / elapsed
        queries = _growth(counters.num_prefix_cache_queries, last.num_prefix_cache_queries)
        hits = _growth(counters.num_prefix_cache_hits, last.num_prefix_cache_hits)
        is_idle = prompt_rate == 0 and generation_rate == 0
        level = logging.DEBUG if is_idle and self._was_idle else logging.INFO
        self._last, self._last_time, self._was_idle = counters, now, is_idle
        text = (f"Avg prompt throughput: {prompt_rate:.1f} tokens/s, "
                f"Avg generation throughput: {generation_rate:.1f} tokens/s, "
                f"Running: {counters.num_running} reqs, Waiting: {counters.num_waiting} reqs, "
                f"KV cache usage: {100 * counters.kv_cache_usage:.1f}%, "
                f"Prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%")
        return level, text


def _growth(now: int, before: int) -> int:
    """A counter's growth since ``before``; all of it where the counter restarted in
    between (the warm-up's end zeroes the engine's totals)."""
    return now - before if now >= before else now


async def log_stats_every(interval: float, fetch: Callable[[], Awaitable[Statistics]]) -> None:
    """Log a stats line every ``interval`` seconds until cancelled. A dead
    engine has no counters: the lines stop (the server is stopping then)."""
    try:
        line = StatsLine(await fetch(), trio.current_time())
        while True:
            await trio.sleep(interval)
            level, text = line.next(await fetch(), trio.current_time())
            logger.log(level, "%s", text)
    except EngineError:
        return


def log_request(route: str, status: int, request_id: str, detail: str) -> None:
    """One line per generation request, once it has ended (``--disable-log-requests``
    turns them off)."""
    request_logger.info("%s %d %s: %s", route, status, request_id, detail)
