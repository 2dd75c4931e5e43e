"""``flashspec serve --replicas``: the OpenAI-compatible server as replicas on Ray Serve.

Lazy re-exports (PEP 562): the package loads without Ray; using it needs ``flashspec[ray]``.
"""

# The modules, one job each; imports go one way, from the top of this list down:
#   launch    Cluster: join or start Ray, run the application, take it down
#   app       application(), build(): the Ray Serve application (ingress + replicas)
#   ingress   Ingress: HTTP entry, forwarding to replicas, retries, /health and /metrics
#   replica   EngineReplica: one engine and the flashspec app, served in-process
#   board     Board: replicas' health and metrics, merged (a named Ray actor)
#   forward   Forwarded, Head, call_app: one request across processes, run through the app
#   settings  ClusterSettings: everything the application needs, picklable

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "Cluster": ".launch",
    "application": ".app",
    "build": ".app",
    "ClusterSettings": ".settings",
    "REPLICA_HEADER": ".forward",
}

__all__ = ["REPLICA_HEADER", "Cluster", "ClusterSettings", "application", "build"]

if TYPE_CHECKING:
    from .app import application, build
    from .forward import REPLICA_HEADER
    from .launch import Cluster
    from .settings import ClusterSettings


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
