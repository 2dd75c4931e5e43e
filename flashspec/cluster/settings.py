"""``ClusterSettings``: everything a replicated ``flashspec serve`` needs, in one picklable value.

The launcher (``flashspec serve --replicas``) and Ray Serve's config file (``build`` in
``flashspec.cluster.app``, for ``serve run`` and KubeRay) both end here, and the ingress and each
replica read the same copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from types import UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints

from ..flags.options import EngineOptions, UserError
from ..serve.worker import BATCHING_MODES, DEFAULT_SHUTDOWN_TIMEOUT_S

DEFAULT_APP_NAME = "flashspec"
RAY_ADDRESS_ENV = "RAY_ADDRESS"
"""The environment variable naming a Ray cluster to join (unset: start a local head)."""
# How text spells a boolean in ``serve run key=value`` arguments.
TRUE_WORDS = frozenset({"true", "yes", "on", "1"})
FALSE_WORDS = frozenset({"false", "no", "off", "0"})


def _coerce(name: str, value: Any, hint: Any) -> Any:
    """``value`` as field ``name``'s type, where it came as text (``serve run key=value``
    passes every value as a string).

    Raises:
        UserError: text that is not a value of that type, naming the field.
    """
    if not isinstance(value, str):
        return value
    options = get_args(hint) if get_origin(hint) in (Union, UnionType) else (hint,)
    if type(None) in options and value.strip().lower() in ("none", "null", ""):
        return None
    for kind in options:
        if kind is str:
            return value
    for kind in options:
        try:
            if kind is bool:
                word = value.strip().lower()
                if word in TRUE_WORDS:
                    return True
                if word in FALSE_WORDS:
                    return False
                raise ValueError(value)
            if kind in (int, float):
                return kind(value)
        except ValueError:
            continue
    spelled = getattr(hint, "__name__", None) or str(hint)
    raise UserError(f"{name}: cannot read {value!r} as {spelled}")


@dataclass(frozen=True)
class ClusterSettings:
    """A replicated server: the engine each replica builds, the app it serves, how many.

    Attributes:
        engine: how each replica builds its engine (the ``flashspec serve`` engine flags).
        replicas: replicas to start with (each holds its own engine and worker).
        max_replicas: with a value above ``replicas``, Ray Serve autoscales between the two on
            queue length (``target_ongoing`` requests per replica); None: fixed.
        target_ongoing: requests in flight per replica that autoscaling aims for (default:
            ``max_batch``, a full batch each).
        replica_cpus: CPUs Ray reserves for each replica; torch uses that many threads.
        model_name: the model id clients send and ``GET /v1/models`` lists.
        max_batch: rows per engine batch in each replica; also the requests Ray Serve sends a
            replica at once (more wait in Ray's queue for whichever replica frees first).
        batching: ``"continuous"`` or ``"static"`` (see ``flashspec.serve.create_app``).
        max_queue: requests waiting in Ray's queue per replica at most; more get 503.
        timeout_s: per-request limit, arrival to last token, queueing included.
        api_key: when set, every endpoint but ``/health`` needs ``Authorization: Bearer KEY``.
        retries: other replicas a request is tried on when its replica dies before a byte of
            the answer was sent (0: none).
        shutdown_timeout_s: how long a replica that Ray Serve stops (scaling down, a
            redeploy, ``serve.delete``) may finish its requests before it is killed; a request
            of a killed replica goes to another one (``retries``) or ends in an error.
        app_name: the Ray Serve application's name (one cluster can hold several).
    """

    engine: EngineOptions = field(default_factory=EngineOptions)
    replicas: int = 2
    max_replicas: int | None = None
    target_ongoing: float | None = None
    replica_cpus: float = 1.0
    model_name: str = "flashspec"
    max_batch: int = 8
    batching: str = "continuous"
    max_queue: int = 64
    timeout_s: float = 60.0
    api_key: str | None = None
    retries: int = 2
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    app_name: str = DEFAULT_APP_NAME

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, what: str) -> None:
            if not ok:
                raise UserError(f"{name}: must be {what}, got {getattr(self, name)!r}")

        need(isinstance(self.replicas, int) and self.replicas >= 1, "replicas", "an integer >= 1")
        need(
            self.max_replicas is None
            or (isinstance(self.max_replicas, int) and self.max_replicas >= self.replicas),
            "max_replicas",
            f"None or an integer >= replicas ({self.replicas})",
        )
        need(self.target_ongoing is None or self.target_ongoing > 0, "target_ongoing", "> 0")
        need(self.replica_cpus > 0, "replica_cpus", "> 0")
        need(isinstance(self.max_batch, int) and self.max_batch >= 1, "max_batch", ">= 1")
        need(self.batching in BATCHING_MODES, "batching", f"one of {BATCHING_MODES}")
        need(isinstance(self.max_queue, int) and self.max_queue >= 1, "max_queue", ">= 1")
        need(self.timeout_s > 0, "timeout_s", "> 0 seconds")
        need(isinstance(self.retries, int) and self.retries >= 0, "retries", ">= 0")
        need(self.shutdown_timeout_s >= 0, "shutdown_timeout_s", ">= 0 seconds")
        need(bool(self.app_name), "app_name", "a non-empty name")

    @property
    def autoscaling(self) -> dict[str, Any] | None:
        """Ray Serve's ``autoscaling_config``, or None for a fixed number of replicas."""
        if self.max_replicas is None or self.max_replicas == self.replicas:
            return None
        return {
            "min_replicas": self.replicas,
            "initial_replicas": self.replicas,
            "max_replicas": self.max_replicas,
            "target_ongoing_requests": self.target_ongoing or float(self.max_batch),
        }

    @property
    def threads(self) -> int:
        """Torch threads per replica: its CPUs, at least one."""
        return max(1, int(self.replica_cpus))

    @classmethod
    def from_dict(cls, args: dict[str, Any]) -> ClusterSettings:
        """Settings from a Ray Serve config's ``args`` (engine flags and these fields, flat).
        Values may come as text (``serve run ... replicas=2``): each is read as its field's
        type.

        Raises:
            UserError: an unknown key (naming it and the known ones), or text that is not a
                value of its field's type.
        """
        engine_names = {f.name for f in fields(EngineOptions)}
        own_names = {f.name for f in fields(cls)} - {"engine"}
        unknown = sorted(set(args) - engine_names - own_names)
        if unknown:
            raise UserError(
                f"unknown setting(s) {', '.join(unknown)}; known: "
                f"{', '.join(sorted(engine_names | own_names))}"
            )
        engine_hints = get_type_hints(EngineOptions)
        own_hints = get_type_hints(cls)
        engine = EngineOptions(
            **{k: _coerce(k, v, engine_hints[k]) for k, v in args.items() if k in engine_names}
        )
        own = {k: _coerce(k, v, own_hints[k]) for k, v in args.items() if k in own_names}
        return cls(engine=engine, **own)
