"""argparse value types shared by the `flashspec` subcommands.

A bad value becomes argparse's one-line usage error that names the flag, never a traceback.
"""

from __future__ import annotations

import argparse
import math


def integer(text: str) -> int:
    """Any integer."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def positive_int(text: str) -> int:
    """An integer >= 1."""
    value = integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def nonnegative_int(text: str) -> int:
    """An integer >= 0."""
    value = integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def int_list(text: str) -> tuple[int, ...]:
    """Comma-separated integers >= 1, e.g. ``128,512,1024``; ``0`` (or nothing): none."""
    if text.strip() in ("", "0"):
        return ()
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be comma-separated integers such as 128,512,1024, got {text!r}"
        ) from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"must be integers >= 1, got {text!r}")
    return values


def tree_shape(text: str) -> str | None:
    """``DEPTH,NODES,TOP_K[,EXPAND]`` (e.g. ``5,24,4``), checked and kept as text, or ``off``
    (None): a token tree's shape (``flashspec.trees.TreeShape.parse``)."""
    from ..trees.tree import TreeShape

    try:
        shape = TreeShape.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return None if shape is None else str(shape)


def finite_float(text: str) -> float:
    """A finite number."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


def temperature(text: str) -> float:
    """A sampling temperature >= 0 (0 = greedy)."""
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0 = greedy), got {text!r}")
    return value


def top_p(text: str) -> float:
    """A nucleus mass in (0, 1]."""
    value = finite_float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1] (1 = off), got {text!r}")
    return value


def probability(text: str) -> float:
    """A probability in [0, 1]."""
    value = finite_float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text!r}")
    return value
