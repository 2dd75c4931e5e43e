"""Each row's sampling settings, from ``generate``/``stream``'s ``sampling`` and ``seed`` and from
``TokenStream.join``, and what the rows of one generation must share.

Per row: temperature (0: greedy), top-k, top-p, the seed, the penalties and the logit bias
(``RowSampling``); the round warps each row by its own (``RowWarper``), changes each row's
logits by its own penalties and bias (``flashspec.engine.penalties``), and a row with a seed of
its own draws only from its own generator (``RowRandom``). Everything else in
``SamplingConfig`` is the generation's, and rows that differ there cannot share it
(``check_shared`` names the field):

* ``gamma``, ``dynamic_gamma``, ``max_gamma``: the policy chooses one arm and draft length
  per round for the whole batch (``flashspec.select.policy``);
* ``method``'s choice between rejection sampling (exact) and typical acceptance (lossy), and
  ``typical_epsilon``/``typical_delta``: one accept rule runs per round. Greedy rows sit in
  either (a point mass is accepted exactly by both);
* ``residual``: one sampling backend per round;
* ``confidence_threshold``: the draft model's stop, set once per round.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from .._validate import is_int
from ..config import SamplingConfig
from .generation import Generation, RowSampling

PER_ROW_FIELDS = frozenset(
    {
        "temperature",
        "top_k",
        "top_p",
        "seed",
        "method",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
    }
)
"""The ``SamplingConfig`` fields rows of one generation may set apart (``method`` as far as it
follows the temperature: greedy beside rejection or beside typical, see the module docstring)."""


def check_shared(base: SamplingConfig, other: SamplingConfig, where: str) -> None:
    """Raise unless ``other`` shares every generation-wide setting with ``base``.

    Raises:
        ValueError: naming the first field that differs.
    """
    for item in dataclasses.fields(SamplingConfig):
        name = item.name
        if name in PER_ROW_FIELDS:
            continue
        mine, theirs = getattr(base, name), getattr(other, name)
        if mine != theirs:
            raise ValueError(
                f"{where}.{name} is {theirs!r} but the generation's is {mine!r}: rows of one "
                "generation differ only in temperature, top_k, top_p, seed, penalties and "
                "logit_bias; start another "
                "generation for other settings"
            )


def check_bias_ids(rows: Sequence[RowSampling], vocab: int) -> None:
    """Raise unless every row's ``logit_bias`` names tokens of the target's vocabulary.

    Raises:
        ValueError: naming the first id outside it.
    """
    for row in rows:
        bias = row.penalties.logit_bias if row.penalties is not None else None
        outside = [t for t in bias or () if t >= vocab]
        if outside:
            raise ValueError(
                f"logit_bias names token {outside[0]}, outside the target's vocabulary of "
                f"{vocab} tokens; use ids below {vocab}"
            )


def _typical(config: SamplingConfig) -> bool | None:
    """Whether a sampling row accepts typically (None for a greedy row, which fits both)."""
    return None if config.temperature == 0 else config.resolved_method == "typical"


def per_row_configs(
    sampling: SamplingConfig | Sequence[SamplingConfig | None] | None,
    default: SamplingConfig,
    rows: int,
) -> list[SamplingConfig]:
    """``sampling`` (one for all, or one per prompt row, None items the engine's) per row.

    Raises:
        TypeError / ValueError: not a SamplingConfig, or not one per row.
    """
    if sampling is None:
        return [default] * rows
    if isinstance(sampling, SamplingConfig):
        return [sampling] * rows
    if not isinstance(sampling, Sequence) or isinstance(sampling, (str, bytes)):
        raise TypeError(
            "sampling must be a SamplingConfig, a list of them (one per prompt row) or None, "
            f"got {type(sampling).__name__}"
        )
    configs = list(sampling)
    if len(configs) != rows:
        raise ValueError(
            f"sampling given per row needs one SamplingConfig (or None) per prompt row "
            f"({rows}), got {len(configs)}"
        )
    for i, config in enumerate(configs):
        if config is not None and not isinstance(config, SamplingConfig):
            raise TypeError(
                f"sampling[{i}] must be a SamplingConfig or None, got {type(config).__name__}"
            )
    return [default if config is None else config for config in configs]


def _row(config: SamplingConfig, seed: int | None, device: torch.device) -> RowSampling:
    """A row warped by ``config`` (temperature, top-k, top-p), its logits changed by its
    penalties and bias; with ``seed``, drawing from a generator of its own."""
    temperature, top_k, top_p = _warp(config)
    penalties = config if config.penalized else None
    if temperature == 0:
        return RowSampling(0.0, top_k, top_p, penalties=penalties)
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
    return RowSampling(
        temperature, top_k, top_p, generator, seeded=seed is not None, penalties=penalties
    )


def _warp(config: SamplingConfig) -> tuple[float, int, float]:
    return config.temperature, config.top_k, config.top_p


def start_sampling(
    gen_rows: int,
    sampling: SamplingConfig | Sequence[SamplingConfig | None] | None,
    seed: int | Sequence[int | None] | None,
    default: SamplingConfig,
    device: torch.device,
) -> tuple[SamplingConfig, torch.Generator, list[RowSampling], bool | None]:
    """A generation's sampling: (the settings its rows share, the shared generator, each
    row's ``RowSampling``, whether its sampling rows accept typically (None: none samples)).

    Seeds: ``seed`` as one int seeds the generator a batch's rows share, so the batch is one
    reproducible stream (as is the one row of a single prompt, which then draws from a
    generator of its own); a list of them, or ``sampling`` given per row, seeds each row on
    its own (``seed`` None: each row's ``SamplingConfig.seed``).

    Raises:
        TypeError / ValueError: bad ``sampling`` or ``seed``, or rows that differ where they
            must not (``check_shared``).
    """
    configs = per_row_configs(sampling, default, gen_rows)
    base = configs[0]
    for i, other in enumerate(configs[1:], start=1):
        check_shared(base, other, f"sampling[{i}]")
    kinds = {_typical(config) for config in configs} - {None}
    if len(kinds) > 1:
        raise ValueError(
            "rows of one generation sample either exactly (method 'rejection' or 'auto') or "
            "typically (method 'typical'), not both; start another generation for the others"
        )
    typical = kinds.pop() if kinds else None
    if isinstance(seed, Sequence) and not isinstance(seed, (str, bytes)):
        seeds = list(seed)
        if len(seeds) != gen_rows or any(s is not None and not is_int(s) for s in seeds):
            raise ValueError(
                f"seed given per row needs one integer (or None) per prompt row ({gen_rows}), "
                f"got {seed!r}"
            )
        shared: int | None = None
    elif seed is not None:
        if not is_int(seed):
            raise ValueError(f"seed must be an integer, a list of them or None, got {seed!r}")
        seeds, shared = [None] * gen_rows, int(seed)
    elif isinstance(sampling, Sequence):
        seeds, shared = [config.seed for config in configs], None
    else:
        seeds, shared = [None] * gen_rows, base.seed
    if shared is not None and gen_rows == 1:
        seeds, shared = [shared], None
    generator = torch.Generator(device=device)
    if shared is not None:
        generator.manual_seed(shared)
        rows = [
            dataclasses.replace(_row(c, None, device), seeded=c.temperature > 0) for c in configs
        ]
    else:
        generator.seed()
        rows = [_row(c, s, device) for c, s in zip(configs, seeds, strict=True)]
    return base, generator, rows, typical


def join_sampling(
    gen: Generation, sampling: SamplingConfig | None, seed: int | None
) -> RowSampling:
    """The settings of a row joining ``gen`` (``TokenStream.join``): ``sampling`` (None: the
    generation's first row's), seeded by ``seed`` or else its ``sampling.seed`` on a
    generator of its own (no seed: it draws from the shared one).

    Raises:
        TypeError / ValueError: as ``start_sampling``.
    """
    if sampling is not None and not isinstance(sampling, SamplingConfig):
        raise TypeError(f"sampling must be a SamplingConfig or None, got {type(sampling).__name__}")
    if seed is not None and not is_int(seed):
        raise ValueError(f"seed must be an integer or None, got {seed!r}")
    if sampling is None:
        first = gen.row_sampling[0] if gen.row_sampling else None
        config = gen.sampling
        if first is not None:
            temperature, top_k, top_p = first.warp
            config = first.penalties or dataclasses.replace(
                gen.sampling, repetition_penalty=1.0, presence_penalty=0.0,
                frequency_penalty=0.0, logit_bias=None,
            )  # fmt: skip
            config = dataclasses.replace(config, temperature=temperature, top_k=top_k, top_p=top_p)
        kind = None if config.temperature == 0 else gen.typical
    else:
        check_shared(gen.sampling, sampling, "sampling")
        config, kind = sampling, _typical(sampling)
        if seed is None:
            seed = sampling.seed
    if kind is not None:
        if gen.typical is not None and kind != gen.typical:
            raise ValueError(
                "this generation samples "
                + ("typically" if gen.typical else "exactly")
                + "; a row that samples otherwise needs another generation"
            )
        gen.typical = kind
    return _row(config, seed, gen.tokens.device)
