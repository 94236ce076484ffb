"""The driver's connection to Ray: a cluster's address, or a private single-node Ray.

Its own module because every command that runs on Ray connects the same way (``train``,
``data prepare``, ``doctor``, the benches); with it in ``trainer.py``, the data pipeline
imported the trainer and the trainer the data pipeline.
"""

from __future__ import annotations

import functools
import logging
import os
import subprocess
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, Optional

from raytrain_ext.worker.priority import yield_auxiliary_daemons

log = logging.getLogger(__name__)


def connect_ray(address: Optional[str]) -> bool:
    """Attach to Ray; returns True when this call started a local instance."""
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return False
    _pin_local_ray_to_loopback()
    with private_node_start():
        ray.init(
            address="local",
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            _system_config={"prestart_worker_first_driver": False},
        )
    yield_auxiliary_daemons()
    return True


@contextmanager
def private_node_start() -> Iterator[None]:
    """Start a private Ray without its dashboard API server, its dashboard agent listening
    on a free port.

    Why no API server: with ``include_dashboard=False`` Ray still starts that process,
    loading only its usage-stats module, and ``ray.init`` waits for it to register before
    it even starts the raylet: 1.0-1.7 s of every cold start measured here (``ray.init``
    median 3.3 s with it, 1.7 s without, five runs each).  A private Ray serves this
    process only: no job submission, dashboard or state API goes through that server (none
    is loaded when the dashboard is off), so nothing of ours or the user's needs it.

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
    from ray._private import ray_constants

    patches: Dict[str, Callable[..., None]] = {"start_api_server": _skip_api_server}
    original_init = ray_node.Node.__dict__.get("__init__")
    default_port = getattr(ray_constants, "DEFAULT_DASHBOARD_AGENT_LISTEN_PORT", None)
    if original_init is not None and default_port is not None:

        @functools.wraps(original_init)
        def init_on_a_free_agent_port(self, ray_params, *args, **kwargs):
            if ray_params.dashboard_agent_listen_port == default_port:
                ray_params.dashboard_agent_listen_port = None  # the node makes it 0: free
            original_init(self, ray_params, *args, **kwargs)

        patches["__init__"] = init_on_a_free_agent_port
    originals = {name: ray_node.Node.__dict__.get(name) for name in patches}
    for name in [name for name, original in originals.items() if original is None]:
        log.debug("Ray's node has no %s: that part of its start is as before", name)
        del patches[name], originals[name]
    for name, patch in patches.items():
        setattr(ray_node.Node, name, patch)
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(ray_node.Node, name, original)


def _skip_api_server(self, *, include_dashboard: Optional[bool], raise_on_failure: bool) -> None:
    """Stands in for ``Node.start_api_server``: the node keeps ``webui_url`` None, as after
    an API server that failed to start, which Ray tolerates when it was not asked for."""


def stop_private_ray() -> None:
    """Stop the private Ray :func:`connect_ray` started (it returned True).

    Why the autoscaler's monitor goes first, by SIGKILL: ``ray.shutdown`` stops the raylet
    and the GCS before it, and the monitor answers SIGTERM by reporting its own failure to
    the GCS that is already gone, so Ray waits out its 1 s grace before killing it
    (measured here: shutdown 1.32 s, 0.32 s without that wait).  On a private single-node
    Ray the monitor scales nothing and holds no state.  Best effort, as
    :func:`yield_auxiliary_daemons` is: Ray's node handle is private API."""
    import ray

    _kill_autoscaler_monitor()
    ray.shutdown()


def _kill_autoscaler_monitor() -> None:
    try:
        from ray._private import worker as ray_worker

        monitors = ray_worker._global_node.all_processes.get("monitor", [])
        for info in monitors:
            info.process.kill()
            info.process.wait(timeout=5)
    except (AttributeError, OSError, subprocess.TimeoutExpired) as e:
        log.debug("the autoscaler monitor is left to ray.shutdown: %s", e)


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
