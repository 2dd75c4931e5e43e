"""Stopping: EOS, stop strings (also across round boundaries), max_new_tokens and each row's
context limit applied to a round's new tokens, cancelled rows, and the streamed text deltas."""

from __future__ import annotations

from collections.abc import Callable

from .generation import Generation, Row
from .results import StreamChunk, TokenLogprob


def row_room(gen: Generation, index: int, length: int) -> int:
    """Tokens batch row ``index`` may still emit, ``length`` its tokens (prompt and output)."""
    room = gen.max_new_tokens[index] - len(gen.rows[index].tokens)
    if gen.limit is not None:
        room = min(room, gen.limit - length)
    return room


def round_room(gen: Generation) -> int:
    """Tokens the coming round may emit per row: the most any live row still may. Each row's
    room counts from its own length and output, not the padded width (else a long prompt would
    cut the short rows beside it)."""
    width = gen.tokens.shape[1]
    return max(
        row_room(gen, index, width - left)
        for index, left in zip(gen.live, gen.padding.lefts, strict=True)
    )


def finish_rows(
    gen: Generation,
    new_tokens: list[list[int]],
    new_logprobs: list[list[TokenLogprob]] | None = None,
) -> tuple[list[StreamChunk], list[int]]:
    """Apply EOS, stop strings and limits to each live row's new tokens (already in
    ``gen.tokens``), and to their logprobs when the generation reports them.

    Returns:
        the round's chunks, and the positions (in ``gen.live``) of the rows still running.
    """
    width = gen.tokens.shape[1]
    chunks: list[StreamChunk] = []
    keep: list[int] = []
    for position, (index, tokens) in enumerate(zip(gen.live, new_tokens, strict=True)):
        row = gen.rows[index]
        # Rows have their own limits; the round was sized for the one with most room.
        before_round = width - gen.padding.lefts[position] - len(tokens)
        room = row_room(gen, index, before_round)
        tokens = tokens[:room]
        at_limit = gen.limit is not None and before_round + len(tokens) >= gen.limit
        for cut, token in enumerate(tokens):
            if token in gen.eos:
                tokens = tokens[: cut + 1]
                row.finish = "eos"
                break
        before = len(row.tokens)
        row.tokens.extend(tokens)
        if gen.decode is not None and gen.live_text:
            update_text(gen.decode, gen.stops[index], row, before)
        if row.finish is None and len(row.tokens) >= gen.max_new_tokens[index]:
            row.finish = "length"
        if row.finish is None and at_limit:
            row.finish = "context_limit"
        gen.stats.new_tokens += len(row.tokens) - before
        text = text_delta(row)
        logprobs = None
        if new_logprobs is not None:
            # The logprobs follow the tokens kept (a stop string may have cut some).
            row.logprobs.extend(new_logprobs[position][: len(tokens)])
            del row.logprobs[len(row.tokens) :]
            logprobs = row.logprobs[before:]
        chunks.append(StreamChunk(index, row.tokens[before:], text, row.finish, logprobs))
        if row.finish is None:
            keep.append(position)
    return chunks, keep


def update_text(
    decode: Callable[[list[int]], str], stops: tuple[str, ...], row: Row, before: int
) -> None:
    """Decode the row's text; end it at the first stop string (kept in the output)."""
    row.text = decode(row.tokens)
    if not stops:
        return
    # Search the whole new text, so a stop string split across rounds is found.
    hits = [(found + len(s), s) for s in stops if (found := row.text.find(s)) >= 0]
    if not hits:
        return
    end, _ = min(hits)
    # Keep tokens up to the one that completes the stop string; cut the text right after it.
    for count in range(before + 1, len(row.tokens) + 1):
        if len(decode(row.tokens[:count])) >= end:
            del row.tokens[count:]
            break
    row.text = row.text[:end]
    row.finish = "stop"


def text_delta(row: Row) -> str:
    """The row's text not streamed yet (an incomplete last character waits)."""
    text = row.text
    if row.finish is None:
        # A trailing U+FFFD is usually half of a multi-byte character: wait for the rest.
        text = text.rstrip("\ufffd")
    delta = text[row.streamed :] if len(text) > row.streamed else ""
    row.streamed = max(row.streamed, len(text))
    return delta


def cancel_rows(gen: Generation) -> tuple[list[StreamChunk], list[int]]:
    """Finish the rows ``TokenStream.cancel`` named, live or still waiting to join.

    Returns:
        their last chunks, and the positions (in ``gen.live``) of the rows still running.
    """
    chunks: list[StreamChunk] = []
    keep: list[int] = []
    for index, _ in gen.joining:
        if index in gen.cancelled:  # cancelled before it joined the batch
            gen.rows[index].finish = "cancelled"
            chunks.append(StreamChunk(index, [], "", "cancelled"))
    gen.joining = [(index, ids) for index, ids in gen.joining if index not in gen.cancelled]
    for position, index in enumerate(gen.live):
        if index in gen.cancelled:
            row = gen.rows[index]
            row.finish = "cancelled"
            if gen.decode is not None and gen.live_text:
                row.text = gen.decode(row.tokens)
            chunks.append(StreamChunk(index, [], text_delta(row), row.finish))
        else:
            keep.append(position)
    return chunks, keep
