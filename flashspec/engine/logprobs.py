"""The target's log-probabilities of the tokens a round emits, from the logits that verified
them: no extra forward, and the same numbers plain decoding would report."""

from __future__ import annotations

import torch

from .results import TokenLogprob

MAX_TOP = 20
"""The most alternatives a token reports (OpenAI's ``top_logprobs`` bound)."""


def emitted_logprobs(
    logits: torch.Tensor, new_tokens: list[list[int]], top: int
) -> list[list[TokenLogprob]]:
    """Per row, a ``TokenLogprob`` for each of its ``new_tokens``.

    Args:
        logits: (rows, g + 1, V) the verification's raw logits; position i of a row is the
            distribution its i-th new token was drawn from (its accepted drafts, then the
            round's own token).
        new_tokens: per row, the round's tokens in order (at most g + 1).
        top: alternatives per token (0: the token's own logprob only).
    """
    rows = len(new_tokens)
    count = max((len(t) for t in new_tokens), default=0)
    if count == 0:
        return [[] for _ in range(rows)]
    # (rows, count, V) float32 log-softmax of the positions used; ids past a row's own count
    # are filler and never read.
    logp = logits[:, :count].float().log_softmax(dim=-1)
    ids = torch.tensor(
        [t + [0] * (count - len(t)) for t in new_tokens], dtype=torch.int64, device=logits.device
    )
    chosen: list[list[float]] = logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1).tolist()
    tops_values: list[list[list[float]]] = []
    tops_ids: list[list[list[int]]] = []
    if top > 0:
        values, indices = logp.topk(min(top, logp.shape[-1]), dim=-1)
        tops_values, tops_ids = values.tolist(), indices.tolist()
    out: list[list[TokenLogprob]] = []
    for b, tokens in enumerate(new_tokens):
        row: list[TokenLogprob] = []
        for i, token in enumerate(tokens):
            alternatives = (
                tuple(zip(tops_ids[b][i], tops_values[b][i], strict=True)) if top > 0 else ()
            )
            row.append(TokenLogprob(token, chosen[b][i], alternatives))
        out.append(row)
    return out


def prompt_logprobs(model: torch.nn.Module, ids: list[int], top: int) -> list[TokenLogprob]:
    """The target's log-probability of each prompt token after the first, given the tokens
    before it (and its ``top`` most likely alternatives): one forward of the whole prompt, no
    cache, the raw logits' log-softmax as for emitted tokens (what ``echo`` reports).

    Args:
        model: the target's causal LM.
        ids: the prompt's token ids (its first has no logprob: nothing precedes it).
        top: alternatives per token (0: the token's own logprob only).
    """
    if len(ids) < 2:
        return []
    device = next(model.parameters()).device
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids], device=device), use_cache=False).logits
    # Position i predicts token i + 1.
    return emitted_logprobs(logits[:, :-1], [list(ids[1:])], top)[0]
