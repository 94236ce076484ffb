"""Shared fixtures. Ray, gloo and servers stay on loopback (see FIELD_NOTES)."""

import os

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
    from tests.helpers.layouts import train

    tmp = tmp_path_factory.mktemp("ddp-layout-reference")
    return {"ranks": train(2, tmp), "ckpt": tmp / "ckpt"}
