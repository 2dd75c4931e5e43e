"""``flashspec serve``'s torch threads: one core left to the server on a CPU, unless asked."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from flashspec.cli import main
from flashspec.flags.options import EngineOptions, UserError
from flashspec.serve.threads import OMP_ENV, serving_threads


@pytest.mark.parametrize(
    ("requested", "device", "default", "environ", "want"),
    [
        (None, "cpu", 2, {}, 1),
        (None, "cpu", 16, {}, 15),
        (None, "cpu", 1, {}, 1),  # never below one
        (3, "cpu", 2, {}, 3),  # --threads wins
        (3, "cpu", 2, {OMP_ENV: "2"}, 3),
        (None, "cpu", 2, {OMP_ENV: "2"}, None),  # the user's OpenMP setting is kept
        (None, "cpu", 2, {OMP_ENV: "  "}, 1),  # a blank one is no setting
        (None, "cuda", 8, {}, None),
        (None, "cuda:1", 8, {}, None),
    ],
)
def test_serving_threads(
    requested: int | None, device: str, default: int, environ: dict[str, str], want: int | None
) -> None:
    count, why = serving_threads(requested, device, default, environ)
    assert count == want
    assert why.startswith(f"torch threads {default if want is None else want}")


@pytest.fixture
def torch_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _stop_before_the_engine(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make the engine's build fail as a user error, recording torch's threads at that point."""
    seen: list[int] = []

    def build(self: EngineOptions, *, long_lived: bool = False) -> None:
        seen.append(torch.get_num_threads())
        raise UserError("stopped by the test")

    monkeypatch.setattr(EngineOptions, "build", build)
    return seen


@pytest.mark.usefixtures("torch_threads")
def test_serve_leaves_a_core_to_the_server(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(OMP_ENV, raising=False)
    torch.set_num_threads(2)
    seen = _stop_before_the_engine(monkeypatch)
    assert main(["serve", "--port", "0", "--compile", "off"]) == 2
    assert seen == [1]
    assert "flashspec serve: torch threads 1 of 2" in capsys.readouterr().err


@pytest.mark.usefixtures("torch_threads")
def test_serve_threads_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    seen = _stop_before_the_engine(monkeypatch)
    assert main(["serve", "--port", "0", "--threads", "2", "--compile", "off"]) == 2
    assert seen == [2]


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_bad_threads_are_usage_errors(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--threads", value])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--threads" in err and "Traceback" not in err


def test_threads_with_replicas_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--replicas", "2", "--threads", "1", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("flashspec: error: ") and "--replica-cpus" in err[-1], err
