"""Shared fixtures. Ray, gloo and servers stay on loopback (see FIELD_NOTES)."""

import faulthandler
import os
import sys
import threading
import time
from pathlib import Path

# Must be set before ray is imported: Ray then resolves its own address to 127.0.0.1.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import pytest  # noqa: E402


@pytest.fixture()
def ray_local():
    """A single-node Ray (4 logical CPUs on 2 cores), started once and reused.

    Multi-node tests shut it down to connect to their own cluster; the next test
    that needs it starts it again.  ``address="local"`` keeps it private even
    when another Ray instance (a ``ray start`` head) runs on this machine.
    """
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local",
            num_cpus=4,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            object_store_memory=200 * 1024**2,
            log_to_driver=False,
        )
    yield ray


@pytest.fixture()
def ray_cluster():
    """A real multi-node Ray cluster on this machine: a CPU-less head and nodes the test adds.

    Health checks are tightened (before the head starts) so a removed node is
    declared dead in about 2 s instead of about 14 s.
    """
    import ray
    from ray.cluster_utils import Cluster

    ray.shutdown()
    fast = {
        "RAY_health_check_period_ms": "500",
        "RAY_health_check_timeout_ms": "500",
        "RAY_health_check_failure_threshold": "3",
    }
    saved = {k: os.environ.get(k) for k in fast}
    os.environ.update(fast)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "object_store_memory": 150 * 1024**2,
            "include_dashboard": False,
            "node_ip_address": "127.0.0.1",
        },
    )
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        _tear_down(cluster, saved)


def _tear_down(cluster, saved_env: dict) -> None:
    """Every step runs even when one fails (a node that died on its own, a zombie), so a
    failed test leaves no cluster, driver or environment behind for the next one."""
    import ray

    errors = []
    for step in (ray.shutdown, cluster.shutdown):
        try:
            step()
        except Exception as e:
            errors.append(e)
    for node in [*cluster.worker_nodes, *([cluster.head_node] if cluster.head_node else [])]:
        try:
            node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)
        except Exception as e:
            errors.append(e)
    # what Cluster.shutdown does last, in case it stopped before: forget the dead cluster
    ray.experimental.internal_kv._internal_kv_reset()
    ray._common.utils.reset_ray_address()
    ray._private.services.find_gcs_addresses.cache_clear()
    for key, value in saved_env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    if errors:
        raise RuntimeError(f"tearing the cluster down: {errors!r}")


# The packaged default's model at half its width and sequence length, for tests that need
# many steps but no time between them (chaos tests on Ray keep the default model: their
# faults are injected between steps, which must not be over before the fault lands).
FAST_MODEL = ["model.n_layers=2", "model.d_model=64", "model.n_heads=2", "model.seq_len=64"]


def tiny_overrides(tmp_path, *extra):
    """The packaged default, shortened for tests, writing under tmp_path."""
    return [
        f"run.output_dir={tmp_path}",
        "run.max_steps=6",
        "run.log_every=2",
        "run.tensorboard=false",
        *extra,
    ]


@pytest.fixture(scope="session")
def aws_env():
    """Dummy credentials for the local S3 server (never real ones)."""
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        os.environ.setdefault(key, value)


@pytest.fixture(scope="session")
def s3_endpoint(aws_env):
    """moto's standalone S3 server on loopback, spoken to through real boto3/pyarrow HTTP calls."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture(scope="session")
def ddp_layout_reference(tmp_path_factory):
    """The 2-rank DDP run (with its checkpoints) that test_fsdp_tp and test_pp compare every
    parallel layout with: trained once per session."""
    from tests.test_fsdp_tp import train

    tmp = tmp_path_factory.mktemp("ddp-layout-reference")
    return {"ranks": train(2, tmp), "ckpt": tmp / "ckpt"}


def wait_for_checkpoint(
    directory: Path, min_step: int, timeout_s: float = 120.0, while_running=None
) -> int:
    """Block until a committed checkpoint of step >= ``min_step`` is in ``directory``; its step.

    Not one exact step: with ``checkpoint.on_busy=skip`` (the default) a save that falls
    due while the previous one is still persisting is skipped, which a loaded machine does
    now and then.  ``while_running``: a ``Popen`` that must still run (to be interrupted).
    """
    from raytrain_ext.checkpoint.disk import DiskTier

    tier = DiskTier(directory)
    deadline = time.time() + timeout_s
    while time.time() < deadline and (while_running is None or while_running.poll() is None):
        steps = tier.committed_steps()
        if steps and steps[-1] >= min_step:
            return steps[-1]
        time.sleep(0.02)
    raise AssertionError(
        f"no checkpoint of step >= {min_step} in {directory} within "
        f"{timeout_s:.0f} s" + (" while the run ran" if while_running else "")
    )


class FitThread:
    """``trainer.fit()`` in a thread, for tests that inject faults while it runs.

    A test cannot leave the run behind: leaving the ``with`` block (an assertion
    failed, or the run outlived the timeout of ``join``/``summary``) stops the
    trainer and joins its thread, so a cluster fixture never tears Ray down under
    a live run.
    """

    def __init__(self, trainer):
        self.trainer = trainer
        self.outcome: list = []
        self.thread = threading.Thread(target=self._fit, daemon=True, name="fit")

    def _fit(self) -> None:
        try:
            self.outcome.append(self.trainer.fit())
        except Exception as e:
            self.outcome.append(e)

    def __enter__(self) -> "FitThread":
        self.thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        if self.thread.is_alive():
            self.trainer.stop("the test ended before the run")
            self.thread.join(timeout=120)

    def join(self, timeout_s: float):
        """The run's summary, or the exception that ended it."""
        self.thread.join(timeout=timeout_s)
        if self.thread.is_alive():
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            raise AssertionError(
                f"the run was still going after {timeout_s:.0f} s "
                "(every thread's stack is on stderr)"
            )
        (outcome,) = self.outcome
        return outcome

    def summary(self, timeout_s: float) -> dict:
        """The summary of a run that must finish."""
        outcome = self.join(timeout_s)
        assert isinstance(outcome, dict), f"the run failed: {outcome!r}"
        return outcome
