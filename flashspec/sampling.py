"""Logit warping, token sampling and the accept/reject rules of a speculative round.

Shapes: B rows, g drafts, V vocabulary. The target scores the pending token plus g drafts, so
target tensors have g + 1 positions; position i (0-based) is the distribution of the token that
follows draft i - 1 (position 0 follows the last committed token, position g is the bonus).

Every ``accept_*`` function has two rules for batches. Ragged (``ragged=True``, what the engine
runs): each row emits its own accepted drafts and then its own replacement (residual, argmax or
bonus), exactly as that row would alone. Lockstep (the engine's ``batching="lockstep"``): with
m = the smallest number of drafts accepted by any row, every row emits its first m drafts and
then one token at position m; for a row that accepted more than m drafts that token is its own
accepted draft m. The functions stay on the device; the engine reads the result once.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import torch

from .config import ResidualBackend
from .profiling import spanned
from .row_random import RowRandom, uniforms

_NativeSample = Callable[
    [npt.NDArray[np.float32], npt.NDArray[np.float32], npt.NDArray[np.float64]], Any
]
_native_cache: list[_NativeSample | None] = []


def native_residual_sample() -> _NativeSample | None:
    """``flashspec._residual.residual_sample`` if the extension imports, else None."""
    if not _native_cache:
        try:
            module = importlib.import_module("flashspec._residual")
            _native_cache.append(cast(_NativeSample, module.residual_sample))
        except ImportError:
            _native_cache.append(None)
    return _native_cache[0]


# ---------------------------------------------------------------------------------------------
# Warping


@dataclass(frozen=True)
class Warper:
    """Temperature, top-k and top-p, in that order (the order HF ``generate`` uses).

    The same warper is applied to target and draft logits, so that rejection sampling compares
    the distributions the tokens are actually drawn from.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        """True for temperature 0 (argmax decoding)."""
        return self.temperature == 0

    def logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Warped float32 logits; filtered tokens get -inf. Temperature 0 is treated as 1.

        Any temperature > 0 works, down to the smallest float: as it tends to 0 the
        distribution tends to the argmax (ties share the mass evenly), and that is what a tiny
        temperature gives, not NaN.
        """
        x = logits.float()
        if self.temperature not in (0.0, 1.0):
            x = _divide_by_temperature(x, self.temperature)
        vocab = x.shape[-1]
        if 0 < self.top_k < vocab:
            x = x.masked_fill(x < _kth_largest(x, self.top_k), float("-inf"))
        if self.top_p < 1.0:
            # Drop the low tail whose total mass stays within 1 - top_p (a prefix of the
            # ascending order); the most likely token always survives.
            x = x.masked_fill(x < _top_p_threshold(x, self.top_p), float("-inf"))
        return x

    @spanned("warp")
    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Warped float32 probabilities over the last dimension."""
        return self.logits(logits).softmax(dim=-1)


