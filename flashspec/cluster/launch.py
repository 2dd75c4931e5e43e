"""Starting a replicated server: ``Cluster`` joins a Ray cluster (``RAY_ADDRESS``) or starts a
local one, runs the application on Ray Serve, and takes it down again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any

import ray
import ray.exceptions
from ray import serve

from ..flags.options import UserError
from ..serve.run import bind, loopback
from .app import application
from .replica import BOARD_NAMESPACE, board_name
from .settings import RAY_ADDRESS_ENV, ClusterSettings

logger = logging.getLogger("flashspec.cluster")

# A local head's object store: requests and answers are small; Ray's default (30% of memory)
# would reserve gigabytes of shared memory for nothing.
LOCAL_OBJECT_STORE_BYTES = 200 * 2**20


def check_fits(settings: ClusterSettings, cpus: int) -> None:
    """Refuse replicas that a local head of ``cpus`` CPUs could never place (Ray would wait
    for them forever).

    Raises:
        UserError: naming the flags and what they need.
    """
    need = settings.replicas * settings.replica_cpus
    if need > cpus:
        raise UserError(
            f"--replicas {settings.replicas} x --replica-cpus {settings.replica_cpus:g} needs "
            f"{need:g} CPUs but this machine has {cpus}; use fewer replicas or CPUs each, or "
            f"join a bigger cluster with {RAY_ADDRESS_ENV}"
        )


class Cluster:
    """A replicated ``flashspec serve``, running on Ray Serve until ``stop``.

    Args:
        settings: the application (engine, replicas, limits).
        host: the address Ray Serve's HTTP proxy listens on.
        port: its port (0: a free one, read back as ``port``).
        address: a Ray cluster to join (default: ``$RAY_ADDRESS``; neither: start a local head
            bound to loopback, with ``num_cpus`` CPUs, default all).
        num_cpus: CPUs of a local head (ignored when joining).
        log_to_driver: show the replicas' logs on this process's stderr.
    """

    def __init__(
        self,
        settings: ClusterSettings,
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        address: str | None = None,
        num_cpus: int | None = None,
        log_to_driver: bool = True,
    ) -> None:
        self.settings = settings
        self.host = host
        self.address = address if address is not None else os.environ.get(RAY_ADDRESS_ENV)
        self.num_cpus = num_cpus
        self.log_to_driver = log_to_driver
        # Binding first turns "address in use" into an error here, instead of a Ray proxy that
        # retries forever; the port is then handed to Ray (closed just before it binds).
        try:
            probe = bind(host, port)
        except OSError as exc:
            raise UserError(
                f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc}); "
                "pick another --port or --host"
            ) from None
        self.port: int = probe.getsockname()[1]
        probe.close()
        self._any_port = port == 0
        self._started_ray = False

    @property
    def url(self) -> str:
        """``http://host:port``."""
        return f"http://{self.host}:{self.port}"

    def start(self) -> Cluster:
        """Connect or start Ray, deploy the application, return once every replica is ready.

        Raises:
            UserError: a local head has fewer CPUs than the replicas reserve.
        """
        if not ray.is_initialized():
            if self.address:
                try:
                    ray.init(address=self.address, log_to_driver=self.log_to_driver)
                except (ConnectionError, RuntimeError, ray.exceptions.RayError) as exc:
                    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                    raise UserError(
                        f"{RAY_ADDRESS_ENV}={self.address}: cannot join the Ray cluster there "
                        f"({type(exc).__name__}: {reason[:300]}); check the address (and, for "
                        "a cluster with token authentication, RAY_AUTH_MODE=token and its "
                        f"token), or unset {RAY_ADDRESS_ENV} to start a local Ray head"
                    ) from None
            else:
                cpus = self.num_cpus or os.cpu_count() or 1
                check_fits(self.settings, cpus)
                ray.init(
                    num_cpus=cpus,
                    include_dashboard=False,
                    object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                    log_to_driver=self.log_to_driver,
                    _node_ip_address="127.0.0.1" if loopback(self.host) else None,
                )
                self._started_ray = True
        if self._any_port:
            # Any free port: chosen again now that Ray's own processes have bound theirs (one
            # of them once took the port chosen before ray.init, and the proxy could not bind).
            probe = bind(self.host, 0)
            self.port = probe.getsockname()[1]
            probe.close()
        serve.start(http_options={"host": self.host, "port": self.port})
        serve.run(application(self.settings), name=self.settings.app_name, route_prefix="/")
        return self

    def replicas(self) -> list[str]:
        """The ids of the engine replicas alive now (as ``x-flashspec-replica`` names them)."""
        ids = []
        for actor in ray.util.list_named_actors(all_namespaces=True):
            name = str(actor.get("name", ""))
            prefix = f"SERVE_REPLICA::{self.settings.app_name}#EngineReplica#"
            if name.startswith(prefix):
                ids.append(name[len(prefix) :])
        return sorted(ids)

    def kill_replica(self, replica: str) -> None:
        """Kill one engine replica's process at once (Ray Serve starts another): for tests."""
        name = f"SERVE_REPLICA::{self.settings.app_name}#EngineReplica#{replica}"
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)

    def stop(self) -> None:
        """Delete the application, its board, and Ray itself if ``start`` started it."""
        if not ray.is_initialized():  # start failed before Ray came up: nothing to take down
            return
        with contextlib.suppress(Exception):
            serve.delete(self.settings.app_name)
        with contextlib.suppress(Exception):
            ray.kill(ray.get_actor(board_name(self.settings.app_name), namespace=BOARD_NAMESPACE))
        if self._started_ray:
            with contextlib.suppress(Exception):
                serve.shutdown()  # type: ignore[no-untyped-call]
            ray.shutdown()

    def wait(self) -> None:
        """Block until interrupted (Ctrl-C)."""
        while True:
            time.sleep(3600)

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def status(app_name: str) -> Any:
    """Ray Serve's status of application ``app_name`` (None if it is not running)."""
    return serve.status().applications.get(app_name)
