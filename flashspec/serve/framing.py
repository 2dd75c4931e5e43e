"""Checks on a request's HTTP framing that the app, its h11 protocol and the Ray ingress share.

Each takes the request's headers as ASGI and h11 both give them (lower-case names, bytes) and
raises an ``ApiError`` in OpenAI's shape.
"""

from __future__ import annotations

from collections.abc import Iterable

from .protocol import ApiError

Headers = Iterable[tuple[bytes, bytes]]

# The one media type the generation endpoints read. A browser may send text/plain, form and
# multipart bodies across origins without asking first (a "simple" request, no CORS preflight);
# refusing every other type means a web page cannot make a browser start generations, while an
# application/json POST from a page needs a preflight, which this server never grants.
JSON_MEDIA_TYPE = "application/json"
# Request line and headers that together take more bytes than this are refused (431).
DEFAULT_MAX_HEADER_BYTES = 16 * 1024


def header(headers: Headers, name: bytes) -> list[bytes]:
    """Every value of header ``name`` (lower-case), in order."""
    return [value for key, value in headers if key == name]


def check_content_type(headers: Headers) -> None:
    """Refuse a body that does not say it is UTF-8 JSON.

    ``application/json`` with any parameters passes, as long as a ``charset`` parameter, if
    given, names UTF-8 (the only encoding the body is read in).

    Raises:
        ApiError: 415 ``unsupported_media_type``, naming what came and what to send.
    """
    values = header(headers, b"content-type")
    if len(values) != 1:
        got = "no Content-Type" if not values else f"{len(values)} Content-Type headers"
        raise _unsupported(f"the request has {got}")
    text = values[0].decode("latin-1")
    media_type, *parameters = (part.strip() for part in text.split(";"))
    if media_type.lower() != JSON_MEDIA_TYPE:
        raise _unsupported(f"Content-Type {_quoted(text)} is not {JSON_MEDIA_TYPE}")
    for parameter in parameters:
        name, _, value = parameter.partition("=")
        charset = value.strip().strip('"').lower()
        if name.strip().lower() == "charset" and charset not in ("utf-8", "utf8"):
            raise _unsupported(
                f"Content-Type {_quoted(text)} names a charset other than UTF-8, the only one "
                "this server reads"
            )


def _unsupported(what: str) -> ApiError:
    return ApiError(
        415,
        f"{what}; send the body as UTF-8 JSON with the header 'Content-Type: {JSON_MEDIA_TYPE}'",
        code="unsupported_media_type",
    )


def _quoted(text: str, limit: int = 80) -> str:
    """``repr(text)``, cut to ``limit`` characters: a client's header quoted in a message."""
    shown = repr(text)
    return shown if len(shown) <= limit else shown[: limit - 4] + "...'"


def ambiguous_length(headers: Headers) -> ApiError | None:
    """The refusal of a request whose body length two headers give, else None.

    With both Content-Length and Transfer-Encoding, a proxy that trusts one and a server that
    trusts the other disagree on where the next request starts: the setup of request
    smuggling. RFC 9112 (6.1) lets a server refuse such a request and makes it close the
    connection either way; the refusal says so (``Connection: close``).
    """
    if not header(headers, b"content-length") or not header(headers, b"transfer-encoding"):
        return None
    return ApiError(
        400,
        "the request has both Content-Length and Transfer-Encoding, which disagree on where "
        "its body ends; send only one of them",
        code="invalid_http",
        headers={"Connection": "close"},
    )


def header_bytes(method: str, target: bytes, headers: Headers) -> int:
    """The size of a request line and headers as sent over HTTP/1.1 (CRLFs included)."""
    line = len(method) + 1 + len(target) + len(b" HTTP/1.1\r\n")
    return line + sum(len(k) + len(v) + 4 for k, v in headers) + 2


def headers_too_large(limit: int) -> ApiError:
    """The 431 of a request line and headers over ``limit`` bytes."""
    return ApiError(
        431,
        f"the request line and headers are larger than this server accepts ({limit} bytes); "
        "send fewer or shorter headers",
        code="headers_too_large",
    )
