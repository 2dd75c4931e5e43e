"""Where a round's time goes: named spans the engine, drafters and samplers mark around their
parts, timed only while a profiler is active (``flashspec bench profile`` is one).

Marked spans: ``draft`` (a drafter's proposal), ``forward`` / ``target_forward`` (a draft model's
or the target's forward), ``warp`` (logit warping to probabilities), ``sample`` (drawing a draft),
``accept`` (the accept/reject test) and ``residual`` (the replacement draw). Spans nest: a
draft's forwards are ``("draft", "forward")``.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import ParamSpec, TypeVar

_P = ParamSpec("_P")
_R = TypeVar("_R")


@dataclass
class _Open:
    label: str
    start: float
    children: float = 0.0  # seconds spent in spans nested in this one


class Spans:
    """Exclusive wall time and calls per path of nested spans (a path is the labels from the
    outermost span in)."""

    def __init__(self) -> None:
        self.stack: list[_Open] = []
        self.exclusive: dict[tuple[str, ...], float] = defaultdict(float)
        self.calls: dict[tuple[str, ...], int] = defaultdict(int)

    def enter(self, label: str) -> None:
        """Open a span (``span`` does this)."""
        self.stack.append(_Open(label, time.perf_counter()))

    def exit(self) -> None:
        """Close the innermost span."""
        end = time.perf_counter()
        path = tuple(entry.label for entry in self.stack)
        closed = self.stack.pop()
        elapsed = end - closed.start
        self.exclusive[path] += elapsed - closed.children
        self.calls[path] += 1
        if self.stack:
            self.stack[-1].children += elapsed


class _Span:
    __slots__ = ("label",)

    def __init__(self, label: str) -> None:
        self.label = label

    def __enter__(self) -> None:
        if _active is not None:
            _active.enter(self.label)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if _active is not None:
            _active.exit()


_active: Spans | None = None
_spans: dict[str, _Span] = {}


def span(label: str) -> _Span:
    """``with span("warp"): ...`` times the block while a profiler is active. Inactive, it costs
    a method call and an attribute check on entry and exit (one span object per label)."""
    found = _spans.get(label)
    if found is None:
        found = _spans[label] = _Span(label)
    return found


def spanned(label: str) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """Decorate a function so that every call is the span ``label``."""

    def decorate(function: Callable[_P, _R]) -> Callable[_P, _R]:
        marker = span(label)

        @functools.wraps(function)
        def timed(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            with marker:
                return function(*args, **kwargs)

        return timed

    return decorate


@contextmanager
def profiling(spans: Spans) -> Iterator[Spans]:
    """Record every marked span into ``spans`` while the block runs (one profiler at a time,
    in the thread that runs the engine)."""
    global _active
    if _active is not None:
        raise RuntimeError("a profiler is already active; profile one block at a time")
    _active = spans
    try:
        yield spans
    finally:
        _active = None
