"""``flashspec generate``: its arguments and its command (stream a continuation, then stats)."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..flags import argtypes
from ..flags.options import EngineOptions, UserError, first_line, quiet_libraries


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``generate`` to ``subparsers`` (the parent's ``add_subparsers()`` object)."""
    gen: argparse.ArgumentParser = subparsers.add_parser(
        "generate",
        help="generate text with speculative decoding",
        description=(
            "Generate a continuation of PROMPT with speculative decoding, streaming the text, "
            "then print one stats line. Without --target, uses the bundled demo pair "
            "(a small Llama trained on the Python standard library, and its distilled draft)."
        ),
    )
    gen.add_argument("prompt", nargs="?", help="the prompt (or use --batch-file)")
    EngineOptions.add_arguments(gen)
    gen.add_argument("--max-new-tokens", type=argtypes.positive_int, default=128)
    gen.add_argument(
        "--batch-file",
        type=Path,
        default=None,
        help="generate for every non-empty line of this file as one batch "
        "(\\n and \\t in a line stand for newline and tab)",
    )
    gen.add_argument(
        "--chat",
        default=None,
        metavar="MESSAGE",
        help="answer MESSAGE as a chat: the target's chat template makes the prompt and the "
        "reply ends at its end of turn (instead of PROMPT)",
    )
    gen.add_argument(
        "--system", default=None, metavar="TEXT", help="with --chat: a system message first"
    )
    gen.add_argument(
        "--json-schema",
        type=Path,
        default=None,
        metavar="FILE",
        help="the output must be JSON valid under the schema in FILE (needs llguidance: "
        "pip install 'flashspec[grammar]')",
    )
    gen.add_argument(
        "--regex",
        default=None,
        metavar="PATTERN",
        help="the output must match PATTERN whole (needs llguidance)",
    )
    gen.add_argument(
        "--compare",
        action="store_true",
        help="also run plain target decoding; print the speedup and whether outputs match",
    )
    gen.set_defaults(func=cmd_generate)
    return gen


# ------------------------------------------------------------------------------------ loading


def build_engine(args: argparse.Namespace) -> Any:
    """The engine the flags in ``args`` describe (``EngineOptions``).

    Raises:
        UserError: see ``EngineOptions.build``.
    """
    return EngineOptions.from_args(args).build()


# ------------------------------------------------------------------------------------ commands


def _read_prompts(args: argparse.Namespace) -> list[str]:
    if args.chat is not None:
        if args.prompt is not None or args.batch_file is not None:
            raise UserError("--chat is the prompt; drop PROMPT or --batch-file")
        return [str(args.chat)]
    if args.system is not None:
        raise UserError("--system goes with --chat; add --chat MESSAGE")
    if args.batch_file is not None:
        if args.prompt is not None:
            raise UserError("give either a PROMPT or --batch-file, not both")
        try:
            lines = args.batch_file.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise UserError(f"--batch-file {args.batch_file}: {exc.strerror or exc}") from None
        prompts = [line.replace("\\n", "\n").replace("\\t", "\t") for line in lines if line.strip()]
        if not prompts:
            raise UserError(f"--batch-file {args.batch_file}: no non-empty lines")
        return prompts
    if args.prompt is None:
        raise UserError(
            'no prompt; try: flashspec generate "def quicksort(arr):", or --chat "a question"'
        )
    return [str(args.prompt)]


def _prompt_ids(engine: Any, prompt: str, args: argparse.Namespace) -> tuple[list[int], Any]:
    """Token ids of the one prompt (the chat template's with --chat) and its stop strings."""
    tokenizer = engine.target.tokenizer
    if tokenizer is None:
        raise UserError(f"--target {args.target}: the model has no tokenizer to encode a prompt")
    if args.chat is None:
        return [int(t) for t in tokenizer(prompt, add_special_tokens=True)["input_ids"]], None
    from ..engine.chat import chat_ids

    with _generation_errors():
        ids, stops = chat_ids(tokenizer, prompt, args.system)
    return ids, [list(stops)] if stops else None


def _stats_line(stats: Any, label: str = "speculative") -> str:
    line = (
        f"[{label}] {stats.new_tokens} tokens in {stats.time_total:.2f}s: "
        f"{stats.tokens_per_second:.1f} tokens/s, acceptance {stats.acceptance_rate:.1%}, "
        f"{stats.mean_tokens_per_round:.2f} tokens/round"
    )
    if len(stats.arm_rounds) > 1:
        ranked = sorted(stats.arm_rounds.items(), key=lambda kv: -kv[1])
        line += "; rounds per arm: " + ", ".join(f"{arm} {n}" for arm, n in ranked)
    return line


