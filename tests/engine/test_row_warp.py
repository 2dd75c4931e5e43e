"""``RowWarper`` and ``RowRandom`` against their one-row references.

Each row of a ``RowWarper`` must be exactly (bit for bit) what ``Warper`` with that row's
settings gives it, so a row's draws never depend on its neighbours' settings; a greedy row is
a point mass on ``accept_greedy``'s argmax. A row with a generator of its own must take from
it exactly the uniforms it would take alone, whatever the rows beside it draw.
"""

from __future__ import annotations

import pytest
import torch

from flashspec.row_random import FILLER, RowRandom, uniforms
from flashspec.sampling import RowWarper, Warper, accept_rejection

# (temperature, top_k, top_p); 1e-40 is below the smallest normal float32.
ROWS = [
    (1.0, 0, 1.0),
    (0.7, 0, 0.9),
    (1.6, 5, 1.0),
    (0.0, 3, 0.8),
    (0.3, 7, 0.5),
    (1e-40, 0, 1.0),
    (2.0, 2, 0.95),
]


@pytest.mark.parametrize("vocab", [40, 5000])  # 5000: the partial top-p cut on the CPU
@pytest.mark.parametrize("positions", [0, 3])  # (B, V) and (B, P, V) logits
def test_each_row_is_its_own_warpers(vocab: int, positions: int) -> None:
    generator = torch.Generator().manual_seed(vocab + positions)
    shape = (len(ROWS), vocab) if positions == 0 else (len(ROWS), positions, vocab)
    logits = torch.randn(shape, generator=generator) * 4
    logits[..., 1] = logits[..., 2]  # a tie at the top of some rows
    warper = RowWarper(
        temperatures=tuple(r[0] for r in ROWS),
        top_ks=tuple(r[1] for r in ROWS),
        top_ps=tuple(r[2] for r in ROWS),
    )
    warped, probs = warper.logits(logits), warper.probs(logits)
    for b, (temperature, top_k, top_p) in enumerate(ROWS):
        alone = Warper(temperature, top_k, top_p)
        assert torch.equal(warped[b : b + 1], alone.logits(logits[b : b + 1])), ROWS[b]
        if temperature == 0:
            best = logits[b].max(dim=-1).indices
            point = torch.nn.functional.one_hot(best, vocab).float()
            assert torch.equal(probs[b], point)
        else:
            assert torch.equal(probs[b : b + 1], alone.probs(logits[b : b + 1])), ROWS[b]
    assert not warper.greedy
    assert RowWarper(temperatures=(0.0, 0.0), top_ks=(0, 0), top_ps=(1.0, 1.0)).greedy


def test_a_rows_own_uniforms_do_not_depend_on_its_neighbours() -> None:
    """Row 1 has a generator of its own; rows 0 and 2 share another. Row 1's acceptance
    uniforms are its proposed drafts' then its replacement's, in the last column, and its
    draft uniforms stop at its cap: the same draws it would take alone."""
    own = torch.Generator().manual_seed(7)
    shared = torch.Generator().manual_seed(8)
    random = RowRandom([shared, own, shared], [False, True, False], caps=[4, 2, 4])
    drafts = torch.stack([random.draft_uniforms(torch.device("cpu")) for _ in range(4)])
    u = random.acceptance_uniforms(5, [4, 2, 1], torch.device("cpu"))
    alone = torch.Generator().manual_seed(7)
    want = torch.rand((2 + 3,), generator=alone, dtype=torch.float64)  # 2 drafts, then 2 + 1
    assert torch.equal(drafts[:2, 1], want[:2])
    assert torch.equal(drafts[2:, 1], torch.full((2,), FILLER, dtype=torch.float64))
    assert torch.equal(u[1, :2], want[2:4])
    assert u[1, 4] == want[4]
    # The shared rows draw as one block, as a batch without own generators does.
    block = torch.Generator().manual_seed(8)
    steps = [torch.rand((2, 1), generator=block, dtype=torch.float64) for _ in range(4)]
    assert torch.equal(drafts[:, [0, 2]], torch.cat(steps, dim=1).T)
    assert torch.equal(u[[0, 2]], torch.rand((2, 5), generator=block, dtype=torch.float64))


def test_a_shared_generator_draws_as_before() -> None:
    """Without own generators the uniforms are one (rows, columns) block, as they always were,
    so a batch of one setting draws what it drew before per-row sampling."""
    a, b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    got = uniforms(a, 4, 6, torch.device("cpu"), [1, 2, 3, 4])
    assert torch.equal(got, torch.rand((4, 6), generator=b, dtype=torch.float64))


def test_a_greedy_row_beside_sampled_rows_is_accepted_as_greedy() -> None:
    """Rejection sampling on a point mass: a draft equal to the argmax is accepted and any
    other rejected, the replacement (or bonus) is the argmax, whatever the uniforms."""
    vocab, g = 9, 3
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn((2, g + 1, vocab), generator=generator)
    best = logits.max(dim=-1).indices  # (2, g + 1)
    warper = RowWarper(temperatures=(0.0, 1.0), top_ks=(0, 0), top_ps=(1.0, 1.0))
    p = warper.probs(logits)
    q = torch.softmax(torch.randn((2, g, vocab), generator=generator), dim=-1)
    for trial in range(20):
        drafts = best[:, :g].clone()
        if trial % 2:
            drafts[0, 1] = (best[0, 1] + 1) % vocab  # the greedy row's second draft is wrong
        seeded = torch.Generator().manual_seed(trial)
        out = accept_rejection(p, q, drafts, seeded, ragged=True)
        want = 1 if trial % 2 else g
        assert int(out.accepted[0]) == want
        assert int(out.token[0]) == int(best[0, want])
