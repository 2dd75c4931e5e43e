"""Request bodies of ``flashspec serve``: pydantic models, their checks, and the error type.

Every problem with a request becomes an ``ApiError``: a 4xx in OpenAI's error shape, never a 500.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
)
from pydantic import ValidationError as PydanticValidationError

from ..grammar import Grammar, GrammarError

# The error shape is ``{"error": {"message", "type", "param", "code"}}``, always with a 4xx
# status. Fields are checked strictly (no "5" for 5, no true for 1):
# - unknown fields are refused (400 naming the field), as OpenAI does, so a typo such as
#   ``max_token`` is not silently ignored;
# - fields of the OpenAI API the engine cannot honour (``suffix``, tools...) are refused
#   with a 400 naming the field, unless they carry their neutral value (``suffix: ""``);
# - harmless fields (``user``, ``metadata``, ``store``, ``service_tier``,
#   ``parallel_tool_calls``) are accepted and ignored.
# Bodies must be UTF-8 JSON objects: invalid UTF-8 (CESU-8 included), nesting deeper than the
# parser goes, and lone UTF-16 surrogates in any string are refused with a 400 too.

MAX_SEED = 2**63 - 1
MAX_STOP_STRINGS = 4
MAX_N = 16
"""Choices per prompt at most (``n``)."""
MAX_LOGIT_BIAS = 300
"""Entries of ``logit_bias`` at most (OpenAI's bound)."""
MAX_TOP_LOGPROBS = 20
"""Alternatives per token at most (``top_logprobs``; ``logprobs`` of completions: 5)."""


class ApiError(Exception):
    """An HTTP error answered in OpenAI's error shape.

    Args:
        status: HTTP status code.
        message: what is wrong and how to fix it.
        type: OpenAI's error type ("invalid_request_error", "authentication_error"...).
        param: the request field at fault, if any.
        code: a short machine-readable code, if any.
        headers: extra response headers (Retry-After, WWW-Authenticate).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400 invalid_request_error."""
    return ApiError(400, message, param=param, code=code)


# ------------------------------------------------------------------------------------ models


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with the token counts."""

    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: StrictFloat | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: StrictFloat | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    # Not in OpenAI's API; vLLM and others accept it, and the engine supports it.
    top_k: StrictInt | None = Field(None, ge=0)
    stop: Any = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    seed: StrictInt | None = Field(None, ge=0, le=MAX_SEED)
    n: StrictInt | None = Field(None, ge=1, le=MAX_N)
    presence_penalty: StrictFloat | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: StrictFloat | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    # Not in OpenAI's API: HF's repetition penalty (vLLM's field too).
    repetition_penalty: StrictFloat | None = Field(None, gt=0.0, le=10.0, allow_inf_nan=False)
    # Token id (as a string, OpenAI's form) -> bias in [-100, 100]; checked in logit_bias_of.
    logit_bias: dict[str, Any] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    response_format: Any = None
    # Not in OpenAI's API: the output must match this regular expression / Lark grammar.
    regex: StrictStr | None = None
    grammar: StrictStr | None = None

    # Harmless: accepted and ignored.
    user: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None


class CompletionRequest(_Request):
    """``POST /v1/completions``."""

    prompt: Any
    # An integer: the token's logprob and this many alternatives (OpenAI allows 5; up to 20).
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # Candidates generated per prompt, of which the n with the highest mean token logprob
    # are returned (OpenAI's meaning); at least n, not with stream.
    best_of: StrictInt | None = Field(None, ge=1, le=MAX_N)
    # The prompt before each choice's text (with logprobs: the prompt tokens' own, the first
    # null), OpenAI's meaning.
    echo: StrictBool | None = None
    suffix: Any = None


class ChatMessage(BaseModel):
    """One chat message; ``content`` is a string or a list of text parts."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None
    name: StrictStr | None = None
    # A tool message answers an assistant's tool call; the id travels to the chat template
    # (templates of tool-using models read it), the fallback format shows only the content.
    tool_call_id: StrictStr | None = None


class ChatRequest(_Request):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None


def _absent_or(*neutral: object) -> Callable[[object], bool]:
    return lambda value: (
        value is None or any(value == n and type(value) is type(n) for n in neutral)
    )


# field -> (accepts the value?, why it is refused otherwise)
UNSUPPORTED: dict[str, tuple[Callable[[object], bool], str]] = {
    "suffix": (_absent_or(""), "suffix (insertion) is not supported; leave it out"),
    "tools": (lambda v: v is None or v == [], "tools (function calling) are not supported"),
    "tool_choice": (_absent_or("none"), "tool_choice is not supported (no tools)"),
    "functions": (lambda v: v is None or v == [], "functions are not supported"),
    "function_call": (_absent_or("none"), "function_call is not supported"),
}


def check_unsupported(request: BaseModel) -> None:
    """Refuse fields that carry a value the server cannot honour.

    Raises:
        ApiError: 400 naming the first such field.
    """
    for name, (accepts, why) in UNSUPPORTED.items():
        if name in type(request).model_fields and not accepts(getattr(request, name)):
            raise invalid(f"{name}: {why}", param=name, code="unsupported_parameter")


# ------------------------------------------------------------------------------------ parsing


def parse_body(
    raw: bytes,
    model: type[_Request],
    precheck: Callable[[dict[str, Any]], None] | None = None,
) -> Any:
    """Bytes of a request body -> a validated ``model`` instance.

    ``precheck`` sees the parsed object before any validation: a check there refuses a body
    without the cost of validating (or rendering) its fields.

    Raises:
        ApiError: 400 for malformed JSON, a non-object body, or any invalid field, and what
            ``precheck`` raises.
    """
    try:
        # Strict UTF-8: json.loads(bytes) would decode with "surrogatepass", letting CESU-8
        # (UTF-8-encoded surrogates) through as lone surrogates.
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid(
            f"the request body is not UTF-8 text (invalid byte at offset {exc.start}); "
            "send JSON encoded in UTF-8",
            code="invalid_json",
        ) from None
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise invalid(
            "the request body nests arrays or objects too deeply for this server to parse; "
            "no field of the API nests more than a few levels, so flatten it",
            code="invalid_json",
        ) from None
    except ValueError as exc:
        raise invalid(
            f"the request body is not valid JSON ({exc}); send a JSON object with "
            "Content-Type: application/json",
            code="invalid_json",
        ) from None
    if not isinstance(data, dict):
        raise invalid(
            f"the request body must be a JSON object, got a JSON {_json_kind(data)}",
            code="invalid_json",
        )
    if precheck is not None:
        precheck(data)
    # "\ud800" escapes are valid JSON but not Unicode text: no tokenizer (nor UTF-8 encoder
    # of a response echoing them) accepts a lone surrogate. Only escapes can produce one once
    # the bytes decoded strictly, so bodies without a surrogate escape skip the walk.
    if _SURROGATE_ESCAPE.search(text):
        check_unicode(data)
    try:
        request = model.model_validate(data)
    except PydanticValidationError as exc:
        raise validation_error(exc) from None
    check_unsupported(request)
    return request


# A \u escape of a UTF-16 surrogate (D800-DFFF), paired or not; the walk tells them apart.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def check_unicode(data: object) -> None:
    """Refuse a parsed body holding a lone surrogate in any string, field names included.

    Depth first in document order, with a stack of iterators: no recursion (bodies can nest
    deeply) and memory in the depth, not the size, of the body.

    Raises:
        ApiError: 400 naming the first field (dotted, as in other errors) that holds one.
    """
    if not isinstance(data, dict | list):
        return
    stack: list[tuple[tuple[str, ...], Iterator[tuple[str, object]]]] = [((), _children(data, ()))]
    while stack:
        path, children = stack[-1]
        for key, item in children:
            if isinstance(item, str):
                at = _lone_surrogate(item)
                if at is not None:
                    raise _surrogate_error((*path, key), f"at character {at} of its text", item[at])
            elif isinstance(item, dict | list):
                inner = (*path, key)
                stack.append((inner, _children(item, inner)))
                break
        else:
            stack.pop()


def _children(
    value: dict[str, object] | list[object], path: tuple[str, ...]
) -> Iterator[tuple[str, object]]:
    """(name, item) of an object's fields (their names checked) or an array's items."""
    if isinstance(value, list):
        yield from ((str(i), item) for i, item in enumerate(value))
        return
    for key, item in value.items():
        at = _lone_surrogate(key)
        if at is not None:
            # The name cannot be quoted (nor sent back as param): name its parent.
            raise _surrogate_error(path, "in the name of one of its fields", key[at])
        yield key, item


def _lone_surrogate(text: str) -> int | None:
    """Index of the first lone surrogate in ``text`` (None: valid Unicode)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return int(exc.start)
    return None


def _surrogate_error(path: tuple[str, ...], where: str, char: str) -> ApiError:
    param = ".".join(path) if path else None
    subject = param if param is not None else "the request body"
    return invalid(
        f"{subject}: a lone UTF-16 surrogate (U+{ord(char):04X}) {where}, which is not "
        "Unicode text; encode characters outside the BMP as a surrogate pair "
        '("\\ud83d\\ude00") or as plain UTF-8',
        param=param,
        code="invalid_unicode",
    )


def _refuse_constant(name: str) -> Any:
    # json.loads would accept NaN and Infinity, which are not JSON.
    raise ValueError(f"{name} is not a JSON value")


def _json_kind(value: object) -> str:
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return "number"


def validation_error(exc: PydanticValidationError) -> ApiError:
    """The first error of a pydantic ValidationError as a 400 naming the field."""
    error = exc.errors()[0]
    # A field may be named "" ({"": 1}): still a field, so its param is "", not None.
    param = ".".join(str(part) for part in error["loc"]) if error["loc"] else None
    kind = error["type"]
    if kind == "extra_forbidden":
        message = f"unrecognized request field {_shorten(param)}; remove it (docs/server-api.md "
        message += "lists the fields this server supports)"
        return invalid(message, param=param, code="unknown_parameter")
    if kind == "missing":
        return invalid(f"{param} is required", param=param, code="missing_required_parameter")
    text = str(error["msg"])
    text = text[:1].lower() + text[1:]
    return invalid(f"{param}: {text}" if param else text, param=param)


def _shorten(name: str | None, limit: int = 80) -> str:
    """``repr(name)``, cut to ``limit`` characters: user text quoted in an error message."""
    text = repr(name)
    return text if len(text) <= limit else text[: limit - 4] + "...'"


def prompt_items(value: object) -> list[str | list[int]]:
    """A completion ``prompt`` -> one item per prompt: a string or a list of token ids.

    Raises:
        ApiError: 400 unless the prompt is a string, a non-empty list of strings, a list of
            token ids, or a non-empty list of such lists.
    """
    shapes = (
        "prompt must be a string, a list of strings, a list of token ids, or a list of "
        "token-id lists"
    )
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise invalid(shapes if value != [] else "prompt is empty", param="prompt")
    if all(isinstance(item, str) for item in value):
        return list(value)
    if all(_is_id(item) for item in value):
        return [list(value)]
    if all(isinstance(item, list) and all(_is_id(t) for t in item) for item in value):
        return [list(item) for item in value]
    raise invalid(shapes, param="prompt")


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def stop_strings(value: object) -> tuple[str, ...]:
    """``stop`` -> a tuple of non-empty strings (at most 4, as OpenAI allows).

    Raises:
        ApiError: 400 for anything else.
    """
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if (
        not isinstance(items, list)
        or not all(isinstance(s, str) and s for s in items)
        or len(items) > MAX_STOP_STRINGS
    ):
        raise invalid(
            f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} "
            f"non-empty strings, got {_describe(value)}",
            param="stop",
        )
    return tuple(dict.fromkeys(items))


def _describe(value: object) -> str:
    """A short description of a JSON value for an error message (never the value itself,
    which may be huge or nest deeply)."""
    if isinstance(value, list):
        kinds = sorted({_json_kind(item) for item in value})
        return f"an array of {len(value)} items ({', '.join(kinds) or 'empty'})"
    if isinstance(value, str):
        return "an empty string" if not value else "a string"
    return f"a JSON {'object' if isinstance(value, dict) else _json_kind(value)}"


def message_text(message: ChatMessage, index: int) -> str:
    """The text of a chat message: a string, null, or a list of ``{"type": "text"}`` parts.

    Raises:
        ApiError: 400 for other content (images, audio...).
    """
    content = message.content
    param = f"messages.{index}.content"
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise invalid(
                    f"{param}: only text is supported; each part must be "
                    '{"type": "text", "text": "..."}',
                    param=param,
                )
            parts.append(part["text"])
        return "".join(parts)
    raise invalid(f"{param} must be a string or a list of text parts", param=param)


# ------------------------------------------------------------------- sampling and structure


def logit_bias_of(request: _Request, vocab_size: int) -> dict[int, float] | None:
    """``logit_bias`` as token id -> bias, checked.

    Raises:
        ApiError: 400 naming ``logit_bias`` for a key that is not a token id of this model or
            a value that is not a number in [-100, 100].
    """
    bias = request.logit_bias
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not re.fullmatch(r"[0-9]{1,10}", key) or int(key) >= vocab_size:
            raise invalid(
                f"logit_bias: {key[:40]!r} is not a token id of this model (0 to "
                f"{vocab_size - 1}, as a string)",
                param="logit_bias",
            )
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok or not math.isfinite(value) or not -100 <= value <= 100:
            raise invalid(
                f"logit_bias[{key}] must be a number in [-100, 100], got {str(value)[:40]}",
                param="logit_bias",
            )
        out[int(key)] = float(value)
    return out


def grammar_of(request: _Request) -> Grammar | None:
    """The output structure the request asks for: ``response_format`` (``json_object``,
    ``json_schema``), or the ``regex`` / ``grammar`` (Lark) extra fields; None for text.

    Raises:
        ApiError: 400 naming the field for a malformed or hostile format (too large, too
            deep), or for more than one of them.
    """
    asked = [
        name
        for name in ("response_format", "regex", "grammar")
        if getattr(request, name) is not None
        and not (name == "response_format" and request.response_format == {"type": "text"})
    ]
    if not asked:
        return None
    if len(asked) > 1:
        raise invalid(f"give one of {', '.join(asked)}, not several", param=asked[1])
    name = asked[0]
    try:
        if name == "regex":
            return Grammar("regex", str(request.regex))
        if name == "grammar":
            return Grammar("lark", str(request.grammar))
        return _response_format(request.response_format)
    except GrammarError as exc:
        raise invalid(f"{name}: {exc}", param=name) from None


def _response_format(value: Any) -> Grammar:
    """OpenAI's ``response_format`` -> a grammar (``text`` is handled by the caller)."""
    kinds = ("text", "json_object", "json_schema")
    if not isinstance(value, dict) or value.get("type") not in kinds:
        raise GrammarError(
            'must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
            '"json_schema": {"name": ..., "schema": {...}}}'
        )
    if value["type"] == "json_object":
        if set(value) != {"type"}:
            raise GrammarError('{"type": "json_object"} takes no other field')
        return Grammar("json_object")
    spec = value.get("json_schema")
    if set(value) != {"type", "json_schema"} or not isinstance(spec, dict):
        raise GrammarError('{"type": "json_schema"} needs "json_schema": {"name", "schema"}')
    unknown = set(spec) - {"name", "schema", "strict", "description"}
    if unknown:
        raise GrammarError(f"json_schema has unknown fields {sorted(unknown)}")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict | bool):
        raise GrammarError("json_schema.schema must be a JSON schema object")
    return Grammar.from_schema(schema)
