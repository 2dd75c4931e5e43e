"""The one check behind every integer argument: an ``int`` that is not a ``bool``, in range.

Each caller keeps its own message (it names the field and a fix); this says what counts.
"""

from __future__ import annotations

from typing import TypeGuard


def is_int(value: object, minimum: int | None = None, maximum: int | None = None) -> TypeGuard[int]:
    """Whether ``value`` is an integer (``True``/``False`` are not) within [minimum, maximum]."""
    if isinstance(value, bool) or not isinstance(value, int):
        return False
    return (minimum is None or value >= minimum) and (maximum is None or value <= maximum)
