"""``flashspec.kv.store``: attention caches that grow in place hold exactly what transformers'
concatenating layers hold, through every operation flashspec's layout code applies (crops,
batch selection, column gathers, moved columns), and write each step's columns only."""

from __future__ import annotations

import pytest
import torch

from flashspec.kv.compat import new_cache
from flashspec.kv.layout import gather_columns, move_columns, shiftable
from flashspec.kv.store import ENV, grow_in_place, store_layer_class
from tests.helpers.models import build_llama


def _pair() -> tuple[object, object]:
    """(a cache of store layers, a cache of transformers' own), two layers each."""
    from transformers import DynamicCache

    model = build_llama(0, layers=2)
    stored = new_cache(model)
    plain = DynamicCache(config=model.config)
    assert all(type(layer) is store_layer_class() for layer in stored.layers)
    assert not any(type(layer) is store_layer_class() for layer in plain.layers)
    return stored, plain


def _same(a: object, b: object) -> None:
    for x, y in zip(a.layers, b.layers, strict=True):  # type: ignore[attr-defined]
        assert torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)


def test_every_layout_operation_keeps_what_concatenation_holds() -> None:
    stored, plain = _pair()
    gen = torch.Generator().manual_seed(0)

    def step(count: int, batch: int = 3) -> None:
        for index in range(2):
            k = torch.randn(batch, 2, count, 8, generator=gen)
            v = torch.randn(batch, 2, count, 8, generator=gen)
            got = stored.update(k, v, index)  # type: ignore[attr-defined]
            want = plain.update(k, v, index)  # type: ignore[attr-defined]
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

    step(5)
    for _ in range(70):  # past the first buffer's room: it grows, keeping every column
        step(1)
    _same(stored, plain)
    for cache in (stored, plain):
        cache.crop(-4)  # type: ignore[attr-defined]
    step(2)
    _same(stored, plain)
    for cache in (stored, plain):
        cache.batch_select_indices(torch.tensor([2, 0]))  # type: ignore[attr-defined]
    step(3, batch=2)
    _same(stored, plain)
    source = torch.tensor([[0, 2, 3, 5], [1, 2, 4, 6]])
    for cache in (stored, plain):
        gather_columns(cache, source)
        move_columns(cache, [2, 3], 1)
        cache.crop(-2)  # type: ignore[attr-defined]
    step(4, batch=2)
    _same(stored, plain)
    assert shiftable(stored)


def test_steps_write_in_place_after_the_first() -> None:
    stored, _ = _pair()
    layer = stored.layers[0]  # type: ignore[attr-defined]
    stored.update(torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8), 0)  # type: ignore[attr-defined]
    pointer = layer.keys.data_ptr()
    for _ in range(10):
        stored.update(torch.ones(1, 2, 1, 8), torch.ones(1, 2, 1, 8), 0)  # type: ignore[attr-defined]
        assert layer.keys.data_ptr() == pointer  # the same buffer, no copy of the old columns
    stored.crop(-3)  # type: ignore[attr-defined]
    stored.update(torch.ones(1, 2, 1, 8), torch.ones(1, 2, 1, 8), 0)  # type: ignore[attr-defined]
    assert layer.keys.data_ptr() == pointer and layer.keys.shape[-2] == 12


def test_switched_off_keeps_transformers_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "0")
    cache = new_cache(build_llama(0, layers=2))
    assert not any(type(layer) is store_layer_class() for layer in cache.layers)
    assert grow_in_place(cache) == 0


def test_a_cache_trained_through_keeps_its_gradients() -> None:
    """With gradients flowing into the cache (training a draft), steps concatenate: the
    tensors an earlier step used stay as they were."""
    stored, _ = _pair()
    weight = torch.ones(1, requires_grad=True)
    k = torch.randn(1, 2, 3, 8) * weight
    keys, _ = stored.update(k, k, 0)  # type: ignore[attr-defined]
    first = (keys * keys).sum()  # saves keys for its backward, as attention does
    k2 = torch.randn(1, 2, 1, 8) * weight
    keys2, _ = stored.update(k2, k2, 0)  # type: ignore[attr-defined]
    (first + (keys2 * keys2).sum()).backward()
    assert weight.grad is not None and torch.isfinite(weight.grad).all()
