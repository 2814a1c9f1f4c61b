"""Reading an engine's in-flight count from its Prometheus page: pure functions, cheap on a 300 KB page.

The page is scanned with ``str.find`` for the few series we need instead of being parsed whole: a vLLM page with
many histograms is mostly lines we would throw away.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass


class MetricsError(ValueError):
    """The page does not give an in-flight count. ``kind`` is ``missing`` or ``malformed`` (a metric label)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class EngineSpec:
    """Which series make up in-flight: ``required`` must be on the page, ``optional`` count 0 when absent."""

    name: str
    required: tuple[str, ...]
    optional: tuple[str, ...] = ()
    tokens: str | None = None  # a counter that moves while tokens are generated
    health_path: str = "/health"
    # How long in-flight must read 0 before it is believed: how far the page can lag the engine.
    zero_confirm_s: float = 1.0
    # How long a request may go uncounted after it arrived (until about its first token): a connection whose last
    # bytes in and out fell in one clock tick holds this long, as a request may have followed the response at once.
    counting_gap_s: float = 1.0
    # A series the exporter serves whatever the engine does. Where it is on the page, an in-flight series that is
    # not counts 0: such an exporter shows a series only once something recorded it. Without it on the page (not
    # the exporter's page, or not exported yet) a missing required series is still an error, never a zero.
    exporter_series: str | None = None


# Ray's metrics agent shows what a node's processes send it: each process harvests its series every half
# RAY_metrics_report_interval_ms and sends them every interval (Ray's stats.h: at least 0.5 s and 1 s), so the page
# lags a process by up to 1.5 intervals. At the default 10 s that is 15 s (measured on Ray 2.49.0: 14.9 s from a
# stream's end to its drop on the page), which --engine ray waits by default; with 1000 in the pod's env it is 1.5 s
# (measured: 0.04-1.44 s, tests/engines/test_ray_signals.py), which --zero-confirm then says.
RAY_DEFAULT_LAG_S = 15.5
RAY_LAG_AT_1000_MS_S = 1.5

ENGINES: dict[str, EngineSpec] = {
    "vllm": EngineSpec(
        "vllm",
        required=("vllm:num_requests_running",),
        optional=("vllm:num_requests_waiting",),
        tokens="vllm:generation_tokens_total",
        # vLLM 0.32.0 CPU build, measured (python -m bench.vllm_counting_gap, 120 requests one at a time, the page
        # polled every 6 ms): the gauges read 0 again 2-21 ms after [DONE], and count a new request only once its
        # first engine step is done: 28 ms-0.99 s after it was sent, 4 ms-0.27 s after its first chunk went out
        # (some short requests never show). Until its first chunk a request holds by its connection (data in,
        # nothing out); after it, for the window (a connection that sent less than it ago holds). So 0.3 s covers
        # both lags, and a pod is released within a poll interval + 0.3 s of its last [DONE].
        zero_confirm_s=0.3,
        counting_gap_s=2.0,  # twice the longest wait measured from sending a request to its being counted
    ),
    "tgi": EngineSpec(
        "tgi",
        required=("tgi_batch_current_size",),
        optional=("tgi_queue_size",),
        tokens="tgi_batch_inference_count",  # one per forward pass; TGI has no per-token counter
        # The batch size is set once a batch's prefill returns: a request out of the queue and in prefill reads 0.
        zero_confirm_s=3.0,
        counting_gap_s=3.0,
    ),
    "sglang": EngineSpec(
        "sglang",
        required=("sglang:num_running_reqs",),
        optional=("sglang:num_queue_reqs",),
        tokens="sglang:realtime_tokens_total",  # generation_tokens_total only moves when a request ends
        # The scheduler logs its stats on prefill batches and every decode_log_interval (40) decode steps.
        zero_confirm_s=2.0,
        counting_gap_s=2.0,
    ),
    # Ray Serve: the requests this node's replicas are serving (every deployment's, from the replica's start) and
    # those its HTTP proxy is carrying (from its first request), both counted by Serve itself: a stream is counted
    # from its arrival to its last byte, and no longer once its client went away (Serve cancels the request).
    # vLLM's own gauges under Ray (ray_vllm_*) are absent until the replica's first request and leave out what
    # waits in Serve before vLLM sees it. No token counter: Serve's count does not stick, and a stream carried by
    # this node's proxy for a replica elsewhere makes no tokens here.
    "ray": EngineSpec(
        "ray",
        required=("ray_serve_replica_processing_queries",),
        optional=("ray_serve_num_ongoing_http_requests",),
        health_path="/metrics",
        zero_confirm_s=RAY_DEFAULT_LAG_S,
        counting_gap_s=RAY_DEFAULT_LAG_S,
        exporter_series="ray_node_mem_total",  # the agent's own, about its node, from its first export
    ),
}


