"""``flashspec serve``: an OpenAI-compatible HTTP server over a ``SpeculativeEngine``.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream: true``
as server-sent events in OpenAI's format), ``GET /v1/models``, ``GET /health`` and
``GET /metrics`` (Prometheus text). ``create_app`` builds the FastAPI app, ``serve`` runs it
with uvicorn, ``ServerThread`` runs it in a background thread (tests, load scripts).

Requests never touch the engine: each prompt becomes a job for the engine worker
(``flashspec._serve_worker``), one thread that owns the engine and runs queued jobs in
batches of up to ``max_batch`` rows. Batching is static: requests that arrive while a batch
runs wait for the next batch; rows that finish (or whose client left) leave the running batch.
The queue holds ``max_queue`` jobs; beyond that a request is answered 503 with Retry-After.

Reading and preparing a request is bounded too (docs/server.md lists every limit): headers
within ``header_timeout_s`` (``flashspec._serve_http``), the body within ``body_timeout_s``
and ``max_body_bytes``; parsing and tokenizing run on a thread of their own, off the event
loop, after a character count has refused any text too long to fit in the context.

Needs the ``[serve]`` extra: ``pip install 'flashspec[serve]'``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

try:
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from starlette.requests import ClientDisconnect
    from starlette.types import ASGIApp, Message, Receive, Scope, Send
except ImportError as exc:  # pragma: no cover - exercised without the extra installed
    raise ImportError(
        f"flashspec.server needs FastAPI and uvicorn ({exc}); "
        "install them with: pip install 'flashspec[serve]'"
    ) from exc

from ._serve_http import DEFAULT_HEADER_TIMEOUT_S, DEFAULT_MAX_HEADER_BYTES, guarded_protocol
from ._serve_metrics import Metrics, server_metrics
from ._serve_schema import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    invalid,
    message_text,
    parse_body,
    prompt_items,
    stop_strings,
)
from ._serve_worker import EngineWorker, Event, Job, QueueFull

if TYPE_CHECKING:
    from .config import Method, SamplingConfig
    from .engine import SpeculativeEngine

logger = logging.getLogger("flashspec.server")

API_KEY_ENV = "FLASHSPEC_API_KEY"
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
# From the end of the headers to the end of the body: 4 MiB at 140 kB/s.
DEFAULT_BODY_TIMEOUT_S = 30.0
# Tokenizers that normalize text (NFKC, lower-casing, whitespace rules) may shrink it; the
# character limit for their prompts allows for that.
NORMALIZED_TEXT_SLACK = 4
# OpenAI's default for /v1/completions; chat defaults to the rest of the context.
COMPLETION_DEFAULT_MAX_TOKENS = 16
# The chat default when the target declares no context limit.
UNBOUNDED_DEFAULT_MAX_TOKENS = 4096
# The fallback chat format (no chat template): the model would go on to write the user's
# next turn; this stop string ends the reply there.
FALLBACK_CHAT_STOP = "\nuser:"
# How often a non-streaming handler checks whether its client is still connected.
DISCONNECT_POLL_S = 0.25

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context_limit": "length"}
ENDPOINTS = frozenset(
    {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"}
)


# ------------------------------------------------------------------------------------ pieces


class StopTrimmer:
    """Turns a row's text deltas into OpenAI's: without the stop string that ended the row.

    The engine keeps a stop string in its output; OpenAI's API leaves it out. Text that could
    be the beginning of a stop string is held back until the next delta shows it is not.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.text = ""
        self.sent = 0

    def feed(self, delta: str, finish_reason: str | None) -> str:
        """Add the engine's delta; return the text that can be sent now."""
        self.text += delta
        end = len(self.text)
        if finish_reason == "stop":
            hits = [found for s in self.stops if (found := self.text.find(s)) >= 0]
            end = min(hits, default=end)
        elif finish_reason is None:
            end -= self._held()
        out = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out

    def _held(self) -> int:
        """Length of the longest end of the text that begins some stop string."""
        for size in range(min(max((len(s) for s in self.stops), default=0), len(self.text)), 0, -1):
            tail = self.text[-size:]
            if any(s.startswith(tail) and len(s) > size for s in self.stops):
                return size
        return 0


