"""``flashspec.loading.heap.release``: freed heap pages handed back after a load."""

from __future__ import annotations

import sys

import pytest

import flashspec.loading.heap as heap


def test_release_trims_glibc_s_heap_and_is_a_no_op_without_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []
    monkeypatch.setattr(heap, "_LIBC", [calls.append])
    heap.release()
    assert calls == [0]
    monkeypatch.setattr(heap, "_LIBC", [None])
    heap.release()  # no malloc_trim (another libc): nothing to do
    assert calls == [0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_the_real_trim_is_found_on_linux(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heap, "_LIBC", [])
    assert heap._trim() is not None
    heap.release()
