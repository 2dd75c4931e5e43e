"""The folder flashspec keeps converted weights in."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "FLASHSPEC_CACHE"


def cache_dir() -> Path:
    """``$FLASHSPEC_CACHE``, else ``$XDG_CACHE_HOME/flashspec``, else ``~/.cache/flashspec``.

    Not created here: the writer creates what it writes.
    """
    explicit = os.environ.get(CACHE_ENV, "").strip()
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "flashspec"
