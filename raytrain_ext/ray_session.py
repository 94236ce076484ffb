"""The driver's connection to Ray: a cluster's address, or a private single-node Ray.

Its own module because every command that runs on Ray connects the same way (``train``,
``data prepare``, ``doctor``, the benches); with it in ``trainer.py``, the data pipeline
imported the trainer and the trainer the data pipeline.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from contextlib import contextmanager
from types import ModuleType
from typing import Any, Callable, Iterator, List, Mapping, Optional, Tuple

from raytrain_ext.worker.priority import yield_auxiliary_daemons

log = logging.getLogger(__name__)

# How a Ray process retries connecting to a local socket that is not there yet: every
# 0.1 s, up to 100 times, instead of Ray's every 1 s, up to 10 times (the same 10 s in
# all).  Why: a starting raylet connects to its own object store, whose socket a thread of
# its own creates, and on 2 busy cores that thread had not always done so at the first
# try: the raylet then slept 1 s before it even started its agents.  Measured here
# (private starts): ``ray.init`` took 2.15-2.18 s in 6 starts of 15 (the retry) and
# 1.25-1.55 s in the others; 1.28-1.67 s in 10 of 10 with this.  A cluster's head gives it
# to the nodes that join (Ray's system config lives in the GCS).
SOCKET_RETRY_CONFIG = {
    "raylet_client_connect_timeout_milliseconds": 100,
    "raylet_client_num_connect_attempts": 100,
}


def connect_ray(address: Optional[str], worker_env: Optional[Mapping[str, str]] = None) -> bool:
    """Attach to Ray; returns True when this call started a local instance.

    ``worker_env``: the variables every worker process of a private Ray starts with (the
    ranks' own, ``worker.process_env``), given to its raylet; not used when attaching to
    a cluster.

    A private Ray retries its local sockets every 0.1 s (:data:`SOCKET_RETRY_CONFIG`), and
    starts no idle processes for this driver's job (Ray's default, one per CPU): they start
    while ``ray.init`` still runs and took its CPU, measured here (``ray_start`` 1.7-2.7 s
    with them, 1.3-2.3 s without, and no shorter start to the first step although the
    ranks took them)."""
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return False
    _pin_local_ray_to_loopback()
    with private_node_start(worker_env):
        ray.init(
            address="local",
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            _system_config={"prestart_worker_first_driver": False, **SOCKET_RETRY_CONFIG},
        )
    yield_auxiliary_daemons()
    return True


@contextmanager
def private_node_start(worker_env: Optional[Mapping[str, str]] = None) -> Iterator[None]:
    """Start a private Ray without its dashboard API server or its autoscaler monitor, its
    dashboard agent listening on a free port, its raylet (and so every process it starts)
    with ``worker_env`` in its environment (``worker.process_env``).

    Why no API server: with ``include_dashboard=False`` Ray still starts that process,
    loading only its usage-stats module, and ``ray.init`` waits for it to register before
    it even starts the raylet: 1.0-1.7 s of every cold start measured here (``ray.init``
    median 3.3 s with it, 1.7 s without, five runs each).  A private Ray serves this
    process only: no job submission, dashboard or state API goes through that server (none
    is loaded when the dashboard is off), so nothing of ours or the user's needs it.

    Why no autoscaler monitor: a single node has nothing to scale, drain notices come from
    the GCS (``elastic.notices``), and the monitor's start took 0.5 CPU-seconds on the
    cores where the raylet's agents start (``ray.init`` 1.46-1.53 s without it against
    1.62-1.74 s with it, the runs whose raylet registered within Ray's first poll).  Its
    stop was also the one Ray's shutdown waited 1 s for (it reports its end to the GCS that
    is already stopped).

    Why the node's registration is watched here: Ray asks the GCS for the new node once a
    second (``GlobalStateAccessor::GetNode``), and the raylet registers once its dashboard
    agent is up, 0.8-1.8 s after its start here, so ``ray.init`` waited for the next whole
    second: 1.0 s or 2.0 s in that call.  :func:`_get_node_once_registered` asks every
    0.1 s first (every 0.02 s slowed the registration itself on 2 cores).

    Why a free port for the agent: a head node's dashboard agent listens on 52365, and
    the agent of a Ray that ended abruptly (a killed driver or raylet) outlives it for up
    to a minute, still holding that port.  The next start's agent then retries the bind
    for 3.4 s before it gives up, and the raylet waits for it: measured here, ``ray.init``
    took 5.4-6.4 s instead of 2.2-2.5 s.  Ray's own ``Cluster`` gives its worker nodes'
    agents a free port for the same reason; the port is registered with the node, so
    whatever asks for it finds it.  A port other than the default is kept.

    Best effort, as :func:`yield_auxiliary_daemons` is: the node's start is private API,
    so another Ray version costs one debug line and starts as before.  The tests' private
    Ray and their multi-node clusters' heads start the same way (``tests/conftest.py``)."""
    from ray._private import node as ray_node
    from ray._private import services

    patches = _private_start_patches(ray_node.Node, services, worker_env or {})
    originals = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
    for owner, name, patch in patches:
        setattr(owner, name, patch)
    try:
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def _private_start_patches(
    node_class: type, services: ModuleType, worker_env: Mapping[str, str]
) -> List[Tuple[Any, str, Any]]:
    """(owner, attribute, replacement) for each part of Ray's start that this Ray has."""
    from ray._private import ray_constants

    patches: List[Tuple[Any, str, Any]] = []
    if "start_api_server" in node_class.__dict__:
        patches.append((node_class, "start_api_server", _skip_api_server))
    if "__init__" in node_class.__dict__:
        default_port = getattr(ray_constants, "DEFAULT_DASHBOARD_AGENT_LISTEN_PORT", None)
        init = _private_node_init(node_class.__dict__["__init__"], default_port, worker_env)
        patches.append((node_class, "__init__", init))
    if "get_node" in services.__dict__:
        get_node = _get_node_once_registered(services.__dict__["get_node"])
        patches.append((services, "get_node", get_node))
    if len(patches) < 3:
        log.debug("Ray's node lacks what is patched: part of its start is as before")
    return patches


