"""Stopping: EOS, stop strings (also across round boundaries), max_new_tokens and each row's
context limit applied to a round's new tokens, cancelled rows, and the streamed text deltas."""

from __future__ import annotations

from collections.abc import Callable

from .generation import Generation, Row
from .results import StreamChunk


def row_room(gen: Generation, index: int, left: int, generated: int, length: int) -> int:
    """Tokens batch row ``index`` (left padding ``left``) may still emit."""
    room = gen.max_new_tokens[index] - generated
    if gen.limit is not None:
        room = min(room, gen.limit - (length - left))
    return room


def round_room(gen: Generation) -> int:
    """Tokens the coming round may emit per row: the most any live row still may. Each row's
    context limit counts from its own length, not the padded width (else a long prompt would
    cut the short rows beside it)."""
    length = gen.tokens.shape[1]
    generated = length - gen.prompt_length  # the same for every live row (lockstep)
    return max(
        row_room(gen, index, left, generated, length)
        for index, left in zip(gen.live, gen.padding.lefts, strict=True)
    )


def finish_rows(
    gen: Generation, new_tokens: list[list[int]]
) -> tuple[list[StreamChunk], list[int]]:
    """Apply EOS, stop strings and limits to each live row's new tokens.

    Returns:
        the round's chunks, and the positions (in ``gen.live``) of the rows still running.
    """
    before_round = gen.tokens.shape[1] - len(new_tokens[0]) if new_tokens else 0
    chunks: list[StreamChunk] = []
    keep: list[int] = []
    for position, (index, tokens) in enumerate(zip(gen.live, new_tokens, strict=True)):
        row = gen.rows[index]
        # Rows have their own limits; the round was sized for the one with most room.
        left = gen.padding.lefts[position]
        room = row_room(gen, index, left, len(row.tokens), before_round)
        tokens = tokens[:room]
        at_limit = gen.limit is not None and before_round - left + len(tokens) >= gen.limit
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
        chunks.append(StreamChunk(index, row.tokens[before:], text, row.finish))
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
    """Finish the live rows ``TokenStream.cancel`` named.

    Returns:
        their last chunks, and the positions (in ``gen.live``) of the rows still running.
    """
    chunks: list[StreamChunk] = []
    keep: list[int] = []
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
