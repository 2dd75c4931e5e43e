"""The Ray Serve application: an ``Ingress`` in front of ``EngineReplica`` replicas.

``application(settings)`` is what ``flashspec serve --replicas`` runs; ``build(args)`` is the
same for Ray Serve's own tools (``serve run flashspec.cluster.app:build target=smollm2``, a
``serveConfigV2`` in KubeRay's ``RayService``), its ``args`` the settings' fields, flat.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ray import serve
from ray.serve import Application

from ..serve.service import resolve_api_key
from .ingress import Ingress, deployment_options
from .replica import EngineReplica
from .settings import ClusterSettings


def replica_options(settings: ClusterSettings) -> dict[str, Any]:
    """``serve.deployment`` options of the engine replicas."""
    options: dict[str, Any] = {
        "name": "EngineReplica",
        "ray_actor_options": {"num_cpus": settings.replica_cpus},
        # A replica takes a batch's worth of requests; the rest wait in the router's queue for
        # whichever replica frees first (instead of in one replica's queue behind its batch).
        "max_ongoing_requests": settings.max_batch,
        "max_queued_requests": settings.max_queue,
        # A replica builds its engine (and compiles, where --compile says so) before it is
        # ready; the health check replaces one whose worker died.
        "health_check_period_s": 5.0,
        "health_check_timeout_s": 30.0,
        "graceful_shutdown_timeout_s": settings.shutdown_timeout_s,
    }
    autoscaling = settings.autoscaling
    if autoscaling is None:
        options["num_replicas"] = settings.replicas
    else:
        options["autoscaling_config"] = autoscaling
    return options


def application(settings: ClusterSettings) -> Application:
    """The application ``settings`` describe, ready for ``serve.run``."""
    replica = serve.deployment(**replica_options(settings))(EngineReplica)
    ingress = serve.deployment(**deployment_options(settings))(serve.ingress()(Ingress))
    application: Application = ingress.bind(replica.bind(settings), settings)
    return application


def build(args: dict[str, Any]) -> Application:
    """Ray Serve's application builder: ``args`` are ``ClusterSettings``' and the engine's
    fields, flat (``{"target": "smollm2", "replicas": 2}``). Without ``api_key`` in ``args``,
    ``$FLASHSPEC_API_KEY`` (where the application is built) gives the key, so that it can come
    from a secret rather than the config file.

    Raises:
        UserError: an unknown or bad setting, naming it.
    """
    settings = ClusterSettings.from_dict(dict(args))
    if settings.api_key is None:
        settings = dataclasses.replace(settings, api_key=resolve_api_key(None))
    return application(settings)