def cmd_generate(args: argparse.Namespace) -> int:
    """``flashspec generate``: stream, then stats (and the comparison with --compare)."""
    prompts = _read_prompts(args)
    if args.compare and len(prompts) > 1:
        raise UserError("--compare runs one prompt; drop --batch-file or --compare")
    grammar = _grammar(args)
    if args.compare and (grammar is not None or args.presence_penalty or args.frequency_penalty):
        raise UserError(
            "--compare runs HF generate, which has no grammar or OpenAI penalties; drop "
            "--compare, or --json-schema/--regex/--presence-penalty/--frequency-penalty"
        )
    quiet_libraries()
    engine = build_engine(args)
    out = sys.stdout
    ids, stops = _prompt_ids(engine, prompts[0], args) if len(prompts) == 1 else ([], None)
    if args.compare:
        # One short warm-up of both paths, so neither timing includes first-call set-up.
        with _generation_errors():
            engine.generate([ids], max_new_tokens=2)
        _plain_generate(engine, ids, 2, args)

    if len(prompts) == 1:
        # Arguments are checked when the stream is made, before anything is printed.
        with _generation_errors():
            stream = engine.stream(
                [ids], max_new_tokens=args.max_new_tokens, stop=stops, grammar=grammar
            )
        if args.chat is None:
            out.write(prompts[0])
            out.flush()
        for piece in stream.text():
            out.write(piece)
            out.flush()
        out.write("\n")
        result = stream.result
    else:
        with _generation_errors():
            result = engine.generate(prompts, max_new_tokens=args.max_new_tokens, grammar=grammar)
        for i, (prompt, text) in enumerate(zip(prompts, result.texts or [], strict=False)):
            out.write(f"--- [{i}] ---\n{prompt}{text}\n")
    assert result is not None
    out.flush()
    print(_stats_line(result.stats), file=sys.stderr, flush=True)

    if args.compare:
        start = time.perf_counter()
        plain = _plain_generate(engine, ids, args.max_new_tokens, args)
        plain_s = time.perf_counter() - start
        if result.finish_reasons[0] == "stop":
            # HF generate knows no stop strings: compare up to where the engine stopped.
            plain = plain[: len(result.tokens[0])]
        spec_s = result.stats.time_total
        speedup = plain_s / spec_s if spec_s > 0 else float("nan")
        print(
            f"[plain target] {len(plain)} tokens in {plain_s:.2f}s: "
            f"{len(plain) / plain_s if plain_s > 0 else 0.0:.1f} tokens/s; "
            f"speedup {speedup:.2f}x",
            file=sys.stderr,
        )
        if args.temperature == 0:
            from .._greedy import compare_greedy

            target = engine.target
            comparison = compare_greedy(
                target.model, ids, list(result.tokens[0]), plain, target.max_context
            )
            if comparison.status == "identical":
                print("[compare] greedy outputs identical", file=sys.stderr, flush=True)
            else:
                tie = comparison.status == "tie"
                print(
                    f"[compare] greedy outputs DIFFER from token {comparison.at}"
                    + (
                        f", where its token's logit is {comparison.gap:.1e} below the "
                        "target's top one, within rounding (a floating-point tie, not an error)"
                        if tie
                        else ""
                    ),
                    file=sys.stderr,
                    flush=True,
                )
                if not tie:
                    return 1
        else:
            print(
                "[compare] sampling (temperature > 0): outputs are draws from the same "
                "distribution, not token-for-token equal",
                file=sys.stderr,
                flush=True,
            )
    return 0


@contextlib.contextmanager
def _generation_errors() -> Iterator[None]:
    """The engine's argument errors (a prompt longer than the context...) as one line."""
    try:
        yield
    except (ValueError, ImportError) as exc:  # (ImportError: an optional extra is missing)
        raise UserError(first_line(exc)) from None


def _grammar(args: argparse.Namespace) -> Any:
    """The ``flashspec.grammar.Grammar`` that --json-schema or --regex asks for, or None."""
    from ..grammar import Grammar, GrammarError

    if args.json_schema is not None and args.regex is not None:
        raise UserError("give --json-schema or --regex, not both")
    try:
        if args.regex is not None:
            return Grammar("regex", args.regex)
        if args.json_schema is None:
            return None
        try:
            text = args.json_schema.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"--json-schema {args.json_schema}: {exc}") from None
        return Grammar("json_schema", text)
    except GrammarError as exc:
        flag = "--regex" if args.regex is not None else f"--json-schema {args.json_schema}"
        raise UserError(f"{flag}: {exc}") from None


def _plain_generate(
    engine: Any, prompt_ids: list[int], max_new_tokens: int, args: argparse.Namespace
) -> list[int]:
    """The target's own decoding (HF ``generate``), new token ids only."""
    import torch

    target = engine.target
    ids = torch.tensor([prompt_ids], dtype=torch.int64, device=target.device)
    eos = target.eos_token_ids
    options: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "attention_mask": torch.ones_like(ids),
        "eos_token_id": eos or None,
        "pad_token_id": eos[0] if eos else 0,
    }
    if args.repetition_penalty != 1.0:
        options["repetition_penalty"] = args.repetition_penalty
    if args.temperature == 0:
        options["do_sample"] = False
    else:
        if args.seed is not None:
            torch.manual_seed(args.seed)
        options.update(
            do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k
        )
    with torch.inference_mode():
        output = target.model.generate(ids, **options)
    return [int(t) for t in output[0, ids.shape[1] :].tolist()]