def _private_node_init(
    original_init: Callable[..., None], default_port: Optional[int], worker_env: Mapping[str, str]
):
    """``Node.__init__`` starting no autoscaler monitor, the dashboard agent on a free
    port where it would take the default one, and the raylet with ``worker_env`` (Ray's
    ``RayParams.env_vars``, the raylet's environment; a variable already given there is
    kept)."""

    @functools.wraps(original_init)
    def init_private_node(self, ray_params, *args, **kwargs) -> None:
        ray_params.no_monitor = True
        if worker_env:
            ray_params.env_vars = {**worker_env, **(ray_params.env_vars or {})}
        if default_port is not None and ray_params.dashboard_agent_listen_port == default_port:
            ray_params.dashboard_agent_listen_port = None  # the node makes it 0: free
        original_init(self, ray_params, *args, **kwargs)

    return init_private_node


def _get_node_once_registered(original_get_node: Callable[[str, str], Any]):
    """``services.get_node`` that first asks the GCS every 0.1 s whether the node is
    registered, so that Ray's call finds it at its first ask.  A node still unregistered
    after 30 s raises the ``RuntimeError`` Ray's start loop turns into its own timeout
    (``raylet_start_wait_time_s``, 30 s); a GCS that cannot be asked leaves the wait to
    Ray's call, as before."""

    @functools.wraps(original_get_node)
    def get_node(gcs_address: str, node_id: str) -> Any:
        try:
            registered = _wait_for_registration(gcs_address, node_id, 30.0, period_s=0.1)
        except Exception as e:  # noqa: BLE001 - Ray's own wait follows and reports
            log.debug("waiting for the node's registration: %s", e)
        else:
            if not registered:
                raise RuntimeError(f"node {node_id} not registered with the GCS in 30 s")
        return original_get_node(gcs_address, node_id)

    return get_node


def _wait_for_registration(gcs_address: str, node_id: str, timeout_s: float, period_s: float):
    """Whether the GCS lists ``node_id`` alive within ``timeout_s``."""
    from ray._raylet import GcsClient, NodeID  # type: ignore[attr-defined]
    from ray.core.generated.gcs_pb2 import GcsNodeInfo
    from ray.core.generated.gcs_service_pb2 import GetAllNodeInfoRequest

    client = GcsClient(address=gcs_address)
    selector = GetAllNodeInfoRequest.NodeSelector(node_id=NodeID.from_hex(node_id).binary())
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        alive = client.get_all_node_info(
            timeout=min(left, 2.0),
            node_selectors=[selector],
            state_filter=GcsNodeInfo.GcsNodeState.ALIVE,
        )
        if alive:
            return True
        time.sleep(period_s)
    return False


def _skip_api_server(self, *, include_dashboard: Optional[bool], raise_on_failure: bool) -> None:
    """Stands in for ``Node.start_api_server``: the node keeps ``webui_url`` None, as after
    an API server that failed to start, which Ray tolerates when it was not asked for."""


def stop_private_ray() -> None:
    """Stop the private Ray :func:`connect_ray` started (it returned True).  It runs no
    autoscaler monitor (:func:`private_node_start`), the one process Ray's shutdown waited
    1 s for (measured here: shutdown 1.32 s with it, 0.32 s without)."""
    import ray

    ray.shutdown()


def _pin_local_ray_to_loopback() -> None:
    """Keep a private single-node Ray (and so gloo's rendezvous) on 127.0.0.1.

    Ray otherwise resolves its node address to the first external interface even
    with ``_node_ip_address``.  Its single-node switch is read from the
    environment when ``ray`` is imported, so it is set for the child processes
    and patched on the already-imported module.
    """
    from ray._private import ray_constants

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    if hasattr(ray_constants, "ENABLE_RAY_CLUSTER"):
        ray_constants.ENABLE_RAY_CLUSTER = False