def prompt_char_limit(tokenizer: Any, max_context: int | None) -> int | None:
    """The most characters a text can have and still fit in ``max_context`` tokens.

    A token stands for at most as many characters as its vocabulary string has (byte-level
    BPE: one per byte; SentencePiece: "▁" for a space; added tokens: their text). So a text
    of ``max_context * longest`` characters has at least ``max_context`` tokens and cannot
    fit, as long as the tokenizer keeps every character. One that normalizes text may shrink
    it first, hence ``NORMALIZED_TEXT_SLACK`` for those. None: no context limit, no bound.
    """
    if max_context is None:
        return None
    try:
        longest = max((len(str(token)) for token in tokenizer.get_vocab()), default=1)
    except Exception:  # a tokenizer without a vocabulary to read: bound by the body only
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    keeps_every_char = backend is not None and getattr(backend, "normalizer", None) is None
    slack = 1 if keeps_every_char else NORMALIZED_TEXT_SLACK
    return max_context * max(longest, 1) * slack - 1


@dataclass
class _Choice:
    """Per-prompt state of one request."""

    job: Job
    trimmer: StopTrimmer
    text: str = ""
    tokens: int = 0
    finish_reason: str | None = None
    done: bool = False


@dataclass
class _Prepared:
    """A request reduced to what the worker needs."""

    prompts: list[list[int]]
    stops: list[tuple[str, ...]]
    max_tokens: list[int]
    sampling: SamplingConfig
    seed: int | None
    group: Hashable
    stream: bool
    include_usage: bool


