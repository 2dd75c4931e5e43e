"""Every earlier name that flashspec keeps working, listed and provided in one place.

Earlier names come from two sources: the earlier FlashSpec library, whose quickstart runs
unchanged (``tests/project/test_earlier_quickstart.py``), and flashspec's own paths from before the
package per area (#22). ``EARLIER`` is the table: each row gives the earlier name, what it is
now, and since when and why. Names are written ``module:attribute`` (flags as typed).

How each kind of row is provided:

- ``moved``: a name whose module moved (``flashspec.bandit:UCB1Selector``). The earlier module
  stays importable and resolves its names from here on first use (``earlier_module``), so its
  file holds nothing but that one line.
- ``alias``: an attribute's earlier name on a class (``SpeculativeEngine.model``): an ``Alias``
  on the class, which reads and writes the current attribute.
- ``field``: a dataclass field's earlier name (``BanditConfig.strategy``): an ``EarlierField``
  on the class; given to ``__init__``, it sets the current field.
- ``kept``: a field of the earlier library that flashspec keeps with its own meaning
  (``BanditConfig.n_arms``); an ordinary field, and the row says what covers it now.
- ``verb``: a ``Drafter`` verb's earlier name (``Drafter.prefill``): a subclass written against
  it gets the current verb from its own method (``earlier_verbs``, run when the class is
  defined), so a custom drafter of before #39 runs unchanged.
- ``flag``: a command-line flag's earlier spelling (``--variant``): ``earlier_flags``.

None of them warns: the earlier library's users run its code as they wrote it, and nothing
here is scheduled for removal.

Standard library only, so that ``import flashspec`` and ``flashspec.TRITON_AVAILABLE`` load
neither torch nor triton.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Collection, Sequence
from typing import Any, Generic, Literal, NamedTuple, TypeVar, cast, overload

from ._lazy import lazy_exports

T = TypeVar("T")

Kind = Literal["moved", "alias", "field", "kept", "verb", "flag"]


class Earlier(NamedTuple):
    """One earlier name: ``name`` (``module:attribute``, or a flag) is ``current`` now."""

    kind: Kind
    name: str
    current: str
    since: str


_LAYOUT = "0.1.0, the package per area (#22, 714c0fb): the module moved into its area's package"
_LIBRARY = "0.1.0 (#22, f8a154e): the earlier FlashSpec library's name; its quickstart runs as is"
_ONE_NAME = "0.1.0 (#22, f8a154e): one name per concept"
_DRAFTERS = "0.1.0, the drafters package (#39): the module moved into flashspec.drafters"
_CLI = "0.1.0, the command line's package (#39): moved into flashspec.cli or flashspec.flags"
_DRAFTER = "flashspec.drafters:Drafter"
_VERBS = (
    "0.1.0, one drafter contract (#39): begin, propose, keep(lengths, padding) after every round"
)
_BENCH = "0.1.0, no benchmark module over 600 lines (#39): the module became a package"


def _moved(module: str, current: str, names: tuple[str, ...], since: str) -> list[Earlier]:
    return [Earlier("moved", f"{module}:{name}", f"{current}:{name}", since) for name in names]


EARLIER: tuple[Earlier, ...] = (
    *_moved(
        "flashspec.bandit",
        "flashspec.select.bandit",
        ("Selector", "ThompsonSelector", "UCB1Selector", "make_selector"),
        _LAYOUT,
    ),
    *_moved(
        "flashspec.throughput",
        "flashspec.select.throughput",
        ("ThroughputModel", "expected_counts"),
        _LAYOUT,
    ),
    # flashspec.server's names, each at its most public current path: flashspec.serve where
    # that package exports it, else the serve module that defines it.
    *_moved(
        "flashspec.server",
        "flashspec.serve",
        (
            "API_KEY_ENV",
            "DEFAULT_BODY_TIMEOUT_S",
            "DEFAULT_HEADER_TIMEOUT_S",
            "DEFAULT_MAX_BODY_BYTES",
            "DEFAULT_MAX_HEADER_BYTES",
            "FALLBACK_CHAT_STOP",
            "ApiError",
            "Metrics",
            "ServerThread",
            "StopTrimmer",
            "bind",
            "create_app",
            "resolve_api_key",
            "serve",
            "server_metrics",
            "uvicorn_config",
        ),
        _LAYOUT,
    ),
    *_moved("flashspec.server", "flashspec.serve.app", ("ENDPOINTS",), _LAYOUT),
    *_moved(
        "flashspec.server",
        "flashspec.serve.completions",
        ("COMPLETION_DEFAULT_MAX_TOKENS",),
        _LAYOUT,
    ),
    *_moved(
        "flashspec.server",
        "flashspec.serve.generation",
        ("DISCONNECT_POLL_S", "FINISH_REASONS"),
        _LAYOUT,
    ),
    *_moved(
        "flashspec.server",
        "flashspec.serve.run",
        ("KEEP_ALIVE_TIMEOUT_S", "LISTEN_BACKLOG"),
        _LAYOUT,
    ),
    *_moved(
        "flashspec.server",
        "flashspec.serve.service",
        ("NORMALIZED_TEXT_SLACK", "UNBOUNDED_DEFAULT_MAX_TOKENS", "prompt_char_limit"),
        _LAYOUT,
    ),
    *_moved("flashspec.feature_drafter", "flashspec.drafters", ("FeatureDrafter",), _DRAFTERS),
    *_moved(
        "flashspec.shared_head",
        "flashspec.drafters.shared_head",
        (
            "CONFIG_FILE",
            "FORMAT",
            "INPUTS",
            "SHARED_PREFIXES",
            "WEIGHTS_FILE",
            "FeatureFuse",
            "SubsetHead",
            "attach",
            "build_shared_head_draft",
            "draft_input",
            "feature_hidden",
            "load_shared_head_draft",
            "own_state",
            "save_shared_head_draft",
        ),
        _DRAFTERS,
    ),
    # The command line's package (#39, item 6): `flashspec serve`'s parser moved into
    # flashspec.cli; the engine flags and what every command shares into flashspec.flags.
    *_moved(
        "flashspec.options",
        "flashspec.flags.options",
        (
            "COMPILE_CHOICES",
            "EngineOptions",
            "UserError",
            "add_compile_argument",
            "check_model_name",
            "compile_setting",
            "first_line",
            "quiet_libraries",
        ),
        _CLI,
    ),
    *_moved(
        "flashspec.serve.cli",
        "flashspec.cli.serve",
        ("add_parser", "cmd_serve", "grace_seconds", "port", "seconds"),
        _CLI,
    ),
    # The benchmarks over 600 lines, each split into a package (#39): what it times
    # (methods), the run (measure), the tables (report), the flags and main (command).
    # Their earlier ``report`` function is the report module's ``text`` now.
    *_moved(
        "flashspec.bench.batch",
        "flashspec.bench.batch.command",
        ("add_arguments", "main", "result_name", "settings_from_args"),
        _BENCH,
    ),
    *_moved(
        "flashspec.bench.batch",
        "flashspec.bench.batch.measure",
        ("BatchSettings", "DEFAULT_PROMPTS", "check_targets", "run_batch"),
        _BENCH,
    ),
    *_moved(
        "flashspec.bench.batch",
        "flashspec.bench.batch.methods",
        (
            "BASELINE",
            "BatchRun",
            "BatchRunner",
            "DEFAULT_BATCHES",
            "LABELS",
            "METHODS",
            "WARMUP_TOKENS",
            "describe",
            "engine_config",
            "left_pad",
        ),
        _BENCH,
    ),
    *_moved(
        "flashspec.bench.batch",
        "flashspec.bench.batch.report",
        ("table", "target_lines"),
        _BENCH,
    ),
    *_moved(
        "flashspec.bench.chat",
        "flashspec.bench.chat.command",
        ("main", "settings_from_args"),
        _BENCH,
    ),
    *_moved(
        "flashspec.bench.chat",
        "flashspec.bench.chat.measure",
        (
            "ChatSettings",
            "DEFAULT_COPY",
            "DEFAULT_HUMANEVAL",
            "DEFAULT_SWEEP_GAMMAS",
            "DEFAULT_SWEEP_PROMPTS",
            "SPEEDUP_TARGET",
            "VS_LOOKUP_TARGET",
            "check_targets",
            "cost_probe",
            "gamma_sweep",
            "identity",
            "run_chat",
            "spread",
            "summarise",
        ),
        _BENCH,
    ),
    *_moved(
        "flashspec.bench.chat",
        "flashspec.bench.chat.methods",
        (
            "BF16_METHODS",
            "ChatMethods",
            "FP32_METHODS",
            "HF_LOOKUP_TOKENS",
            "LLAMACPP_CONTEXT",
            "LLAMACPP_LOOKUP_TOKENS",
            "LLAMACPP_METHODS",
            "METHODS",
            "Run",
            "SWEEP_PREFIX",
            "WORKLOADS",
            "baseline_of",
            "llamacpp_module",
        ),
        _BENCH,
    ),
    *_moved(
        "flashspec.bench.compiled",
        "flashspec.bench.compiled.command",
        ("add_arguments", "main", "result_name", "settings_from_args"),
        _BENCH,
    ),
    *_moved(
        "flashspec.bench.compiled",
        "flashspec.bench.compiled.measure",
        (
            "CompiledSettings",
            "DEFAULT_NEW_TOKENS",
            "DEFAULT_PROMPTS",
            "DEFAULT_REPEATS",
            "STREAMING_FLOOR",
            "checks",
            "describe",
            "ratios",
            "run_compiled",
            "run_dtype",
            "spread",
            "warmup_order",
        ),
        _BENCH,
    ),
    *_moved(
        "flashspec.bench.compiled",
        "flashspec.bench.compiled.methods",
        (
            "BASELINE",
            "Call",
            "CompiledRunner",
            "DTYPES",
            "FLASHSPEC",
            "LABELS",
            "METHODS",
            "MODES",
            "REFERENCE",
            "dynamo_graphs",
            "engine_config",
            "hf_compile_config",
            "inductor_cache",
            "mode_sampling",
            "weight_bytes",
        ),
        _BENCH,
    ),
    *_moved(
        "flashspec.bench.compiled",
        "flashspec.bench.compiled.report",
        ("compile_table", "identity_cell", "streaming_lines", "table"),
        _BENCH,
    ),
    *_moved(
        "flashspec.bench.chat",
        "flashspec.bench.chat_requests",
        ("COPY_KINDS", "ChatRequest", "chat_ids", "copy_prompts", "humaneval_requests"),
        _BENCH,
    ),
    *_moved("flashspec.bench.chat", "flashspec.bench.common", ("result_name",), _BENCH),
    *_moved("flashspec.engine", "flashspec.models", ("TargetModel",), _LIBRARY),
    *_moved("flashspec.engine", "flashspec.drafters", ("load_drafters",), _LIBRARY),
    Earlier(
        "moved",
        "flashspec:TRITON_AVAILABLE",
        "flashspec.legacy:TRITON_AVAILABLE",
        f"{_LIBRARY}. flashspec has no triton code: the flag says whether triton is installed, "
        "looked up on first use without importing it",
    ),
    Earlier(
        "alias",
        "flashspec.engine:SpeculativeEngine.model",
        "flashspec.engine:SpeculativeEngine.throughput",
        f"{_ONE_NAME}: the ThroughputModel is no neural model",
    ),
    Earlier(
        "field",
        "flashspec.config:BanditConfig.strategy",
        "flashspec.config:BanditConfig.selector",
        f"{_LIBRARY} (the same values)",
    ),
    Earlier(
        "kept",
        "flashspec.config:BanditConfig.n_arms",
        "flashspec.engine:SpeculativeEngine.arms",
        f"{_LIBRARY}: if set, checked against the number of arms when the engine is built",
    ),
    Earlier(
        "kept",
        "flashspec.config:FlashSpecConfig.target_name",
        "flashspec.engine:SpeculativeEngine.from_pretrained",
        f"{_LIBRARY}: the target from_pretrained loads when it is given none",
    ),
    Earlier(
        "kept",
        "flashspec.config:FlashSpecConfig.drafter_name",
        "flashspec.engine:SpeculativeEngine.from_pretrained",
        f"{_LIBRARY}: the drafter from_pretrained loads when it is given none",
    ),
    Earlier("verb", _DRAFTER + ".prefill", _DRAFTER + ".begin", _VERBS),
    Earlier(
        "verb",
        _DRAFTER + ".commit",
        _DRAFTER + ".keep",
        f"{_VERBS}; commit(valid) is called with the columns every row keeps (lockstep)",
    ),
    Earlier(
        "verb",
        _DRAFTER + ".keep_rows",
        _DRAFTER + ".keep",
        f"{_VERBS}; keep_rows(lengths) is called for a drafter that serves ragged batches",
    ),
    Earlier("flag", "--variant", "--method", f"{_ONE_NAME}: SamplingConfig.method"),
)
"""Every earlier name, in the order of the kinds in the module docstring."""


def resolve(name: str) -> Any:
    """The object a ``module:attribute.attribute`` name (a row's ``name`` or ``current``) reads
    as: the module imported, then each attribute read in turn (a class's descriptors as the
    class reads them)."""
    module, _, attributes = name.partition(":")
    value: Any = importlib.import_module(module)
    for attribute in attributes.split("."):
        value = getattr(value, attribute)
    return value


def earlier_module(
    namespace: dict[str, Any],
) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """``(__getattr__, __dir__, __all__)`` for a module that keeps earlier names: the ``moved``
    rows of the module whose globals are ``namespace``, each imported from its current module
    on first use (so an earlier module costs no import of its own, and needs an extra such as
    ``[serve]`` only when a name that needs it is used)."""
    prefix = f"{namespace['__name__']}:"
    exports = {
        row.name.removeprefix(prefix): row.current.partition(":")[0]
        for row in EARLIER
        if row.kind == "moved" and row.name.startswith(prefix)
    }
    getattr_, dir_ = lazy_exports(namespace, exports)
    return getattr_, dir_, sorted(exports)


def earlier_flags(flag: str) -> tuple[str, ...]:
    """The earlier spellings of the command-line flag ``flag``, to register as its aliases."""
    return tuple(row.name for row in EARLIER if row.kind == "flag" and row.current == flag)


def earlier_verbs(cls: type, base: type) -> None:
    """Give ``cls``, a subclass of the drafter interface ``base``, the current verbs its own
    methods of their earlier names stand for (the ``verb`` rows): ``prefill`` is ``begin``;
    ``commit(valid)`` and ``keep_rows(lengths)`` together are ``keep(lengths, padding)``. A
    class that defines the current verb itself keeps it. As before #39, a drafter that overrides
    ``commit`` serves lockstep batches only unless it says otherwise (``shiftable``)."""
    own = vars(cls)
    if "prefill" in own and "begin" not in own:
        cls.begin = own["prefill"]  # type: ignore[attr-defined]
    commit = own.get("commit")
    keep_rows = own.get("keep_rows")
    if (commit is None and keep_rows is None) or "keep" in own:
        return

    def keep(self: Any, lengths: Sequence[int], padding: Any) -> None:
        rows = getattr(self, "keep_rows", None)
        if rows is not None and self.shiftable:
            rows(lengths)
            return
        valid = getattr(self, "commit", None)
        if valid is not None:
            # Lockstep: every row keeps the same columns, its count and its left padding.
            valid(lengths[0] + padding.lefts[0])

    cls.keep = keep  # type: ignore[attr-defined]
    declares = any("shiftable" in vars(k) for k in cls.__mro__ if k is not base)
    if commit is not None and keep_rows is None and not declares:
        cls.shiftable = property(lambda self: False)  # type: ignore[attr-defined]


class Alias(Generic[T]):
    """An attribute's earlier name on a class: reading or setting it reads or sets ``current``.

    Read from the class, it is the alias itself (``flashspec.legacy`` lists every one).
    """

    def __init__(self, current: str) -> None:
        self.current = current

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Alias[T]: ...

    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...

    def __get__(self, obj: object | None, owner: type | None = None) -> Alias[T] | T:
        if obj is None:
            return self
        return cast(T, getattr(obj, self.current))

    def __set__(self, obj: object, value: T) -> None:
        setattr(obj, self.current, value)


class EarlierField(Generic[T]):
    """A dataclass field's earlier name, declared as a field after ``current`` (default None).

    Given a value, ``__init__`` checks it against ``choices`` and sets ``current`` to it;
    ``current`` given a different value too is a ``ValueError``. Read, it is the value given
    (None if none was): ``repr``, equality and ``dataclasses.replace`` see the fields as they
    were given, so replacing ``current`` alone works as for any field.
    """

    def __init__(self, current: str, choices: Collection[object]) -> None:
        self.current = current
        self.choices = tuple(choices)
        self.name = ""
        self.owner = ""

    def __set_name__(self, owner: type, name: str) -> None:
        fields = list(owner.__annotations__)
        # __init__ assigns fields in declaration order; the check of a given value against
        # ``current`` needs ``current`` assigned already.
        if self.current not in fields or fields.index(self.current) > fields.index(name):
            raise TypeError(f"{owner.__name__}.{name} must be declared after {self.current}")
        self.name = name
        self.owner = owner.__name__

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> None: ...

    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T | None: ...

    def __get__(self, obj: object | None, owner: type | None = None) -> T | None:
        # From the class (dataclass reads the field's default this way): None.
        if obj is None:
            return None
        return cast("T | None", vars(obj).get(self.name))

    def __set__(self, obj: object, value: T | None) -> None:
        vars(obj)[self.name] = value
        if value is None:
            return
        where = f"{self.owner}.{self.name}"
        if value not in self.choices:
            raise ValueError(
                f"{where} (the earlier name of {self.current}) must be one of "
                f"{self.choices}, got {value!r}"
            )
        given = getattr(obj, self.current)
        if given not in (getattr(type(obj), self.current), value):  # its default, or the same
            raise ValueError(
                f"{where}={value!r} and {self.current}={given!r} disagree; {self.name} is the "
                f"earlier name of {self.current}: give one of them"
            )
        setattr(obj, self.current, value)


TRITON_AVAILABLE: bool
"""Whether triton is installed (found on the import path; not imported). The earlier library's
flag: flashspec itself has no triton code. Computed on first use (``__getattr__``)."""


def _triton_installed() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a broken entry in sys.modules or on the path
        return False


def __getattr__(name: str) -> Any:
    # Looking triton up probes the import path: done once, when the flag is first read.
    if name == "TRITON_AVAILABLE":
        value = globals()[name] = _triton_installed()
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
