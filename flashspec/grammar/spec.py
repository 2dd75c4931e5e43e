"""What a structured-output request asks for, checked before anything is compiled: hostile
schemas (deep nesting, huge bodies) are refused here, in microseconds, with the field named."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

GrammarKind = Literal["json_schema", "json_object", "regex", "lark"]
KINDS: tuple[GrammarKind, ...] = ("json_schema", "json_object", "regex", "lark")
MAX_SOURCE = 64 * 1024
"""Largest schema (as JSON), regular expression or grammar accepted, in characters."""
MAX_DEPTH = 32
"""Deepest nesting of a JSON schema accepted (objects and arrays)."""


class GrammarError(ValueError):
    """A grammar that cannot be used: its message names the problem and what to do."""


@dataclass(frozen=True)
class Grammar:
    """A constraint on the generated text.

    Attributes:
        kind: ``"json_schema"`` (``source``: the schema, a JSON string or a dict),
            ``"json_object"`` (any JSON object; no source), ``"regex"`` (the text must match
            ``source`` whole), ``"lark"`` (a Lark grammar, llguidance's dialect).
        source: the schema, expression or grammar (a JSON string for schemas: ``from_schema``
            takes a dict).
    """

    kind: GrammarKind
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"grammar kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.source, str):
            raise GrammarError(f"grammar source must be a string, got {type(self.source).__name__}")
        if len(self.source) > MAX_SOURCE:
            raise GrammarError(
                f"the {self.kind} is {len(self.source)} characters; at most {MAX_SOURCE} are "
                "accepted"
            )
        if self.kind in ("regex", "lark") and not self.source:
            raise GrammarError(f"a {self.kind} grammar needs a source")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.source)
            except (ValueError, RecursionError):
                raise GrammarError("the JSON schema is not valid JSON") from None
            if not isinstance(schema, (dict, bool)):
                raise GrammarError(
                    f"a JSON schema must be an object (or true/false), got {type(schema).__name__}"
                )
            depth = _depth(schema)
            if depth > MAX_DEPTH:
                raise GrammarError(
                    f"the JSON schema nests {depth} levels deep; at most {MAX_DEPTH} are accepted"
                )

    @classmethod
    def from_schema(cls, schema: dict[str, Any] | str | bool) -> Grammar:
        """A JSON-schema grammar from a dict (or its JSON text)."""
        if isinstance(schema, str):
            return cls("json_schema", schema)
        try:
            text = json.dumps(schema)
        except (TypeError, ValueError, RecursionError):
            raise GrammarError("the JSON schema cannot be written as JSON") from None
        return cls("json_schema", text)

    def llguidance_source(self) -> str:
        """The grammar in llguidance's own form (``LLMatcher``'s argument)."""
        from llguidance import LLMatcher

        # Compact JSON unless the schema's "x-guidance" says otherwise: with free whitespace a
        # small model can fill its whole budget with newlines and never close the object.
        compact: Any = {"whitespace_flexible": False}
        if self.kind == "json_object":
            return str(LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=compact))
        if self.kind == "json_schema":
            return str(LLMatcher.grammar_from_json_schema(self.source, defaults=compact))
        if self.kind == "regex":
            return str(LLMatcher.grammar_from_regex(self.source))
        return str(LLMatcher.grammar_from_lark(self.source))


def _depth(value: Any, level: int = 0) -> int:
    """Nesting depth of parsed JSON, stopping early past ``MAX_DEPTH`` (no deep recursion)."""
    deepest = level
    stack: list[tuple[Any, int]] = [(value, level)]
    while stack:
        item, at = stack.pop()
        deepest = max(deepest, at)
        if at > MAX_DEPTH:
            return at
        if isinstance(item, dict):
            stack.extend((v, at + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, at + 1) for v in item)
    return deepest
