"""The driver's connection to Ray: a cluster's address, or a private single-node Ray.

Its own module because every command that runs on Ray connects the same way (``train``,
``data prepare``, ``doctor``, the benches); with it in ``trainer.py``, the data pipeline
imported the trainer and the trainer the data pipeline.
"""

from __future__ import annotations

import logging
import os
import subprocess
from typing import Optional

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
    ray.init(
        address="local",
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        _system_config={"prestart_worker_first_driver": False},
    )
    yield_auxiliary_daemons()
    return True


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