def custom_engine(metrics: str, *, tokens: str | None = None, health_path: str = "/health") -> EngineSpec:
    """A configured engine: ``metrics`` is one metric name or several separated by commas, summed."""
    names = tuple(name.strip() for name in metrics.split(",") if name.strip())
    if not names:
        raise ValueError("the custom engine needs at least one in-flight metric name")
    # Nothing is known of the exporter: as long as Ray's metrics agent, which exports every 10 s by default.
    return EngineSpec(
        "custom", required=names, tokens=tokens, health_path=health_path, zero_confirm_s=10.0, counting_gap_s=10.0
    )


@dataclass(frozen=True)
class EngineReading:
    in_flight: int
    tokens: float | None


_SEPARATORS = (" ", "\t", "{")
# A label set: quoted values may hold any character, braces and `#` included, with backslash escapes.
_LABEL_SET = re.compile(r'\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\}')


def _sample_value(line: str, name: str) -> float:
    """The value of one sample line that follows the metric name: labels, value, timestamp, exemplar.

    An OpenMetrics exemplar (``4 # {trace_id="abc"} 0 1700000000``) carries a value of its own: everything from
    the ``#`` after the sample's value is dropped, never read as the sample.
    """
    rest = line
    if rest.startswith("{"):
        labels = _LABEL_SET.match(rest)
        if labels is None:
            raise MetricsError("malformed", f"{name}: unterminated label set")
        rest = rest[labels.end() :]
    fields = rest.partition("#")[0].split()
    if not 1 <= len(fields) <= 2:
        raise MetricsError("malformed", f"{name}: expected a value, got {rest.strip()[:40]!r}")
    try:
        value = float(fields[0])
    except ValueError:
        raise MetricsError("malformed", f"{name}: {fields[0][:40]!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise MetricsError("malformed", f"{name}: {fields[0][:40]} is not a count")
    return value


def _line_starts(page: str, name: str) -> Iterator[int]:
    """Offsets just past ``name`` wherever it begins a line."""
    if page.startswith(name):
        yield len(name)
    needle = "\n" + name
    at = page.find(needle)
    while at != -1:
        yield at + len(needle)
        at = page.find(needle, at + len(needle))


def sum_samples(page: str, name: str) -> float | None:
    """Sum every sample of ``name`` over all label sets; None when the page has no sample of it."""
    total = 0.0
    found = False
    for begin in _line_starts(page, name):
        if page[begin : begin + 1] in _SEPARATORS:
            end = page.find("\n", begin)
            total += _sample_value(page[begin : len(page) if end == -1 else end], name)
            found = True
    if not math.isfinite(total):
        raise MetricsError("malformed", f"{name}: the samples add up to more than a count can be")
    return total if found else None


def read_engine(page: str, engine: EngineSpec) -> EngineReading:
    """In-flight requests (running plus queued) and the token counter, from one metrics page."""
    in_flight = 0.0
    exporter = engine.exporter_series
    absent_is_zero = exporter is not None and sum_samples(page, exporter) is not None
    for name in engine.required:
        value = sum_samples(page, name)
        if value is None and not absent_is_zero:
            raise MetricsError("missing", f"{name} is not on the metrics page")
        in_flight += value or 0.0
    for name in engine.optional:
        in_flight += sum_samples(page, name) or 0.0
    tokens = sum_samples(page, engine.tokens) if engine.tokens else None
    return EngineReading(in_flight=round(in_flight), tokens=tokens)


def in_flight(page: str, engine: EngineSpec) -> int:
    """Requests the engine is serving or has queued; raises MetricsError rather than guess a zero."""
    return read_engine(page, engine).in_flight
