"""Request bodies of ``flashspec serve``: pydantic models, their checks, and the error type.

Every problem with a request becomes an ``ApiError``, which the server answers in OpenAI's
error shape ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status, so no user
input can produce a 500. Fields are checked strictly (no "5" for 5, no true for 1):

- unknown fields are refused (400 naming the field), as OpenAI does, so a typo such as
  ``max_token`` is not silently ignored;
- fields of the OpenAI API that would change the output in ways the engine cannot honour
  (``n > 1``, ``logprobs``, ``echo``, ``logit_bias``, penalties, tools...) are refused with a
  400 naming the field, unless they carry their neutral value (``n: 1``, ``echo: false``);
- harmless fields (``user``, ``metadata``, ``store``, ``service_tier``,
  ``parallel_tool_calls``) are accepted and ignored.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt
from pydantic import ValidationError as PydanticValidationError

MAX_SEED = 2**63 - 1
MAX_STOP_STRINGS = 4


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

    # Accepted only with their neutral value (see UNSUPPORTED).
    n: Any = None
    logprobs: Any = None
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None

    # Harmless: accepted and ignored.
    user: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None


class CompletionRequest(_Request):
    """``POST /v1/completions``."""

    prompt: Any
    best_of: Any = None
    echo: Any = None
    suffix: Any = None


class ChatMessage(BaseModel):
    """One chat message; ``content`` is a string or a list of text parts."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None
    name: str | None = None


class ChatRequest(_Request):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    top_logprobs: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    parallel_tool_calls: Any = None


def _absent_or(*neutral: object) -> Callable[[object], bool]:
    return lambda value: (
        value is None or any(value == n and type(value) is type(n) for n in neutral)
    )


# field -> (accepts the value?, why it is refused otherwise)
UNSUPPORTED: dict[str, tuple[Callable[[object], bool], str]] = {
    "n": (_absent_or(1), "only n=1 is supported; send one request per completion"),
    "best_of": (_absent_or(1), "best_of is not supported; leave it out (or 1)"),
    "logprobs": (
        _absent_or(False),
        "logprobs are not supported by this server; leave the field out",
    ),
    "top_logprobs": (_absent_or(0), "top_logprobs are not supported; leave the field out"),
    "echo": (_absent_or(False), "echo is not supported; prepend the prompt yourself"),
    "suffix": (_absent_or(""), "suffix (insertion) is not supported; leave it out"),
    "logit_bias": (
        lambda v: v is None or v == {},
        "logit_bias is not supported (it would change the target's distribution)",
    ),
    "presence_penalty": (
        _absent_or(0, 0.0),
        "presence_penalty is not supported (speculative decoding reproduces the target's "
        "distribution exactly); leave it out or 0",
    ),
    "frequency_penalty": (
        _absent_or(0, 0.0),
        "frequency_penalty is not supported (speculative decoding reproduces the target's "
        "distribution exactly); leave it out or 0",
    ),
    "tools": (lambda v: v is None or v == [], "tools (function calling) are not supported"),
    "tool_choice": (_absent_or("none"), "tool_choice is not supported (no tools)"),
    "functions": (lambda v: v is None or v == [], "functions are not supported"),
    "function_call": (_absent_or("none"), "function_call is not supported"),
    "response_format": (
        lambda v: v is None or v == {"type": "text"},
        'only response_format {"type": "text"} is supported (no JSON mode)',
    ),
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


def parse_body(raw: bytes, model: type[_Request]) -> Any:
    """Bytes of a request body -> a validated ``model`` instance.

    Raises:
        ApiError: 400 for malformed JSON, a non-object body, or any invalid field.
    """
    try:
        data = json.loads(raw, parse_constant=_refuse_constant)
    except UnicodeDecodeError:
        raise invalid("the request body is not UTF-8 text; send JSON in UTF-8") from None
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
    try:
        request = model.model_validate(data)
    except PydanticValidationError as exc:
        raise validation_error(exc) from None
    check_unsupported(request)
    return request


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
    param = ".".join(str(part) for part in error["loc"]) or None
    kind = error["type"]
    if kind == "extra_forbidden":
        message = f"unrecognized request field {param!r}; remove it (see the README for the "
        message += "fields this server supports)"
        return invalid(message, param=param, code="unknown_parameter")
    if kind == "missing":
        return invalid(f"{param} is required", param=param, code="missing_required_parameter")
    text = str(error["msg"])
    text = text[:1].lower() + text[1:]
    return invalid(f"{param}: {text}" if param else text, param=param)


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
            f"non-empty strings, got {json.dumps(value)[:200]}",
            param="stop",
        )
    return tuple(dict.fromkeys(items))


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
