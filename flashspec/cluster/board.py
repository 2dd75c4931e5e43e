"""What the replicas report to the ingress: health and metrics, merged into one view.

Ray Serve routes each request to some replica, so a replica's own ``/health`` or ``/metrics``
says nothing about the others. Each replica instead reports its state here every
``REPORT_EVERY_S`` seconds; the ingress answers ``/health`` and ``/metrics`` from the merge, each
replica's series labelled ``replica="<id>"``. A replica that has not reported for ``STALE_S``
seconds (killed, hung, gone) drops out of both.

``Board`` is plain Python; ``flashspec.cluster.replica`` runs it as a named Ray actor.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..serve.metrics import escape_label

REPORT_EVERY_S = 1.0
STALE_S = 5.0


@dataclass(frozen=True)
class Report:
    """One replica's state at one moment.

    Attributes:
        replica: its id (the ``x-flashspec-replica`` header's value).
        healthy: whether its engine worker is alive.
        metrics: its ``/metrics`` text (Prometheus exposition format 0.0.4).
        at: ``time.time()`` when it was taken (set by the board on arrival).
    """

    replica: str
    healthy: bool
    metrics: str
    at: float = 0.0


def labelled(line: str, replica: str) -> str:
    """A sample line with ``replica="<replica>"`` as its first label."""
    label = f'replica="{escape_label(replica)}"'
    name_end = len(line)
    for i, char in enumerate(line):
        if char in "{ ":
            name_end = i
            break
    name, rest = line[:name_end], line[name_end:]
    if rest.startswith("{}"):
        return f"{name}{{{label}}}{rest[2:]}"
    if rest.startswith("{"):
        return f"{name}{{{label},{rest[1:]}"
    return f"{name}{{{label}}}{rest}"


def _family(name: str, kinds: dict[str, str]) -> str:
    """The family a sample belongs to (histograms' _bucket/_sum/_count share their base)."""
    if name in kinds:
        return name
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix) and name[: -len(suffix)] in kinds:
            return name[: -len(suffix)]
    return name


def merge_metrics(texts: dict[str, str]) -> str:
    """Prometheus texts of several replicas as one, every sample labelled with its replica.

    Each family's ``# HELP``/``# TYPE`` appear once, with every replica's samples under them
    (the format wants a family's samples together). Families come in first-seen order.
    """
    helps: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    kinds: dict[str, str] = {}
    for replica, text in sorted(texts.items()):
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    name = parts[2]
                    if parts[1] == "TYPE":
                        kinds[name] = parts[3] if len(parts) > 3 else "untyped"
                    header = helps.setdefault(name, [])
                    if not any(h.split(None, 2)[1] == parts[1] for h in header):
                        header.append(line)
                    samples.setdefault(name, [])
                continue
            sample_name = line.split("{", 1)[0].split(" ", 1)[0]
            family = _family(sample_name, kinds)
            helps.setdefault(family, [])
            samples.setdefault(family, []).append(labelled(line, replica))
    lines: list[str] = []
    for family, header in helps.items():
        lines.extend(header)
        lines.extend(samples.get(family, ()))
    return "\n".join(lines) + "\n" if lines else ""


class Board:
    """The latest ``Report`` of every replica (a Ray actor in a cluster; any object in tests)."""

    def __init__(self, stale_s: float = STALE_S) -> None:
        self._stale_s = stale_s
        self._reports: dict[str, Report] = {}

    def put(self, report: Report) -> None:
        """Record ``report`` as its replica's latest, stamped now."""
        self._reports[report.replica] = Report(
            report.replica, report.healthy, report.metrics, time.time()
        )

    def drop(self, replica: str) -> None:
        """Forget ``replica`` (it is shutting down)."""
        self._reports.pop(replica, None)

    def fresh(self) -> list[Report]:
        """Reports younger than ``stale_s``, by replica id; older ones are forgotten."""
        now = time.time()
        for replica in [r for r, rep in self._reports.items() if now - rep.at > self._stale_s]:
            del self._reports[replica]
        return [self._reports[r] for r in sorted(self._reports)]

    def health(self) -> dict[str, bool]:
        """Each fresh replica's health."""
        return {report.replica: report.healthy for report in self.fresh()}

    def metrics(self) -> str:
        """The fresh replicas' metrics, merged (see ``merge_metrics``)."""
        return merge_metrics({report.replica: report.metrics for report in self.fresh()})