@dataclass(frozen=True)
class RowWarper(Warper):
    """The warp of a batch whose rows sample with their own settings: row b's temperature,
    top-k and top-p (``temperatures[b]``, ``top_ks[b]``, ``top_ps[b]``) applied to all of
    its positions at once, as (B, 1) columns, so the batch still warps in one pass (one cut
    per distinct top-k). Row b's result is what ``Warper(temperatures[b], top_ks[b],
    top_ps[b])`` gives it, operation for operation, so a row's draws never depend on the
    settings beside it. The fields of ``Warper`` are unused.

    A row of temperature 0 decodes greedily: its probabilities are a point mass on the argmax
    (the first maximum, as ``accept_greedy``'s). Rejection sampling against a point mass
    accepts exactly the drafts equal to the argmax and otherwise emits the argmax (the residual
    and the bonus are that point mass), so a greedy row's output is the target's greedy
    output beside sampled rows as well.
    """

    temperatures: tuple[float, ...] = ()
    top_ks: tuple[int, ...] = ()
    top_ps: tuple[float, ...] = ()

    @property
    def greedy(self) -> bool:
        """True when every row decodes greedily."""
        return all(t == 0 for t in self.temperatures)

    def with_temperature(self, temperature: float) -> RowWarper:
        """Every row at ``temperature`` (a drafter's own), each keeping its top-k and top-p."""
        return dataclasses.replace(self, temperatures=(temperature,) * len(self.temperatures))

    @staticmethod
    def _column(values: Sequence[float], x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Per-row ``values`` shaped (B, 1, ..., 1) to broadcast over ``x``."""
        shape = (len(values), *([1] * (x.dim() - 1)))
        return torch.tensor(values, dtype=dtype, device=x.device).view(shape)

    def logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Warped float32 logits (B, ..., V), each row by its own settings (``Warper.logits``;
        temperature 0 is treated as 1)."""
        x = logits.float()
        temperatures = self.temperatures
        if any(0.0 < t < _F32_TINY for t in temperatures):
            # Below the smallest normal float32 a temperature needs the stepwise scaling;
            # such rows are rare enough to take one at a time.
            rows = [
                _divide_by_temperature(x[b : b + 1], t) if t not in (0.0, 1.0) else x[b : b + 1]
                for b, t in enumerate(temperatures)
            ]
            x = torch.cat(rows)
        elif any(t not in (0.0, 1.0) for t in temperatures):
            # As _divide_by_temperature: rows below 1 are shifted by their maximum first.
            if any(t < 1.0 for t in temperatures):
                low = self._column([0.0 < t < 1.0 for t in temperatures], x, torch.bool)
                x = torch.where(low, x - x.amax(dim=-1, keepdim=True), x)
            divisors = [1.0 if t == 0.0 else t for t in temperatures]
            x = x / self._column(divisors, x, torch.float32)
        vocab = x.shape[-1]
        ks = sorted({k for k in self.top_ks if 0 < k < vocab})
        if ks:
            kth = torch.full((*x.shape[:-1], 1), float("-inf"), device=x.device)
            for k in ks:
                chosen = self._column([r == k for r in self.top_ks], x, torch.bool)
                kth = torch.where(chosen, _kth_largest(x, k).to(x.device), kth)
            x = x.masked_fill(x < kth, float("-inf"))
        if any(p < 1.0 for p in self.top_ps):
            top_p = self._column(self.top_ps, x, torch.float64).expand(*x.shape[:-1], 1)
            cut = _top_p_threshold(x, top_p).to(x.device)
            cut = torch.where(top_p < 1.0, cut, float("-inf"))
            x = x.masked_fill(x < cut, float("-inf"))
        return x

    @spanned("warp")
    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Warped float32 probabilities over the last dimension; a point mass on the argmax
        for rows of temperature 0."""
        p = self.logits(logits).softmax(dim=-1)
        greedy = [t == 0 for t in self.temperatures]
        if any(greedy):
            best = argmax_last(logits).unsqueeze(-1)
            point = torch.zeros_like(p).scatter_(-1, best, 1.0)
            p = torch.where(self._column(greedy, p, torch.bool), point, p)
        return p


def argmax_last(x: torch.Tensor) -> torch.Tensor:
    """The index of the first maximum along the last dimension, int64 of ``x.shape[:-1]``:
    torch's argmax tie rule (the first maximal value; NaN counts as maximal), through NumPy
    for a CPU float32 tensor (its reduction of one wide row is several times quicker than
    torch's, and a greedy round takes one); torch's elsewhere."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.requires_grad or not x.dim():
        return x.max(dim=-1).indices
    return torch.from_numpy(np.asarray(x.numpy().argmax(axis=-1), dtype=np.int64))


# The smallest positive normal float32: a temperature below it has no float32 value (it would
# round to a subnormal or to 0, and x / 0 is NaN at the row's maximum).
_F32_TINY = float(torch.finfo(torch.float32).tiny)
_F32_MAX_EXPONENT = 127  # 2.0 ** 127 is a float32; 2.0 ** 128 is not


def _divide_by_temperature(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """``x / temperature`` up to a per-row shift (which softmax ignores), never NaN.

    Below temperature 1, ``x / T`` can overflow to inf and softmax then gives NaN (inf - inf).
    Subtracting each row's maximum first makes every value <= 0: the maximum becomes exactly
    0 and stays 0, the rest are negative and may only overflow to -inf, where their
    probability is 0 anyway. Temperatures of 1 or more cannot overflow and keep the plain
    division (the result HF's TemperatureLogitsWarper gives, rounding for rounding).
    """
    if temperature >= 1.0:
        return x / temperature
    shifted = x - x.amax(dim=-1, keepdim=True)
    if temperature >= _F32_TINY:
        return shifted / temperature
    # T = m * 2**e with 0.5 <= m < 1: divide by m (a normal float32), then scale by 2**-e in
    # float32-sized power-of-two steps. Each step is exact or overflows to -inf (the limit),
    # so the only rounding is that of the division by m, as in a float32 division by a
    # normal T; float64, which would hold T, is not available on every accelerator.
    mantissa, exponent = math.frexp(temperature)
    shifted = shifted / mantissa
    remaining = -exponent
    while remaining > 0:
        step = min(remaining, _F32_MAX_EXPONENT)
        shifted = shifted * 2.0**step
        remaining -= step
    return shifted


# torch.sort and torch.topk cost 0.5-1 ms for one 8k-vocabulary row on a small CPU, more than a
# draft model's step; NumPy's sort and partition do the same work in a few tens of µs. Ties
# between logits are kept together either way (a tie at the cut keeps every tied token).


def _sorted_values(x: torch.Tensor) -> torch.Tensor:
    """``x`` sorted ascending along the last dimension (values only)."""
    if x.device.type == "cpu":
        return torch.from_numpy(np.sort(x.detach().numpy(), axis=-1))
    return torch.sort(x, dim=-1).values


TopP = float | torch.Tensor
"""One top-p for every row, or a float64 tensor of shape (..., 1) with one per row of the
logits (a batch whose rows sample with their own settings, ``RowWarper``)."""


def _tail_limit(top_p: TopP) -> float | torch.Tensor:
    """1 - top_p as the comparison with float32 running sums sees it: a Python float is cast
    to float32 there, so per-row values are computed in float64 and cast the same way."""
    if isinstance(top_p, torch.Tensor):
        return (1.0 - top_p).to(torch.float32)
    return 1.0 - top_p


def _top_p_threshold_sorted(x: torch.Tensor, top_p: TopP) -> torch.Tensor:
    """The first value top-p keeps in each row, shape (..., 1), by HF's computation: the
    softmax of the ascending row, its running sum, the tail within 1 - top_p dropped. Only
    the sorted values are needed: the tokens kept are those at or above that value."""
    ascending = _sorted_values(x)
    tail_mass = ascending.softmax(dim=-1).cumsum(dim=-1)
    dropped = (tail_mass <= _tail_limit(top_p)).sum(dim=-1, keepdim=True)
    return ascending.gather(-1, dropped.clamp_max(x.shape[-1] - 1))


TOP_P_PARTIAL_VOCAB = 4096
"""From this vocabulary size a CPU row's top-p cut sorts only the tokens that can be kept."""


def _top_p_threshold(x: torch.Tensor, top_p: TopP) -> torch.Tensor:
    """``_top_p_threshold_sorted`` without sorting the whole vocabulary, on the CPU.

    A token whose probability is at most (1 - top_p) / V is always dropped: all such tokens
    together weigh at most 1 - top_p, and they are the lowest logits (probability is
    increasing in the logit), so they are a prefix of the ascending order that the tail
    contains. Only the others are sorted, their running sum starting from the mass of the
    dropped ones: a 49k-token vocabulary keeps a few hundred candidates, and the sort of the
    whole row was most of a sampled round's warping. The cut is the same set up to float
    rounding of the running sum (float64 here, float32 in HF's); a row whose candidates are
    many falls back to the full sort.
    """
    vocab = x.shape[-1]
    if x.device.type != "cpu" or vocab < TOP_P_PARTIAL_VOCAB:
        return _top_p_threshold_sorted(x, top_p)
    flat = x.detach().reshape(-1, vocab).contiguous()
    values = flat.numpy()
    probs = flat.softmax(dim=-1).numpy()
    rows = flat.shape[0]
    per_row = (
        top_p.expand(*x.shape[:-1], 1).reshape(-1).tolist()
        if isinstance(top_p, torch.Tensor)
        else [top_p] * rows
    )
    out = np.empty((rows, 1), dtype=np.float32)
    for row in range(rows):
        bound = (1.0 - per_row[row]) / vocab
        limit = np.float32(1.0 - per_row[row])
        candidate = probs[row] > bound
        count = int(np.count_nonzero(candidate))
        if count > vocab // 8:
            out[row] = _top_p_threshold_sorted(flat[row : row + 1], per_row[row]).numpy()[0]
            continue
        order = np.argsort(values[row][candidate], kind="stable")
        kept_values = values[row][candidate][order]
        tail = probs[row][~candidate].sum(dtype=np.float64)
        running = (tail + np.cumsum(probs[row][candidate][order], dtype=np.float64)).astype(
            np.float32
        )
        dropped = int(np.count_nonzero(running <= limit))
        out[row] = kept_values[min(dropped, count - 1)]
    return torch.from_numpy(out).reshape(*x.shape[:-1], 1)


def _kth_largest(x: torch.Tensor, k: int) -> torch.Tensor:
    """The k-th largest value of each row, shape (..., 1)."""
    if x.device.type == "cpu":
        cut = x.shape[-1] - k
        values = np.partition(x.detach().numpy(), cut, axis=-1)[..., cut : cut + 1]
        return torch.from_numpy(np.ascontiguousarray(values))
    return torch.topk(x, k, dim=-1).values[..., -1:]


# ---------------------------------------------------------------------------------------------
# Sampling primitives


def sample_inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Sample index i with probability weights[i] / sum(weights), one per row, by inverse CDF.

    Args:
        weights: non-negative (..., V), need not be normalised; every row must have positive mass.
        u: uniforms in [0, 1), shape (...).

    Returns:
        int64 indices, shape (...). Zero-weight entries are never returned.
    """
    cdf = weights.cumsum(dim=-1)
    total = cdf[..., -1:]
    x = u.to(cdf.dtype).unsqueeze(-1) * total
    # u * total can round up to total; the largest float below it still lands on a positive weight.
    x = torch.minimum(x, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x, right=True).squeeze(-1)


def residual_dist_torch(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Row-wise ``max(0, p - q) / sum(max(0, p - q))``; a row with no residual mass is p
    renormalised."""
    r = (p - q).clamp_min(0.0)
    total = r.sum(dim=-1, keepdim=True)
    empty = total <= 0
    r = torch.where(empty, p, r)
    total = torch.where(empty, p.sum(dim=-1, keepdim=True), total)
    return r / total


def residual_sample_torch(p: torch.Tensor, q: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """PyTorch equivalent of ``flashspec._residual.residual_sample`` for (B, V) inputs.

    Samples from ``max(0, p - q)`` renormalised (from p where the residual is empty) by inverse
    CDF with the given uniforms, so it agrees with the native kernel draw for draw up to rounding.
    """
    r = (p - q).clamp_min(0.0)
    empty = r.sum(dim=-1, keepdim=True) <= 0
    return sample_inverse_cdf(torch.where(empty, p, r), u)


@spanned("residual")
def residual_sample(
    p: torch.Tensor, q: torch.Tensor, u: torch.Tensor, backend: ResidualBackend = "auto"
) -> torch.Tensor:
    """Sample one token per row from the residual ``norm(max(0, p - q))``.

    Args:
        p, q: (B, V) probabilities (target, draft).
        u: (B,) uniforms in [0, 1).
        backend: ``"native"`` requires the C kernel and CPU float32 inputs; ``"torch"`` never uses
            it; ``"auto"`` uses it where it applies.

    Returns:
        int64 tensor (B,) on p's device.
    """
    if backend != "torch":
        native = native_residual_sample()
        applicable = (
            p.device.type == "cpu" and p.dtype == torch.float32 and q.dtype == torch.float32
        )
        if native is not None and applicable:
            out = native(
                p.detach().contiguous().numpy(),
                q.detach().contiguous().numpy(),
                u.detach().to(torch.float64).contiguous().numpy(),
            )
            return torch.from_numpy(np.asarray(out, dtype=np.int64))
        if backend == "native":
            why = (
                "flashspec._residual does not import"
                if native is None
                else f"inputs are {p.dtype} on {p.device}"
            )
            raise RuntimeError(
                f"SamplingConfig.residual='native' but {why}; the native kernel needs CPU float32. "
                "Use residual='auto' to fall back to PyTorch."
            )
    return residual_sample_torch(p, q, u)


# ---------------------------------------------------------------------------------------------
# Accept / reject


@dataclass
class Acceptance:
    """Outcome of one round, still on the device.

    Attributes:
        accepted: (B,) drafts each row would accept on its own (leading run).
        token: (B,) the token each row emits after its accepted drafts (ragged), or after the
            first ``min(accepted)`` drafts (lockstep).
        probability: (B, g) the probability with which each draft was accepted given the drafts
            before it (``min(1, p/q)``; 0 or 1 for the deterministic rules). Adaptive selection
            learns from it: it is the coin flip's expectation, so far less noisy than the flip.
    """

    accepted: torch.Tensor
    token: torch.Tensor
    probability: torch.Tensor


def _leading_run(ok: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of True per row of a (B, g) bool tensor."""
    return ok.to(torch.int64).cumprod(dim=1).sum(dim=1)


def _at(x: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """x[:, position] for a 0-dim device tensor, or x[b, position[b]] for a (B,) one, without
    reading it on the host."""
    if position.dim() == 0:
        return x.index_select(1, position.view(1)).squeeze(1)
    index = position.view(-1, 1, *([1] * (x.dim() - 2)))
    return x.gather(1, index.expand(-1, 1, *x.shape[2:])).squeeze(1)


def _emit_position(accepted: torch.Tensor, ragged: bool) -> torch.Tensor:
    """Where each row's replacement token comes from: its own run (ragged) or the batch's
    shortest (lockstep, a 0-dim tensor)."""
    return accepted if ragged else accepted.min()


def _within(ok: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """``ok`` (B, g) with the positions at or past each row's length (a draft the row did not
    propose, ``Proposal.lengths``) false."""
    if lengths is None:
        return ok
    columns = torch.arange(ok.shape[1], device=ok.device).unsqueeze(0)
    return ok & (columns < lengths.to(ok.device).unsqueeze(1))


def _draft_at(drafts: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    # Rows needing draft m exist only when m < g, so clamping for m == g is harmless.
    return _at(drafts, m.clamp(max=drafts.shape[1] - 1))


def accept_greedy(
    target_logits: torch.Tensor,
    drafts: torch.Tensor,
    *,
    ragged: bool = False,
    lengths: torch.Tensor | None = None,
) -> Acceptance:
    """Greedy verification: accept drafts while they equal the target's argmax.

    The emitted token is the target's argmax at the row's emit position (see the module
    docstring), so the output is the target's greedy continuation token for token.
    ``lengths`` (B,): drafts each row proposed (``Proposal.lengths``); None: all.
    """
    best = argmax_last(target_logits)  # (B, g + 1)
    g = drafts.shape[1]
    if g == 0:
        # A plain round: every row emits its argmax. Most rounds of a workload that drafting
        # does not pay for are these, and each torch call below costs more than the rule.
        empty = best.new_zeros((best.shape[0], 0), dtype=torch.float64)
        return Acceptance(
            accepted=best.new_zeros(best.shape[0]), token=best[:, 0], probability=empty
        )
    ok = _within(drafts == best[:, :g], lengths)
    accepted = _leading_run(ok)
    token = _at(best, _emit_position(accepted, ragged))
    return Acceptance(accepted=accepted, token=token, probability=ok.double())


def accept_rejection(
    p: torch.Tensor,
    q: torch.Tensor | None,
    drafts: torch.Tensor,
    generator: torch.Generator | RowRandom | None,
    backend: ResidualBackend = "auto",
    *,
    ragged: bool = False,
    lengths: torch.Tensor | None = None,
) -> Acceptance:
    """Speculative sampling (Leviathan et al. 2023, Algorithm 1), batched.

    Draft i is accepted with probability min(1, p_i(d_i) / q_i(d_i)). At its emit position m
    (see the module docstring) a row that rejected draft m draws from the residual
    norm(max(0, p_m - q_m)); at m = g it draws the bonus token from p_g (the residual against an
    all-zero q).

    Args:
        p: (B, g + 1, V) warped target probabilities.
        q: (B, g, V) the distributions the drafts were sampled from, or None when each draft was
            proposed deterministically (a point mass, as prompt lookup does).
        drafts: (B, g) int64.
        lengths: (B,) drafts each row proposed (``Proposal.lengths``); None: all g. A row
            whose run reaches its length draws the bonus token there from p, as at g.
    """
    batch, g = drafts.shape
    # A row drawing from its own generator takes one uniform per draft it proposed (a host
    # read of ``lengths``, which the engine made from a list).
    proposed = (
        lengths.tolist() if isinstance(generator, RowRandom) and lengths is not None else None
    )
    u = uniforms(generator, batch, g + 1, p.device, proposed)
    p_draft = p[:, :g].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    if q is None:
        ok = u[:, :g] < p_draft  # q(d) = 1
        probability = p_draft.double()
    else:
        q_draft = q.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
        ok = u[:, :g] * q_draft < p_draft
        # q(d) > 0 for a draft sampled from q; the floor only guards a hand-made proposal.
        probability = (p_draft.double() / q_draft.double().clamp_min(1e-300)).clamp(max=1.0)
    ok = _within(ok, lengths)
    probability = probability * _within(torch.ones_like(ok), lengths)
    accepted = _leading_run(ok)
    m = _emit_position(accepted, ragged)
    # (B, 1) per row, or a scalar: whether the emit position still has a draft to reject.
    if lengths is not None:
        rejected = (m < lengths.to(m.device)).view(-1, 1)
    else:
        rejected = (m < g).view(-1, 1) if ragged else m < g

    p_m = _at(p, m)
    if g == 0:
        q_m = torch.zeros_like(p_m)
    elif q is None:
        q_m = torch.zeros_like(p_m).scatter_(1, _draft_at(drafts, m).unsqueeze(1), 1.0)
        q_m = q_m * rejected
    else:
        q_m = _at(q, m.clamp(max=g - 1)) * rejected
    residual = residual_sample(p_m, q_m, u[:, g], backend).to(p.device)
    if g == 0:
        return Acceptance(accepted=accepted, token=residual, probability=probability)
    token = torch.where(accepted > m, _draft_at(drafts, m), residual)
    return Acceptance(accepted=accepted, token=token, probability=probability)


def accept_typical(
    p: torch.Tensor,
    drafts: torch.Tensor,
    generator: torch.Generator | RowRandom | None,
    epsilon: float,
    delta: float,
    *,
    ragged: bool = False,
    lengths: torch.Tensor | None = None,
) -> Acceptance:
    """LOSSY typical acceptance (as in Medusa): accept draft i while
    ``p_i(d_i) > min(epsilon, delta * exp(-H(p_i)))``; the replacement is drawn from p_m.

    The output does not follow the target's distribution; it trades fidelity for speed.
    """
    batch, g = drafts.shape
    p_draft = p[:, :g].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    entropy = -torch.special.xlogy(p[:, :g], p[:, :g]).sum(dim=-1)
    threshold = torch.clamp(delta * torch.exp(-entropy), max=epsilon)
    ok = _within(p_draft > threshold, lengths)
    accepted = _leading_run(ok)
    m = _emit_position(accepted, ragged)
    u = uniforms(generator, batch, 1, p.device, [0] * batch)[:, 0]
    fresh = sample_inverse_cdf(_at(p, m), u)
    if g == 0:
        return Acceptance(accepted=accepted, token=fresh, probability=ok.double())
    return Acceptance(
        accepted=accepted,
        token=torch.where(accepted > m, _draft_at(drafts, m), fresh),
        probability=ok.double(),
    )


@spanned("sample")
def draft_sample(
    probs: torch.Tensor,
    generator: torch.Generator | RowRandom | None,
    backend: ResidualBackend = "auto",
) -> torch.Tensor:
    """One token per row from (B, V) probabilities, by inverse CDF.

    On CPU float32 this goes through the native kernel too (the residual of p against q = 0 is
    p itself): one C call instead of several small torch ops, a few times faster per draft.
    """
    if isinstance(generator, RowRandom):
        u = generator.draft_uniforms(probs.device)
    else:
        u = torch.rand(
            (probs.shape[0],), generator=generator, device=probs.device, dtype=torch.float64
        )
    if backend == "torch" or probs.device.type != "cpu" or probs.dtype != torch.float32:
        return sample_inverse_cdf(probs, u)
    return residual_sample(probs, _zeros_like(probs), u, backend)


_zeros: dict[tuple[int, ...], torch.Tensor] = {}


def _zeros_like(x: torch.Tensor) -> torch.Tensor:
    # Cached: a fresh zero buffer per draft would cost about as much as the sampling itself.
    key = tuple(x.shape)
    zeros = _zeros.get(key)
    if zeros is None:
        if len(_zeros) > 64:
            _zeros.clear()
        zeros = _zeros[key] = torch.zeros(key, dtype=torch.float32)
    return zeros
