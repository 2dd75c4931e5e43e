"""Server metrics in the Prometheus text exposition format (version 0.0.4), written by hand.

``Metrics`` keeps the counters, gauges and histograms; ``Metrics.render`` writes ``GET /metrics``.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

Labels = tuple[tuple[str, str], ...]

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
BATCH_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)


def escape_label(value: str) -> str:
    """A label value as the exposition format quotes it (backslash, newline, double quote)."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def _label_text(labels: Labels, extra: Labels = ()) -> str:
    pairs = (*labels, *extra)
    if not pairs:
        return ""
    return "{" + ",".join(f'{k}="{escape_label(v)}"' for k, v in pairs) + "}"


@dataclass
class _Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        # Stored per bucket; render() accumulates, as Prometheus buckets are cumulative.
        index = bisect.bisect_left(self.bounds, value)
        if index < len(self.counts):
            self.counts[index] += 1
        self.total += value
        self.count += 1


@dataclass
class _Family:
    kind: str  # "counter", "gauge" or "histogram"
    help: str
    buckets: tuple[float, ...] = ()
    values: dict[Labels, float] = field(default_factory=dict)
    histograms: dict[Labels, _Histogram] = field(default_factory=dict)


# The format is a few lines per metric, so the server needs no client library. One lock guards
# every metric: the engine worker thread and the event loop both update them.
class Metrics:
    """Thread-safe counters, gauges and histograms, rendered as Prometheus text.

    Metric names are declared once (``counter``/``gauge``/``histogram``); updating an
    undeclared name is a programming error and raises ``KeyError``.
    """

    def __init__(self, prefix: str = "flashspec_") -> None:
        self._prefix = prefix
        self._lock = threading.Lock()
        self._families: dict[str, _Family] = {}

    # -- declaration ------------------------------------------------------------------------

    def counter(self, name: str, help: str) -> None:
        """Declare a counter (only ever increases; the name should end in ``_total``)."""
        self._families[name] = _Family("counter", help)

    def gauge(self, name: str, help: str) -> None:
        """Declare a gauge (a value that goes up and down)."""
        self._families[name] = _Family("gauge", help)

    def histogram(self, name: str, help: str, buckets: Sequence[float]) -> None:
        """Declare a histogram with these upper bucket bounds (``+Inf`` is added)."""
        self._families[name] = _Family("histogram", help, tuple(sorted(buckets)))

    # -- updates ----------------------------------------------------------------------------

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        """Add ``amount`` to a counter or gauge."""
        key = tuple(sorted(labels.items()))
        with self._lock:
            family = self._families[name]
            family.values[key] = family.values.get(key, 0.0) + amount

    def set(self, name: str, value: float, **labels: str) -> None:
        """Set a gauge."""
        key = tuple(sorted(labels.items()))
        with self._lock:
            self._families[name].values[key] = value

    def observe(self, name: str, value: float, **labels: str) -> None:
        """Record one observation in a histogram."""
        key = tuple(sorted(labels.items()))
        with self._lock:
            family = self._families[name]
            histogram = family.histograms.get(key)
            if histogram is None:
                histogram = family.histograms[key] = _Histogram(family.buckets)
            histogram.observe(value)

    def value(self, name: str, **labels: str) -> float:
        """Current value of a counter or gauge (0 if never updated); for tests and status."""
        key = tuple(sorted(labels.items()))
        with self._lock:
            return self._families[name].values.get(key, 0.0)

    # -- exposition -------------------------------------------------------------------------

    def render(self) -> str:
        """All metrics in the Prometheus text format (``text/plain; version=0.0.4``)."""
        lines: list[str] = []
        with self._lock:
            for short, family in self._families.items():
                name = self._prefix + short
                lines.append(f"# HELP {name} {family.help}")
                lines.append(f"# TYPE {name} {family.kind}")
                if family.kind != "histogram":
                    # An unlabelled metric shows 0 before its first update, so scrapers see it.
                    values = family.values or ({(): 0.0} if family.kind == "gauge" else {})
                    for labels, value in sorted(values.items()):
                        lines.append(f"{name}{_label_text(labels)} {_number(value)}")
                    continue
                for labels, histogram in sorted(family.histograms.items()):
                    running = 0
                    for bound, count in zip(histogram.bounds, histogram.counts, strict=True):
                        running += count
                        le = _label_text(labels, (("le", _number(bound)),))
                        lines.append(f"{name}_bucket{le} {running}")
                    inf = _label_text(labels, (("le", "+Inf"),))
                    lines.append(f"{name}_bucket{inf} {histogram.count}")
                    lines.append(f"{name}_sum{_label_text(labels)} {_number(histogram.total)}")
                    lines.append(f"{name}_count{_label_text(labels)} {histogram.count}")
        return "\n".join(lines) + "\n"


def server_metrics() -> Metrics:
    """The metrics ``flashspec serve`` exposes, declared."""
    metrics = Metrics()
    metrics.counter("requests_total", "HTTP requests by endpoint and status code.")
    metrics.counter("prompt_tokens_total", "Prompt tokens of accepted generation requests.")
    metrics.counter("generated_tokens_total", "Tokens generated (all rows).")
    metrics.counter("draft_tokens_total", "Draft tokens proposed (all rows).")
    metrics.counter("accepted_draft_tokens_total", "Draft tokens accepted and emitted.")
    metrics.gauge("acceptance_rate", "accepted_draft_tokens_total / draft_tokens_total.")
    metrics.counter(
        "cancelled_total",
        "Generations cancelled, by reason (disconnect, timeout, shutdown) and stage "
        "(queued: never reached the engine; running: its row left the batch).",
    )
    metrics.gauge("queue_depth", "Generations waiting for the engine.")
    metrics.gauge("running_rows", "Rows in the batch the engine is running now.")
    metrics.histogram(
        "batch_size",
        "Rows an engine batch starts with, or that join a running one at once (continuous "
        "batching).",
        BATCH_BUCKETS,
    )
    metrics.histogram(
        "request_latency_seconds",
        "Generation request latency, arrival to last token, by endpoint.",
        LATENCY_BUCKETS,
    )
    metrics.histogram(
        "time_to_first_token_seconds",
        "Arrival to the first generated text of a generation.",
        LATENCY_BUCKETS,
    )
    return metrics
