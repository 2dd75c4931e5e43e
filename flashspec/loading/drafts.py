"""Shared-head drafts from folders (``flashspec.drafters.shared_head``), and the ones flashspec
ships for named targets.

A shared-head draft is attached to its target when it loads (it uses the target's embedding and
head), so it loads after the target, into the drafter its kind needs: ``FeatureDrafter`` for a
draft that reads the target's hidden states, ``ModelDrafter`` for one that reads tokens.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..drafters.shared_head import CONFIG_FILE, draft_input, load_shared_head_draft
from ..quant.decoder import packs_dead_columns
from ..quant.draft_blocks import run_on_blocks
from .heap import release

if TYPE_CHECKING:
    from ..drafters import Drafter
    from ..models import TargetModel

LOG = logging.getLogger("flashspec")

DRAFTS_DIR = Path(__file__).resolve().parent.parent / "drafts"
"""The drafts the package carries (package data), a folder each."""

BUNDLED_DRAFTS: dict[str, str] = {"smollm2": "smollm2"}
"""Named target (``flashspec.loading.named``) to the folder of its draft in ``DRAFTS_DIR``,
trained by ``scripts/train_draft.py`` (its card.json says how)."""

CARD_FILE = "card.json"
FITS_KEY = "fits"
"""The key of a shipped draft's card that holds ``model_fingerprint`` of the model it was
trained on: another file of that model (a Q4_K_M download of SmolLM2, say) drafts with it too."""


def is_shared_head_folder(path: str | Path) -> bool:
    """Whether ``path`` is a folder holding a saved shared-head draft."""
    return (Path(path).expanduser() / CONFIG_FILE).is_file()


def bundled_draft(target: str | None) -> Path | None:
    """The folder of the draft flashspec ships for the named ``target``, or None (no such name,
    or a package built without it)."""
    if not isinstance(target, str):
        return None
    folder = BUNDLED_DRAFTS.get(target.lower())
    if folder is None:
        return None
    path = DRAFTS_DIR / folder
    return path if is_shared_head_folder(path) else None


def shared_head_drafter(
    folder: str | Path, target: TargetModel, name: str | None = None
) -> Drafter:
    """The shared-head draft in ``folder``, attached to ``target``, in the drafter its kind
    needs.

    Raises:
        ValueError: not a shared-head draft, or one made for another width or vocabulary.
    """
    from ..drafters import FeatureDrafter, ModelDrafter

    path = Path(folder).expanduser()
    draft = load_shared_head_draft(path, target.model)
    label = name or path.name
    if packs_dead_columns(target.model) and run_on_blocks(draft):
        LOG.info("flashspec: draft %s runs on Q8_0 blocks in the C step, as its target does "
                 "(FLASHSPEC_DRAFT_BLOCKS=0: its float layers)", label)  # fmt: skip
    release()  # the float layers the blocks replaced, and load temporaries
    if draft_input(draft) == "features":
        return FeatureDrafter(draft, name=label)
    return ModelDrafter(draft, name=label, tokenizer=target.tokenizer)


def model_fingerprint(model: Any, tokenizer: Any) -> dict[str, Any]:
    """What identifies a model to a draft trained on it: its width, depth and vocabulary
    size, and its tokens in id order (hashed). Quantizing the model again keeps all four; a
    draft only needs these to agree to draft well, and drafting never changes the output.

    Raises:
        ValueError: ``tokenizer`` is None.
    """
    config = model.config
    if tokenizer is None:
        raise ValueError("a model without a tokenizer has no tokens to compare")
    vocab: dict[str, int] = tokenizer.get_vocab()
    tokens = sorted(vocab.items(), key=lambda item: item[1])
    digest = hashlib.sha256(json.dumps(tokens, ensure_ascii=False).encode()).hexdigest()
    return {
        "hidden_size": int(config.hidden_size),
        "num_hidden_layers": int(config.num_hidden_layers),
        "vocab_size": int(config.vocab_size),
        "tokens_sha256": digest,
    }


def _fitting_draft(target: TargetModel) -> tuple[str, Path] | None:
    """The named target and folder of a shipped draft trained on ``target``'s model (its
    card's ``fits`` equal to ``target``'s fingerprint), or None."""
    fingerprint: dict[str, Any] | None = None
    for name, folder_name in BUNDLED_DRAFTS.items():
        folder = DRAFTS_DIR / folder_name
        card_path = folder / CARD_FILE
        if not is_shared_head_folder(folder) or not card_path.is_file():
            continue
        fits = json.loads(card_path.read_text()).get(FITS_KEY)
        if not isinstance(fits, dict):
            continue
        if fingerprint is None:
            try:
                fingerprint = model_fingerprint(target.model, target.tokenizer)
            except (AttributeError, TypeError, ValueError):  # no config or vocabulary to read
                return None
        if fits == fingerprint:
            return name, folder
    return None


def bundled_drafter(target_name: str, target: TargetModel) -> Drafter | None:
    """The drafter of the draft shipped for the named target, attached to ``target``; None
    when there is none, or when it does not fit ``target`` (another file under the same name:
    logged as a warning, and the engine drafts without it).

    A target given by another name (a GGUF file, a folder) drafts with a shipped draft when
    it is that draft's model (``model_fingerprint`` equal to the draft card's ``fits``); one
    log line says so.
    """
    folder = bundled_draft(target_name)
    if folder is None:
        found = _fitting_draft(target)
        if found is None:
            return None
        name, folder = found
        LOG.info(
            "flashspec: %s is the model of the draft shipped for %r (same width, depth and "
            "tokens); drafting with it",
            target.name,
            name,
        )
        target_name = name
    try:
        return shared_head_drafter(folder, target, name=f"{target_name.lower()}-draft")
    except ValueError as exc:
        LOG.warning(
            "flashspec: the draft shipped for %r does not fit %s (%s); drafting without it",
            target_name,
            target.name,
            exc,
        )
        return None
