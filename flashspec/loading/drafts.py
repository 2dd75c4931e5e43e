"""Shared-head drafts from folders (``flashspec.drafters.shared_head``), and the ones flashspec
ships for named targets.

A shared-head draft is attached to its target when it loads (it uses the target's embedding and
head), so it loads after the target, into the drafter its kind needs: ``FeatureDrafter`` for a
draft that reads the target's hidden states, ``ModelDrafter`` for one that reads tokens.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from ..drafters.shared_head import CONFIG_FILE, draft_input, load_shared_head_draft

if TYPE_CHECKING:
    from ..drafters import Drafter
    from ..models import TargetModel

LOG = logging.getLogger("flashspec")

DRAFTS_DIR = Path(__file__).resolve().parent.parent / "drafts"
"""The drafts the package carries (package data), a folder each."""

BUNDLED_DRAFTS: dict[str, str] = {"smollm2": "smollm2"}
"""Named target (``flashspec.loading.named``) to the folder of its draft in ``DRAFTS_DIR``,
trained by ``scripts/train_draft.py`` (its card.json says how)."""


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
    if draft_input(draft) == "features":
        return FeatureDrafter(draft, name=label)
    return ModelDrafter(draft, name=label, tokenizer=target.tokenizer)


def bundled_drafter(target_name: str, target: TargetModel) -> Drafter | None:
    """The drafter of the draft shipped for the named target, attached to ``target``; None
    when there is none, or when it does not fit ``target`` (another file under the same name:
    logged as a warning, and the engine drafts without it)."""
    folder = bundled_draft(target_name)
    if folder is None:
        return None
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
