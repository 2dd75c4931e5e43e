"""flashspec.legacy: every earlier name in its table resolves to what it names now, the earlier
modules import, and ``TRITON_AVAILABLE`` is looked up without importing triton.

The earlier library's own code is ``test_earlier_quickstart.py``; this file checks the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import inspect
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from flashspec.legacy import EARLIER, Alias, Earlier, EarlierField, earlier_flags, resolve

ROOT = Path(__file__).resolve().parents[2]
EARLIER_MODULES = sorted({row.name.partition(":")[0] for row in EARLIER if row.kind == "moved"})


def owner_and_attribute(name: str) -> tuple[type, str]:
    """The class and attribute of a ``module:Class.attribute`` name."""
    owner, _, attribute = name.rpartition(".")
    return resolve(owner), attribute


def needs_extra(name: str) -> None:
    if name.startswith("flashspec.server:"):
        pytest.importorskip("fastapi")


@pytest.mark.parametrize("row", EARLIER, ids=lambda row: row.name)
def test_every_earlier_name_resolves_to_its_current_one(row: Earlier) -> None:
    assert row.since, row
    if row.kind == "moved":
        needs_extra(row.name)
        assert resolve(row.name) is resolve(row.current)
    elif row.kind == "alias":
        owner, attribute = owner_and_attribute(row.name)
        current_owner, current = owner_and_attribute(row.current)
        alias = inspect.getattr_static(owner, attribute)
        assert isinstance(alias, Alias) and owner is current_owner and alias.current == current
        assert hasattr(owner, current)
        value = object()
        assert alias.__get__(SimpleNamespace(**{current: value}), owner) is value
    elif row.kind == "field":
        owner, attribute = owner_and_attribute(row.name)
        current_owner, current = owner_and_attribute(row.current)
        field = inspect.getattr_static(owner, attribute)
        assert isinstance(field, EarlierField) and owner is current_owner
        assert field.current == current and field.choices
        for choice in field.choices:
            config = owner(**{attribute: choice})
            assert getattr(config, current) == choice == getattr(config, attribute)
    elif row.kind == "kept":
        owner, attribute = owner_and_attribute(row.name)
        assert attribute in {f.name for f in dataclasses.fields(owner)}
        resolve(row.current)
    elif row.kind == "verb":
        owner, earlier = owner_and_attribute(row.name)
        _, current = owner_and_attribute(row.current)
        heard: list[tuple[Any, ...]] = []

        def hook(self: Any, *args: Any) -> None:
            heard.append(args)

        drafter = type("Earlier", (owner,), {earlier: hook, "propose": hook})()
        padding = SimpleNamespace(lefts=[2, 0])
        if current == "begin":
            drafter.begin("ctx")
            assert heard == [("ctx",)]
        elif earlier == "commit":  # lockstep only, as before: the columns every row keeps
            assert not drafter.shiftable
            drafter.keep([3, 5], padding)
            assert heard == [(5,)]
        else:
            assert drafter.shiftable
            drafter.keep([3, 5], padding)
            assert heard == [([3, 5],)]
    else:
        assert row.kind == "flag"
        from flashspec.options import EngineOptions

        parser = argparse.ArgumentParser()
        EngineOptions.add_arguments(parser)
        current = next(a for a in parser._actions if row.current in a.option_strings)
        assert row.name in current.option_strings


def test_names_are_listed_once() -> None:
    names = [row.name for row in EARLIER]
    assert len(names) == len(set(names))
    assert earlier_flags("--method") == ("--variant",)


@pytest.mark.parametrize("module", EARLIER_MODULES)
def test_earlier_modules_import_and_export_their_rows(module: str) -> None:
    needs_extra(f"{module}:")
    imported = importlib.import_module(module)
    names = sorted(
        row.name.partition(":")[2]
        for row in EARLIER
        if row.kind == "moved" and row.name.startswith(f"{module}:")
    )
    assert names and set(names) <= set(imported.__all__) and set(names) <= set(dir(imported))
    for name in imported.__all__:
        getattr(imported, name)
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        _ = imported.nothing


@pytest.mark.parametrize(
    "module",
    [
        "flashspec.bandit",
        "flashspec.throughput",
        "flashspec.server",
        "flashspec.feature_drafter",
        "flashspec.shared_head",
        "flashspec.options",
        "flashspec.serve.cli",
    ],
)
def test_shim_modules_hold_no_names_of_their_own(module: str) -> None:
    # Their contents are legacy's rows: __all__ is exactly those.
    imported = importlib.import_module(module)
    listed = {row.name.partition(":")[2] for row in EARLIER if row.name.startswith(f"{module}:")}
    assert set(imported.__all__) == listed


def test_strategy_checks_and_replace() -> None:
    from flashspec import BanditConfig

    with pytest.raises(ValueError, match=r"strategy \(the earlier name of selector\) must be"):
        BanditConfig(strategy="bogus")  # type: ignore[arg-type]
    # The field reads as given, so replacing selector alone works as for any field.
    assert BanditConfig(selector="ucb1").strategy is None
    config = dataclasses.replace(BanditConfig(selector="thompson"), selector="ucb1")
    assert config.selector == "ucb1" and config.strategy is None
    assert BanditConfig(strategy="ucb1") == BanditConfig(strategy="ucb1")


def test_alias_reads_and_writes_the_current_attribute() -> None:
    class Holder:
        earlier = Alias[int]("now")

        def __init__(self) -> None:
            self.now = 1

    holder = Holder()
    holder.earlier = 2
    assert holder.now == 2 == holder.earlier
    assert isinstance(Holder.earlier, Alias)


def test_an_earlier_field_must_follow_its_current_one() -> None:
    # Python 3.11 wraps an error in __set_name__ in a RuntimeError; 3.12 raises it as is.
    with pytest.raises((TypeError, RuntimeError)) as raised:

        @dataclasses.dataclass
        class Backwards:
            earlier: EarlierField[str] = EarlierField("now", ("a",))  # noqa: RUF009
            now: str = "a"

    assert "must be declared after now" in str(raised.value.__cause__ or raised.value)


def test_triton_available_without_importing_triton() -> None:
    code = (
        "import sys, importlib.util, flashspec\n"
        "assert 'triton' not in sys.modules\n"
        "value = flashspec.TRITON_AVAILABLE\n"
        "assert isinstance(value, bool)\n"
        "assert value == (importlib.util.find_spec('triton') is not None)\n"
        "assert 'triton' not in sys.modules and 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
