"""The suite's fixtures and collection settings; the helpers themselves live in tests/helpers/
(imported as ``tests.helpers.<name>``: tests/ and its folders are packages)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.helpers.models import build_char_tokenizer, build_llama

# The kernel tests also run without torch (against a bare wheel); the engine tests need it.
if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
    collect_ignore_glob = [
        "engine/test_engine*.py",
        "engine/test_sampling*.py",
        "models/test_engine*.py",
    ]
else:
    import torch

    # Shared 2-core machines: one intra-op thread keeps test runs lean and timings stable.
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def char_tokenizer() -> Any:
    return build_char_tokenizer()


@pytest.fixture(scope="session")
def make_llama() -> Callable[..., Any]:
    return build_llama


# The server tests' shared fixtures (tests/helpers/server.py; imported on use, so that the tests
# that run without FastAPI never load it).
@pytest.fixture(scope="module")
def tiny() -> Iterator[Any]:
    """A started server over a fresh tiny engine, one per test module."""
    from tests.helpers.server import serve_tiny

    served = serve_tiny()
    try:
        yield served
    finally:
        served.server.stop()


@pytest.fixture(scope="module")
def reference() -> Callable[..., Any]:
    """Batch-1 greedy generation on a tiny engine of its own (``tiny_reference``)."""
    from tests.helpers.server import tiny_reference

    return tiny_reference()