class _CountRequests:
    """ASGI middleware: ``requests_total{endpoint, status}`` for every HTTP response."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, record)
        finally:
            path = str(scope.get("path", ""))
            # Unknown paths share one label, so random URLs cannot grow the metric set.
            if path.startswith("/v1/models/"):
                path = "/v1/models/{model}"
            elif path not in ENDPOINTS:
                path = "other"
            self.metrics.inc("requests_total", endpoint=path, status=str(status))


# ------------------------------------------------------------------------------------ the app


class _Service:
    """Everything the routes share: the engine's facts, the worker, the metrics, the limits."""

    def __init__(
        self,
        engine: SpeculativeEngine,
        *,
        model_name: str,
        max_batch: int,
        max_queue: int,
        timeout_s: float,
        api_key: str | None,
        max_body_bytes: int,
        body_timeout_s: float,
        metrics: Metrics,
    ) -> None:
        if engine.tokenizer is None:
            raise ValueError(
                "the engine's target has no tokenizer; the server needs one to read text "
                "prompts (pass tokenizer= to TargetModel)"
            )
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
        if not body_timeout_s > 0:
            raise ValueError(f"body_timeout_s must be > 0 seconds, got {body_timeout_s!r}")
        self.engine = engine
        self.tokenizer: Any = engine.tokenizer
        self.model_name = model_name
        self.timeout_s = timeout_s
        self.api_key = api_key or None
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.metrics = metrics
        self.max_context: int | None = engine.target.max_context
        self.vocab_size: int = engine.target.vocab_size
        self.max_prompt_chars = prompt_char_limit(self.tokenizer, self.max_context)
        # One thread parses and tokenizes every request, so big bodies never stall the event
        # loop (HF tokenizers release the GIL while encoding) and no two requests encode at
        # once.
        self.preparer = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="flashspec-prepare"
        )
        self.created = int(time.time())
        self.worker = EngineWorker(
            engine, max_batch=max_batch, max_queue=max_queue, metrics=metrics
        )

    # -- request checks -------------------------------------------------------------------

    def authorize(self, request: Request) -> None:
        """Raise 401 unless the request carries the API key (when one is set)."""
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() == "bearer" and secrets.compare_digest(
            key.strip().encode(), self.api_key.encode()
        ):
            return
        raise ApiError(
            401,
            "missing or wrong API key: send the header 'Authorization: Bearer <key>' with the "
            f"key the server was started with (--api-key or {API_KEY_ENV})",
            type="authentication_error",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )

    async def read_body(self, request: Request) -> bytes:
        """The request body, refusing more than ``max_body_bytes`` (413) or a body that takes
        longer than ``body_timeout_s`` to arrive (408).

        Raises:
            ApiError: 413, or 408 with ``Connection: close`` (nothing more will be read). After
                a 413 the connection reads and drops the rest of the body, for as long as the
                next request's header deadline allows, so that the client sees the answer.
            ClientDisconnect: the client left before sending the whole body.
        """
        limit = self.max_body_bytes
        too_large = ApiError(
            413,
            f"the request body is larger than this server accepts ({limit} bytes)",
            code="request_too_large",
        )
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s
        size = 0
        chunks: list[bytes] = []
        while True:
            try:
                # The raw ASGI receive: Request.stream() has no deadline.
                message = await asyncio.wait_for(request.receive(), deadline - loop.time())
            except TimeoutError:
                raise ApiError(
                    408,
                    f"the request body did not arrive within {self.body_timeout_s:g} s of its "
                    f"headers ({size} bytes came); send the whole body at once",
                    type="timeout_error",
                    code="body_timeout",
                    headers={"Connection": "close"},
                ) from None
            if message["type"] == "http.disconnect":
                raise ClientDisconnect
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def prepare(self, raw: bytes, kind: type[CompletionRequest | ChatRequest]) -> _Prepared:
        """Parse, check and tokenize a request body on the preparing thread."""
        loop = asyncio.get_running_loop()
        if kind is ChatRequest:
            return await loop.run_in_executor(self.preparer, self._prepare_chat_body, raw)
        return await loop.run_in_executor(self.preparer, self._prepare_completion_body, raw)

    def _prepare_completion_body(self, raw: bytes) -> _Prepared:
        return self.prepare_completion(parse_body(raw, CompletionRequest))

    def _prepare_chat_body(self, raw: bytes) -> _Prepared:
        return self.prepare_chat(parse_body(raw, ChatRequest))

    def check_model(self, model: str | None) -> None:
        """404 for a model this server does not serve (absent: the served one)."""
        if model is not None and model != self.model_name:
            raise ApiError(
                404,
                f"model {model!r} is not served here; this server serves {self.model_name!r} "
                "(GET /v1/models)",
                param="model",
                code="model_not_found",
            )

    def encode(self, text: str, *, special: bool) -> list[int]:
        """Token ids of ``text`` (as the engine encodes prompts when ``special``)."""
        return [int(t) for t in self.tokenizer(text, add_special_tokens=special)["input_ids"]]

    def check_chars(self, length: int, param: str) -> None:
        """400 for text too long to fit in the context, refused before tokenizing it."""
        limit = self.max_prompt_chars
        if limit is None or length <= limit:
            return
        subject = "prompt" if param == "prompt" else "conversation (messages' content)"
        raise invalid(
            f"the {subject} has {length} characters; no text of more than {limit} characters "
            f"fits in this model's context of {self.max_context} tokens, so it is refused "
            f"before tokenizing; shorten the {param}",
            param=param,
            code="context_length_exceeded",
        )

    def check_ids(self, ids: list[int], param: str) -> None:
        """400 for token ids outside the target's vocabulary."""
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise invalid(
                f"{param} has token id {bad[0]} outside the vocabulary [0, {self.vocab_size})",
                param=param,
            )

    def max_tokens_for(
        self, prompt_length: int, requested: int | None, default: int | None, param: str
    ) -> int:
        """``max_tokens`` checked against the context (``default`` None: the rest of it)."""
        limit = self.max_context
        # An empty prompt starts from BOS, which takes a position.
        length = max(prompt_length, 1)
        if limit is not None and length >= limit:
            subject = "prompt" if param == "prompt" else "conversation (messages, chat-formatted)"
            raise invalid(
                f"the {subject} has {length} tokens but the model's context is {limit} "
                f"tokens, leaving no room for a completion; shorten the {param}",
                param=param,
                code="context_length_exceeded",
            )
        room = limit - length if limit is not None else None
        if requested is None:
            fallback = default if default is not None else (room or UNBOUNDED_DEFAULT_MAX_TOKENS)
            return min(fallback, room) if room is not None else fallback
        if room is not None and requested > room:
            raise invalid(
                f"this model's context is {limit} tokens, but {length + requested} were "
                f"requested ({length} in the prompt, {requested} for the completion); "
                f"lower max_tokens to at most {room} or shorten the prompt",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return requested

    def sampling_for(
        self, request: CompletionRequest | ChatRequest
    ) -> tuple[SamplingConfig, int | None, Hashable]:
        """(SamplingConfig for this call, seed, batch group) from the request's fields.

        OpenAI's defaults apply: temperature 1, top_p 1. Greedy requests (temperature 0) share
        one group whatever their top_p/top_k, which cannot change an argmax. A sampled request
        with a seed gets a batch of its own, so the same seed gives the same output.
        """
        base = self.engine.config.sampling
        temperature = 1.0 if request.temperature is None else float(request.temperature)
        top_p = 1.0 if request.top_p is None else float(request.top_p)
        top_k = 0 if request.top_k is None else request.top_k
        if temperature == 0:
            sampling = dataclasses.replace(
                base, temperature=0.0, top_p=1.0, top_k=0, method="auto", seed=None
            )
            return sampling, None, ("greedy",)
        # A server built on a lossy "typical" engine stays lossy; otherwise sampling is exact.
        method: Method = "typical" if base.method == "typical" else "auto"
        sampling = dataclasses.replace(
            base, temperature=temperature, top_p=top_p, top_k=top_k, method=method, seed=None
        )
        group: tuple[object, ...] = ("sample", temperature, top_p, top_k)
        if request.seed is not None:
            group = (*group, "seed", request.seed, uuid.uuid4().hex)
        return sampling, request.seed, group

    # -- preparing requests ----------------------------------------------------------------

    def prepare_completion(self, request: CompletionRequest) -> _Prepared:
        """Prompts, limits and sampling of a /v1/completions request."""
        self.check_model(request.model)
        stops = stop_strings(request.stop)
        items = prompt_items(request.prompt)
        if len(items) > self.worker.max_queue:
            raise invalid(
                f"prompt holds {len(items)} prompts but this server queues at most "
                f"{self.worker.max_queue}; send fewer per request",
                param="prompt",
            )
        # Every check that needs no tokenizer first: a request refused anyway costs no
        # tokenizing.
        for item in items:
            if isinstance(item, str):
                self.check_chars(len(item), "prompt")
            else:
                self.check_ids(item, "prompt")
        prompts = [
            self.encode(item, special=True) if isinstance(item, str) else item for item in items
        ]
        max_tokens = [
            self.max_tokens_for(
                len(ids), request.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, "prompt"
            )
            for ids in prompts
        ]
        sampling, seed, group = self.sampling_for(request)
        return _Prepared(
            prompts=prompts,
            stops=[stops] * len(prompts),
            max_tokens=max_tokens,
            sampling=sampling,
            seed=seed,
            group=group,
            stream=bool(request.stream),
            include_usage=bool(request.stream_options and request.stream_options.include_usage),
        )

    def prepare_chat(self, request: ChatRequest) -> _Prepared:
        """The chat prompt (chat template or the fallback format), limits and sampling."""
        self.check_model(request.model)
        stops = stop_strings(request.stop)
        conversation: list[dict[str, str]] = []
        for i, m in enumerate(request.messages):
            turn = {"role": m.role, "content": message_text(m, i)}
            if m.tool_call_id is not None:
                turn["tool_call_id"] = m.tool_call_id
            conversation.append(turn)
        self.check_chars(sum(len(turn["content"]) for turn in conversation), "messages")
        if getattr(self.tokenizer, "chat_template", None):
            try:
                text = self.tokenizer.apply_chat_template(
                    conversation, tokenize=False, add_generation_prompt=True
                )
            except Exception as exc:
                raise invalid(
                    f"messages: the model's chat template refused them: {exc}", param="messages"
                ) from None
            # The template writes any special tokens (BOS...) itself.
            ids = self.encode(str(text), special=False)
        else:
            lines = [f"{m['role']}: {m['content']}" for m in conversation]
            ids = self.encode("\n".join([*lines, "assistant:"]), special=True)
            stops = tuple(dict.fromkeys((*stops, FALLBACK_CHAT_STOP)))
        requested = request.max_completion_tokens or request.max_tokens
        if requested != (request.max_tokens or requested):
            raise invalid(
                "max_tokens and max_completion_tokens differ; send only max_completion_tokens",
                param="max_tokens",
            )
        max_tokens = self.max_tokens_for(len(ids), requested, None, "messages")
        sampling, seed, group = self.sampling_for(request)
        return _Prepared(
            prompts=[ids],
            stops=[stops],
            max_tokens=[max_tokens],
            sampling=sampling,
            seed=seed,
            group=group,
            stream=bool(request.stream),
            include_usage=bool(request.stream_options and request.stream_options.include_usage),
        )

    # -- running requests ------------------------------------------------------------------

    def submit(self, prepared: _Prepared) -> tuple[list[_Choice], asyncio.Queue[tuple[int, Event]]]:
        """Queue the request's jobs; their events arrive on the returned asyncio queue.

        Raises:
            ApiError: 503 with Retry-After when the queue is full.
        """
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()

        def deliverer(index: int) -> Callable[[Event], None]:
            def deliver(event: Event) -> None:
                # From the worker thread: hand over to the loop that owns the queue.
                with contextlib.suppress(RuntimeError):  # the loop closed: server shutdown
                    loop.call_soon_threadsafe(events.put_nowait, (index, event))

            return deliver

        choices = [
            _Choice(
                job=Job(
                    prompt_ids=ids,
                    max_tokens=max_tokens,
                    stop=stops,
                    sampling=prepared.sampling,
                    seed=prepared.seed,
                    group=prepared.group,
                    deliver=deliverer(i),
                ),
                trimmer=StopTrimmer(stops),
            )
            for i, (ids, stops, max_tokens) in enumerate(
                zip(prepared.prompts, prepared.stops, prepared.max_tokens, strict=True)
            )
        ]
        try:
            self.worker.submit([choice.job for choice in choices])
        except QueueFull:
            retry = self.worker.retry_after_s()
            raise ApiError(
                503,
                f"the server is busy: {self.worker.max_queue} generations are already waiting; "
                f"retry in about {retry} s",
                type="server_overloaded",
                code="queue_full",
                headers={"Retry-After": str(retry)},
            ) from None
        self.metrics.inc("prompt_tokens_total", sum(len(ids) for ids in prepared.prompts))
        return choices, events

    def cancel(self, choices: Sequence[_Choice], reason: str) -> None:
        """Cancel the jobs of the choices that have not finished."""
        for choice in choices:
            if not choice.done:
                self.worker.cancel(choice.job, reason)

    @staticmethod
    def apply(choice: _Choice, event: Event) -> str:
        """Fold an event into its choice; return the text to send (stop strings trimmed)."""
        if event.error is not None:
            choice.done = True
            raise ApiError(500, event.error, type="server_error", code="generation_failed")
        if event.finish_reason == "cancelled":
            # Not by this request (it would have stopped listening): the server is stopping.
            choice.done = True
            raise ApiError(
                503, "the server is shutting down", type="server_error", code="shutting_down"
            )
        text = choice.trimmer.feed(event.text, event.finish_reason)
        choice.text += text
        choice.tokens += event.tokens
        if event.finish_reason is not None:
            choice.done = True
            choice.finish_reason = FINISH_REASONS.get(event.finish_reason, "stop")
        return text

    def usage(self, prepared: _Prepared, choices: Sequence[_Choice]) -> dict[str, int]:
        """OpenAI's usage object."""
        prompt = sum(len(ids) for ids in prepared.prompts)
        completion = sum(choice.tokens for choice in choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def timeout_error(self) -> ApiError:
        """504 for a request that ran past ``timeout_s``."""
        return ApiError(
            504,
            f"the generation did not finish within the server's timeout of {self.timeout_s:g} s "
            "(queueing included); lower max_tokens or retry later",
            type="timeout_error",
            code="timeout",
        )

    async def complete(
        self,
        request: Request,
        prepared: _Prepared,
        endpoint: str,
        arrived: float,
        render: Callable[[list[_Choice], dict[str, int]], dict[str, Any]],
    ) -> Response:
        """Run a non-streaming request to its end (or timeout, or the client's departure)."""
        choices, events = self.submit(prepared)
        deadline = arrived + self.timeout_s
        reason = "disconnect"
        first = True
        next_poll = time.perf_counter() + DISCONNECT_POLL_S
        try:
            while not all(choice.done for choice in choices):
                now = time.perf_counter()
                if now >= deadline:
                    reason = "timeout"
                    raise self.timeout_error()
                if now >= next_poll:
                    # Events may arrive every round, so poll on a clock, not on idle time.
                    next_poll = now + DISCONNECT_POLL_S
                    if await request.is_disconnected():
                        # Nobody will read the answer; 499 is what the metrics record.
                        return Response(status_code=499)
                try:
                    index, event = await asyncio.wait_for(
                        events.get(), timeout=min(deadline, next_poll) - now
                    )
                except TimeoutError:
                    continue
                if first and event.text:
                    first = False
                    self.metrics.observe(
                        "time_to_first_token_seconds", time.perf_counter() - arrived
                    )
                try:
                    self.apply(choices[index], event)
                except ApiError:
                    reason = "error"
                    raise
        finally:
            self.cancel(choices, reason)
        self.metrics.observe(
            "request_latency_seconds", time.perf_counter() - arrived, endpoint=endpoint
        )
        return JSONResponse(render(choices, self.usage(prepared, choices)))

    def stream(
        self,
        prepared: _Prepared,
        endpoint: str,
        arrived: float,
        render: Callable[[list[_Choice], int, str, str | None], dict[str, Any]],
        opening: Callable[[int], dict[str, Any]] | None,
        usage_chunk: Callable[[dict[str, int]], dict[str, Any]],
    ) -> Response:
        """Queue a streaming request and answer with its server-sent events."""
        choices, events = self.submit(prepared)
        deadline = arrived + self.timeout_s

        async def sse() -> AsyncIterator[str]:
            reason = "disconnect"
            first = True
            try:
                if opening is not None:
                    for index in range(len(choices)):
                        yield _sse(opening(index))
                while not all(choice.done for choice in choices):
                    left = deadline - time.perf_counter()
                    if left <= 0:
                        reason = "timeout"
                        yield _sse(self.timeout_error().body())
                        return
                    try:
                        index, event = await asyncio.wait_for(events.get(), timeout=left)
                    except TimeoutError:
                        continue
                    choice = choices[index]
                    try:
                        text = self.apply(choice, event)
                    except ApiError as exc:
                        reason = "error"
                        yield _sse(exc.body())
                        return
                    if first and text:
                        first = False
                        self.metrics.observe(
                            "time_to_first_token_seconds", time.perf_counter() - arrived
                        )
                    if text or choice.done:
                        yield _sse(render(choices, index, text, choice.finish_reason))
                if prepared.include_usage:
                    yield _sse(usage_chunk(self.usage(prepared, choices)))
                yield "data: [DONE]\n\n"
                self.metrics.observe(
                    "request_latency_seconds", time.perf_counter() - arrived, endpoint=endpoint
                )
            finally:
                # Runs when the client disconnects too: Starlette cancels this generator.
                self.cancel(choices, reason)

        return _EventStream(sse(), lambda: self.cancel(choices, "disconnect"))


class _EventStream(StreamingResponse):
    """Server-sent events that run ``on_close`` however the response ends.

    The generator's own ``finally`` cancels its jobs, but only once it has started: a client
    that leaves before the first event would leave them queued with nobody to read them.
    """

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def create_app(
    engine: SpeculativeEngine,
    *,
    model_name: str = "flashspec",
    max_batch: int = 8,
    max_queue: int = 64,
    timeout_s: float = 60.0,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    metrics: Metrics | None = None,
) -> FastAPI:
    """The FastAPI app serving ``engine`` under OpenAI's API.

    Args:
        engine: the engine; from now on only the app's worker thread may use it.
        model_name: the model id clients send as ``model`` and ``GET /v1/models`` lists.
        max_batch: rows per engine batch at most (1: no batching).
        max_queue: generations waiting for the engine at most; more are answered 503.
        timeout_s: per-request limit, arrival to last token, queueing included (504 after).
        api_key: when set, every endpoint but ``/health`` needs ``Authorization: Bearer KEY``.
        max_body_bytes: larger request bodies are answered 413.
        body_timeout_s: a body that has not fully arrived this long after its headers is
            answered 408 (the headers' own limit is uvicorn's side: see ``serve``).
        metrics: where to count (default: a fresh ``server_metrics()``).

    The worker thread starts and stops with the app's lifespan (uvicorn runs it).
    """
    service = _Service(
        engine,
        model_name=model_name,
        max_batch=max_batch,
        max_queue=max_queue,
        timeout_s=timeout_s,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        body_timeout_s=body_timeout_s,
        metrics=metrics or server_metrics(),
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.worker.start()
        try:
            yield
        finally:
            service.preparer.shutdown(wait=False, cancel_futures=True)
            await asyncio.to_thread(service.worker.stop)

    app = FastAPI(
        title="flashspec",
        summary="OpenAI-compatible speculative decoding server",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.service = service
    app.add_middleware(_CountRequests, metrics=service.metrics)
    _add_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        # Open even with an API key, so load balancers can probe without one.
        if not service.worker.alive:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok", "model": service.model_name})

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        service.authorize(request)
        return PlainTextResponse(
            service.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    def model_card() -> dict[str, Any]:
        return {
            "id": service.model_name,
            "object": "model",
            "created": service.created,
            "owned_by": "flashspec",
        }

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        service.authorize(request)
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str) -> Response:
        service.authorize(request)
        service.check_model(model)
        return JSONResponse(model_card())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrived = time.perf_counter()
        service.authorize(request)
        prepared = await service.prepare(await service.read_body(request), CompletionRequest)
        ident = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())

        def envelope(choices: list[dict[str, Any]]) -> dict[str, Any]:
            return {
                "id": ident,
                "object": "text_completion",
                "created": created,
                "model": service.model_name,
                "choices": choices,
            }

        if not prepared.stream:

            def full(choices: list[_Choice], usage: dict[str, int]) -> dict[str, Any]:
                rows = [
                    {"index": i, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
                    for i, c in enumerate(choices)
                ]
                return {**envelope(rows), "usage": usage}

            return await service.complete(request, prepared, "/v1/completions", arrived, full)

        usage_field = {"usage": None} if prepared.include_usage else {}

        def chunk(
            choices: list[_Choice], index: int, text: str, finish: str | None
        ) -> dict[str, Any]:
            row = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
            return {**envelope([row]), **usage_field}

        def usage_chunk(usage: dict[str, int]) -> dict[str, Any]:
            return {**envelope([]), "usage": usage}

        return service.stream(prepared, "/v1/completions", arrived, chunk, None, usage_chunk)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrived = time.perf_counter()
        service.authorize(request)
        prepared = await service.prepare(await service.read_body(request), ChatRequest)
        ident = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())

        def envelope(kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
            return {
                "id": ident,
                "object": kind,
                "created": created,
                "model": service.model_name,
                "choices": choices,
            }

        if not prepared.stream:

            def full(choices: list[_Choice], usage: dict[str, int]) -> dict[str, Any]:
                rows = [
                    {
                        "index": i,
                        "message": {"role": "assistant", "content": c.text},
                        "logprobs": None,
                        "finish_reason": c.finish_reason,
                    }
                    for i, c in enumerate(choices)
                ]
                return {**envelope("chat.completion", rows), "usage": usage}

            return await service.complete(request, prepared, "/v1/chat/completions", arrived, full)

        usage_field = {"usage": None} if prepared.include_usage else {}

        def delta_chunk(index: int, delta: dict[str, str], finish: str | None) -> dict[str, Any]:
            row = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {**envelope("chat.completion.chunk", [row]), **usage_field}

        def chunk(
            choices: list[_Choice], index: int, text: str, finish: str | None
        ) -> dict[str, Any]:
            return delta_chunk(index, {"content": text} if text else {}, finish)

        def opening(index: int) -> dict[str, Any]:
            return delta_chunk(index, {"role": "assistant", "content": ""}, None)

        def usage_chunk(usage: dict[str, int]) -> dict[str, Any]:
            return {**envelope("chat.completion.chunk", []), "usage": usage}

        return service.stream(
            prepared, "/v1/chat/completions", arrived, chunk, opening, usage_chunk
        )

    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape; FastAPI's 422 becomes a 400."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(ClientDisconnect)
    async def client_left(request: Request, exc: ClientDisconnect) -> Response:
        # The client left mid-body: nobody reads this; 499 (not a 5xx) is what /metrics counts.
        return Response(status_code=499)

    @app.exception_handler(RequestValidationError)
    async def validation(request: Request, exc: RequestValidationError) -> Response:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) if loc else None
        message = str(first.get("msg", "invalid request"))
        error = invalid(f"{param}: {message}" if param is not None else message, param=param)
        return JSONResponse(error.body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            message = (
                f"no endpoint {request.method} {request.url.path}; this server has POST "
                "/v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, "
                "GET /metrics"
            )
            code = "not_found"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
            code = "method_not_allowed"
        else:
            message, code = str(exc.detail), None
        error = ApiError(exc.status_code, message, code=code, headers=exc.headers)
        return JSONResponse(error.body(), status_code=exc.status_code, headers=error.headers)

    @app.exception_handler(Exception)
    async def crash(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        error = ApiError(500, f"internal server error: {type(exc).__name__}", type="server_error")
        return JSONResponse(error.body(), status_code=500)


# ------------------------------------------------------------------------------------ running


def resolve_api_key(api_key: str | None) -> str | None:
    """``api_key``, else ``$FLASHSPEC_API_KEY``, else None (no authentication)."""
    return api_key or os.environ.get(API_KEY_ENV) or None


LISTEN_BACKLOG = 2048  # uvicorn's default


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (``port`` 0: a free one), for uvicorn to listen on.

    Binding here rather than in uvicorn turns "address in use" into an ``OSError`` the caller
    can report, and lets ``port=0`` be read back before the server starts.

    Raises:
        OSError: the address cannot be bound (in use, not local, no permission).
    """
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        # Listening now (uvicorn's own listen() later only resizes the backlog) means a client
        # that connects as soon as the address is printed waits in the backlog while the app
        # starts, instead of being refused.
        sock.listen(LISTEN_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def serve(
    engine: SpeculativeEngine,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    sock: socket.socket | None = None,
    model_name: str = "flashspec",
    max_batch: int = 8,
    max_queue: int = 64,
    timeout_s: float = 60.0,
    api_key: str | None = None,
    log_level: str = "info",
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
) -> None:
    """Serve ``engine`` until interrupted (see ``create_app`` for the settings).

    Listens on ``sock`` if given (see ``bind``), else on ``host:port``. ``api_key`` None
    falls back to ``$FLASHSPEC_API_KEY``. A connection's request headers must arrive within
    ``header_timeout_s`` (408 otherwise; see ``uvicorn_config``).
    """
    app = create_app(
        engine,
        model_name=model_name,
        max_batch=max_batch,
        max_queue=max_queue,
        timeout_s=timeout_s,
        api_key=resolve_api_key(api_key),
    )
    listener = sock if sock is not None else bind(host, port)
    server = uvicorn.Server(
        uvicorn_config(app, log_level=log_level, header_timeout_s=header_timeout_s)
    )
    try:
        server.run(sockets=[listener])
    finally:
        listener.close()


KEEP_ALIVE_TIMEOUT_S = 5  # uvicorn's default: an idle keep-alive connection closes after it


def uvicorn_config(
    app: ASGIApp,
    *,
    log_level: str = "info",
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
) -> uvicorn.Config:
    """uvicorn's settings for the app: h11 with a header deadline, no WebSocket upgrades.

    The HTTP protocol is always ``flashspec._serve_http``'s (h11), even where httptools is
    installed, so the limits hold whatever uvicorn would pick.
    """
    return uvicorn.Config(
        app,
        log_level=log_level,
        lifespan="on",
        http=guarded_protocol(header_timeout_s, max_header_bytes),
        ws="none",
        timeout_keep_alive=KEEP_ALIVE_TIMEOUT_S,
    )


class ServerThread:
    """Run an app with uvicorn in a background thread, on a port bound up front.

    ``port=0`` picks a free port (no race: the socket is bound here and handed to uvicorn).
    Use as a context manager, or ``start()``/``stop()``.
    """

    def __init__(
        self,
        app: ASGIApp,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
    ) -> None:
        self._socket = bind(host, port)
        self.host = host
        self.port: int = self._socket.getsockname()[1]
        config = uvicorn_config(app, log_level="warning", header_timeout_s=header_timeout_s)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [self._socket]},
            name="flashspec-uvicorn",
            daemon=True,
        )

    @property
    def url(self) -> str:
        """``http://host:port``."""
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> ServerThread:
        """Start serving; return once the server accepts connections.

        Raises:
            RuntimeError: the server did not start within ``timeout`` seconds.
        """
        self._thread.start()
        end = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > end:
                raise RuntimeError(f"the server on {self.url} did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Ask uvicorn to exit (the lifespan stops the worker) and wait for the thread."""
        self._server.should_exit = True
        self._thread.join(timeout)
        self._socket.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
