"""How many threads torch's CPU ops get in a serving process.

A server is more than its engine: the event loop frames and sends every streamed chunk, parses
requests and hands jobs to the engine's worker, all in Python threads of the same process.
torch's OpenMP threads keep spinning on their cores for a while after each op, so with as many
of them as cores the serving threads wait for a core between the engine's ops, and each
chunk's trip to the client gets slower. ``serving_threads`` leaves one core to the server.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

OMP_ENV = "OMP_NUM_THREADS"


def serving_threads(
    requested: int | None,
    device: str,
    default_threads: int,
    environ: Mapping[str, str] = os.environ,
) -> tuple[int | None, str]:
    """The intra-op thread count to set for serving on ``device`` (None: leave torch's), and a
    line saying why.

    ``requested`` (``--threads``) wins. Otherwise, on a CPU, where the user has not set
    ``OMP_NUM_THREADS`` (torch then already runs what they asked for), one fewer than
    ``default_threads`` (torch's own count), at least one. An accelerator's work does not run
    on torch's CPU threads, so its count is left alone.
    """
    if requested is not None:
        return requested, f"torch threads {requested} (--threads)"
    if not device.startswith("cpu"):
        return None, f"torch threads {default_threads} (torch's own; the model is on {device})"
    if environ.get(OMP_ENV, "").strip():
        return None, f"torch threads {default_threads} ({OMP_ENV}={environ[OMP_ENV].strip()})"
    count = max(1, default_threads - 1)
    return count, (
        f"torch threads {count} of {default_threads}: one core left to the server's event loop "
        "and HTTP (--threads sets it)"
    )


def apply_serving_threads(requested: int | None, device: str) -> str:
    """Set torch's intra-op threads as ``serving_threads`` says (``flashspec serve`` and the
    load benchmark's in-process server both do); returns its line."""
    import torch

    count, why = serving_threads(requested, device, torch.get_num_threads())
    if count is not None:
        torch.set_num_threads(count)
    return why


__all__ = ["OMP_ENV", "apply_serving_threads", "serving_threads"]
