"""``python -m flashspec.bench ...``: the same as ``flashspec bench ...``."""

from __future__ import annotations

import sys

from .commands import cli

sys.exit(cli())
