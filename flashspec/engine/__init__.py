"""The engine: ``SpeculativeEngine`` and what a generation returns.

One round, each step in one place (``SpeculativeEngine._round`` in ``loop``):

0. choose   the policy (``flashspec.select.policy``) picks the drafter and draft length, or
            plain decoding, from past rounds only;
1. draft    ``drafter.propose(gamma)``: up to gamma tokens per row (incremental forwards on the
            drafter's own cache);
2. verify   ``target.verify``: one target forward over the uncached committed tokens (normally
            just the pending one) plus the drafts;
3. accept   ``sampling.accept_*``: accept/reject on the device, then ONE host read per round;
4. commit   append the emitted tokens; every cache keeps each row's valid prefix (dead columns
            and a crop for attention, a restored snapshot for recurrent state:
            ``flashspec.kv.layout``, ``flashspec.kv.state``);
5. stop     EOS, stop strings, max_new_tokens, each row's context limit; stream the new text
            (``stopping``);
6. learn    the policy observes the round.

Modules: ``loop`` (the engine and the round), ``build`` (an engine from names; the compiled
path), ``drafting``, ``accept`` and ``commit`` (those steps of a round), ``joins`` (rows entering
and leaving the batch), ``hooks`` (``RoundView``), ``row_sampling`` (each row's temperature,
top-k, top-p and seed), ``inputs`` (prompts, per-row limits), ``generation`` (the state of a
running generation), ``stopping``, ``results`` (stats, result, stream).

Batches are ragged (``FlashSpecConfig.batching="ragged"``, the default). Each round every live
row emits its own accepted drafts and then its own replacement token (residual, argmax or
bonus), exactly the round it would run alone: rows share the forwards but no random draw and no
decision, so each row's output is exact by the batch-1 argument. In the token matrix the rows
stay right-aligned (a row that emitted fewer moves right, its left padding grows); in each cache
a row's rejected drafts stay where they are as dead columns, masked, with explicit positions,
and are packed away once there are enough (``flashspec.kv.layout``). Rows can also join a running
generation (``TokenStream.join``): their prompts are read into the caches before the next round.

Lockstep (``batching="lockstep"``, and always for models whose caches cannot keep rows apart:
windowed attention (sliding-window, chunked, local) and recurrent ones): every live row emits m + 1
tokens, where m is the smallest number of drafts accepted by any live row: its first m drafts, then
the token at position m (its own accepted draft m if it accepted more than m, else the rule's
replacement). This is exact too: whether a row emits position i this round depends only on accept
events at positions before i (of this and other rows, all independent of the token at i), and a
token that reaches position i is distributed as the target's conditional there, whether it is an
accepted draft, a residual draw or the bonus token. So every emitted token follows the target given
the row's past, whichever round produced it. Rows that finish leave the batch (their cache rows are
dropped).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..legacy import earlier_module
from ..select.policy import Arm
from .hooks import RoundView
from .loop import SpeculativeEngine
from .results import GenerationResult, GenerationStats, StreamChunk, TokenLogprob, TokenStream

# TargetModel and load_drafters: the earlier library imported them from here (flashspec.legacy).
__all__ = [
    "Arm",
    "GenerationResult",
    "GenerationStats",
    "RoundView",
    "SpeculativeEngine",
    "StreamChunk",
    "TargetModel",
    "TokenLogprob",
    "TokenStream",
    "load_drafters",
]

# Imported here for type checkers only; at run time flashspec.legacy resolves them on first use.
if TYPE_CHECKING:
    from ..drafters import load_drafters
    from ..models import TargetModel

__getattr__, __dir__, _EARLIER_NAMES = earlier_module(globals())
