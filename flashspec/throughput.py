"""The earlier path of ``flashspec.select.throughput`` (the throughput model), kept for old
imports."""

from .select.throughput import ThroughputModel, expected_counts

__all__ = ["ThroughputModel", "expected_counts"]
