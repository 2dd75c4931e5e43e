"""Models: the causal LM with its KV cache, and the target."""

from __future__ import annotations

from .causal import *  # noqa: F403
