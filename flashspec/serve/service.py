"""What every route shares: the engine's facts, the worker, the metrics and the limits.

Also the checks both generation endpoints apply: API key, body, model, lengths, sampling.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import os
import secrets
import time
import uuid
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, TypeVar

from starlette.requests import ClientDisconnect, Request

from ..grammar import Grammar, GrammarError
from ..grammar.masks import GrammarState
from .metrics import Metrics
from .protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    grammar_of,
    invalid,
    logit_bias_of,
)
from .worker import Batching, EngineWorker, seeded_rows_mix

if TYPE_CHECKING:
    from ..config import Method, SamplingConfig
    from ..engine import SpeculativeEngine

API_KEY_ENV = "FLASHSPEC_API_KEY"
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
# From the end of the headers to the end of the body: 4 MiB at 140 kB/s.
DEFAULT_BODY_TIMEOUT_S = 30.0
# Tokenizers that normalize text (NFKC, lower-casing, whitespace rules) may shrink it; the
# character limit for their prompts allows for that.
NORMALIZED_TEXT_SLACK = 4
# The chat default when the target declares no context limit.
UNBOUNDED_DEFAULT_MAX_TOKENS = 4096
# Bodies up to this size are parsed and tokenized on a thread of their own: however many large
# bodies wait for the other thread (each may take a second), a small request never queues
# behind them.
SMALL_BODY_BYTES = 64 * 1024

T = TypeVar("T")


def resolve_api_key(api_key: str | None) -> str | None:
    """``api_key``, else ``$FLASHSPEC_API_KEY``, else None (no authentication)."""
    return api_key or os.environ.get(API_KEY_ENV) or None


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


def authorize(request: Request, api_key: str | None) -> None:
    """Raise 401 unless ``request`` carries ``api_key`` as a bearer token (None: no key)."""
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() == "bearer" and secrets.compare_digest(
        key.strip().encode(), api_key.encode()
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


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The request body, refusing more than ``limit`` bytes (413) or a body that takes longer
    than ``timeout_s`` to arrive (408).

    Raises:
        ApiError: 413, or 408 with ``Connection: close`` (nothing more will be read). After
            a 413 the connection reads and drops the rest of the body, for as long as the
            next request's header deadline allows, so that the client sees the answer.
        ClientDisconnect: the client left before sending the whole body.
    """
    too_large = ApiError(
        413,
        f"the request body is larger than this server accepts ({limit} bytes)",
        code="request_too_large",
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    size = 0
    chunks: list[bytes] = []
    while True:
        try:
            # The raw ASGI receive: Request.stream() has no deadline.
            message = await asyncio.wait_for(request.receive(), deadline - loop.time())
        except TimeoutError:
            raise ApiError(
                408,
                f"the request body did not arrive within {timeout_s:g} s of its "
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


class Service:
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
        batching: Batching = "continuous",
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
        self.bos: int | None = _bos_id(engine)
        # Threads, not the event loop, parse and tokenize requests, so big bodies never stall
        # it (HF tokenizers release the GIL while encoding): one for small bodies, one for the
        # rest (SMALL_BODY_BYTES), so at most two requests encode at once.
        self.preparer = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="flashspec-prepare"
        )
        self.bulk_preparer = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="flashspec-prepare-bulk"
        )
        self.created = int(time.time())
        self.worker = EngineWorker(
            engine, max_batch=max_batch, max_queue=max_queue, metrics=metrics, batching=batching
        )
        self.shutting_down = False

    # -- the HTTP request ------------------------------------------------------------------

    def authorize(self, request: Request) -> None:
        """Raise 401 unless the request carries the API key (when one is set)."""
        authorize(request, self.api_key)

    async def read_body(self, request: Request) -> bytes:
        """The request body within this server's limits (see ``read_body``)."""
        return await read_body(request, self.max_body_bytes, self.body_timeout_s)

    async def prepare(self, work: Callable[[Service, bytes], T], raw: bytes, arrived: float) -> T:
        """``work(self, raw)`` on a preparing thread, within the request's ``timeout_s``.

        Raises:
            ApiError: 504 when the request's time ran out first (queued behind other bodies);
                a request still waiting for the thread is dropped from its queue.
        """
        executor = self.preparer if len(raw) <= SMALL_BODY_BYTES else self.bulk_preparer
        left = arrived + self.timeout_s - time.perf_counter()
        future = asyncio.get_running_loop().run_in_executor(executor, work, self, raw)
        try:
            return await asyncio.wait_for(future, max(left, 0.0))
        except TimeoutError:
            raise ApiError(
                504,
                f"the request's time ran out (the server's timeout of {self.timeout_s:g} s, "
                "from the end of its headers) before its body was parsed and tokenized, "
                "behind other requests' bodies; retry later or send a smaller body",
                type="timeout_error",
                code="timeout",
            ) from None

    def shut_down_preparers(self) -> None:
        """Stop the preparing threads; requests still waiting for one are dropped."""
        for executor in (self.preparer, self.bulk_preparer):
            executor.shutdown(wait=False, cancel_futures=True)

    # -- shutting down ---------------------------------------------------------------------

    def begin_shutdown(self, grace_s: float) -> None:
        """Stop admitting generations and end the queued ones now (503 ``shutting_down``); end
        the running ones ``grace_s`` seconds from now, unless they finish first.

        Runs on the event loop (the server calls it as its shutdown starts); once is enough.
        """
        if self.shutting_down:
            return
        self.shutting_down = True
        self.worker.drain()
        asyncio.get_running_loop().call_later(max(grace_s, 0.0), self.worker.end)

    def check_admitting(self) -> None:
        """503 ``shutting_down`` once the server's shutdown has begun."""
        if self.shutting_down:
            raise shutting_down()

    # -- the request's fields --------------------------------------------------------------

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

    def check_chars(self, length: int, param: str, subject: str | None = None) -> None:
        """400 for text too long to fit in the context, refused before tokenizing it.

        ``subject`` names the text in the message (default: the prompt, or the messages'
        content).
        """
        limit = self.max_prompt_chars
        if limit is None or length <= limit:
            return
        if subject is None:
            subject = "prompt" if param == "prompt" else "conversation (messages' content)"
        raise invalid(
            f"the {subject} has {length} characters; no text of more than {limit} characters "
            f"fits in this model's context of {self.max_context} tokens, so it is refused "
            f"before tokenizing; shorten the {param}",
            param=param,
            code="context_length_exceeded",
        )

    def start_token(self, ids: list[int], param: str, name: str | None = None) -> list[int]:
        """``ids``, or for an empty prompt the BOS token the engine starts it from, so that
        ``prompt_tokens`` counts the token that runs. ``name``: the prompt in the message
        (default ``param``).

        Raises:
            ApiError: 400 for an empty prompt of a model that defines no BOS token.
        """
        if ids:
            return ids
        if self.bos is None:
            raise invalid(
                f"{name or param} is empty and this model defines no BOS token to start from; "
                "send at least one token",
                param=param,
            )
        return [self.bos]

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

    def grammar_for(self, request: CompletionRequest | ChatRequest) -> Grammar | None:
        """The request's output structure, compiled once here so that a grammar the engine
        could not run is a 400 before the request queues.

        Raises:
            ApiError: 400 naming the field (malformed, too large or deep, does not compile,
                or llguidance is not installed).
        """
        grammar = grammar_of(request)
        if grammar is None:
            return None
        param = next(
            name for name in ("response_format", "regex", "grammar") if getattr(request, name)
        )
        try:
            GrammarState(
                grammar,
                self.tokenizer,
                list(self.engine.target.eos_token_ids),
                self.engine.target.vocab_size,
            )
        except (GrammarError, ImportError) as exc:
            raise invalid(f"{param}: {exc}", param=param) from None
        return grammar

    def sampling_for(
        self, request: CompletionRequest | ChatRequest
    ) -> tuple[SamplingConfig, int | None, Hashable]:
        """(SamplingConfig for this call, seed, batch group) from the request's fields.

        OpenAI's defaults apply: temperature 1, top_p 1. Requests that differ only in
        penalties, logit_bias, temperature, top_p, top_k and seed share a group: each row of a
        stream has its logits changed and samples by its own settings, and a seeded row draws
        from a generator of its own (``flashspec.engine.row_sampling``), its output the same
        beside any rows. Only on an engine whose rows move in lockstep (``seeded_rows_mix``
        false) does a seeded request still get a group of its own, as its rows' output would
        depend on their neighbours.
        """
        base = dataclasses.replace(
            self.engine.config.sampling,
            repetition_penalty=float(request.repetition_penalty or 1.0),
            presence_penalty=float(request.presence_penalty or 0.0),
            frequency_penalty=float(request.frequency_penalty or 0.0),
            logit_bias=logit_bias_of(request, self.vocab_size),
        )
        # Requests of any penalties, bias, temperature, top_p, top_k and seed share a stream:
        # each row's logits are changed and warped by its own (flashspec.engine.penalties,
        # flashspec.engine.row_sampling).
        group: tuple[object, ...] = ()
        temperature = 1.0 if request.temperature is None else float(request.temperature)
        top_p = 1.0 if request.top_p is None else float(request.top_p)
        # Keeping the k most likely of fewer than k tokens keeps them all, as 0 does (the
        # engine's warper skips such a k).
        top_k = request.top_k or 0
        if top_k >= self.vocab_size:
            top_k = 0
        if temperature == 0:
            sampling = dataclasses.replace(
                base, temperature=0.0, top_p=1.0, top_k=0, method="auto", seed=None
            )
            return sampling, None, group
        # A server built on a lossy "typical" engine stays lossy (all its sampled requests, so
        # they can share a stream); otherwise sampling is exact.
        method: Method = "typical" if base.method == "typical" else "auto"
        sampling = dataclasses.replace(
            base, temperature=temperature, top_p=top_p, top_k=top_k, method=method, seed=None
        )
        if request.seed is not None and not seeded_rows_mix(self.engine):
            group = (*group, "seed", request.seed, uuid.uuid4().hex)
        return sampling, request.seed, group


def shutting_down() -> ApiError:
    """503 for a request the server will not run because it is shutting down."""
    return ApiError(
        503,
        "the server is shutting down; send the request again (to another server, or once "
        "this one is back)",
        type="server_error",
        code="shutting_down",
    )


def _bos_id(engine: SpeculativeEngine) -> int | None:
    """The token an empty prompt starts from (the engine's own choice), None without one."""
    from ..engine.inputs import bos_id

    return bos_id(engine.target)
