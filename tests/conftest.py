"""Shared fixtures. Ray, gloo and servers stay on loopback (see FIELD_NOTES)."""

import os
import tempfile
import time

# Must be set before ray is imported: Ray then resolves its own address to 127.0.0.1.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# DeepSpeed keeps the accelerator it finds when first imported (in the multi-process tier's
# fork server, ``helpers.rank_imports``): the CPU one, whatever this machine has.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# Ray Train, the peer some tests compare results with, polls its workers every 2 s by
# default and each report waits for a poll; its results do not depend on the pace (10 s
# of the quick-start comparison's 50 s here).  Read by its controller, a Ray worker that
# inherits the environment of the process that started Ray.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
# The driver's cache of checked Hugging Face configs (models.hf_shape_cache): this session's
# own, so that the tests neither write into the home directory nor read what other runs wrote.
os.environ.setdefault("RAYTRAIN_EXT_CACHE_DIR", tempfile.mkdtemp(prefix="raytrain-ext-cache-"))

import pytest  # noqa: E402


@pytest.fixture()
def ray_local():
    """A single-node Ray (4 logical CPUs on 2 cores), started once and reused.

    Multi-node tests shut it down to connect to their own cluster; the next test
    that needs it starts it again.  ``address="local"`` keeps it private even
    when another Ray instance (a ``ray start`` head) runs on this machine.
    """
    import ray

    from raytrain_ext.ray_session import SOCKET_RETRY_CONFIG, private_node_start

    if not ray.is_initialized():
        with private_node_start():  # as the CLI's private Ray: 1-2 s less per start
            ray.init(
                address="local",
                num_cpus=4,
                include_dashboard=False,
                _node_ip_address="127.0.0.1",
                object_store_memory=200 * 1024**2,
                log_to_driver=False,
                _system_config=SOCKET_RETRY_CONFIG,
            )
    yield ray


@pytest.fixture()
def ray_cluster():
    """A real multi-node Ray cluster on this machine: a CPU-less head and nodes the test adds.

    Health checks are tightened (before the head starts) so a removed node is
    declared dead in about 3 s instead of about 14 s: a check every 0.5 s, 6 missed in a
    row (3 missed had a loaded raylet declared dead in CI, before any test removed a node).
    Every node retries its local sockets as the CLI's private Ray does (``ray_session``),
    so a node's start is not 1 s longer for a missed first try.  The head runs no
    autoscaler monitor: nothing here scales, drain requests go to the GCS, and Ray's
    teardown waits 1 s for a monitor it stops after the GCS.
    """
    import ray
    from ray.cluster_utils import Cluster

    from raytrain_ext.ray_session import SOCKET_RETRY_CONFIG, private_node_start

    ray.shutdown()
    fast = {
        "RAY_health_check_period_ms": "500",
        "RAY_health_check_timeout_ms": "500",
        "RAY_health_check_failure_threshold": "6",
    }
    saved = {k: os.environ.get(k) for k in fast}
    os.environ.update(fast)
    with private_node_start():  # the head's start: 1-2 s less (see ray_session)
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 0,
                "object_store_memory": 150 * 1024**2,
                "include_dashboard": False,
                "node_ip_address": "127.0.0.1",
                "no_monitor": True,
                "_system_config": SOCKET_RETRY_CONFIG,  # the nodes that join get it too
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


# ---- the ladder: tiers run cheapest first, and the unit tier gates the rest -------------------
TIERS = ("unit", "multiprocess", "ray", "cluster")
UNIT_BUDGET_S = 60.0
_unit = {"failed": 0, "started": None, "ended": None}


def tier_of(item) -> str:
    """The tier folder a test lives in (``tests/<tier>/...``); others run last."""
    parts = item.nodeid.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else ""


def _tier_rank(item) -> int:
    tier = tier_of(item)
    return TIERS.index(tier) if tier in TIERS else len(TIERS)


def pytest_collection_modifyitems(session, config, items):
    """Unit -> multiprocess -> single-node Ray -> multi-node Ray (stable within a tier, so a
    module's tests stay together)."""
    items.sort(key=_tier_rank)


def pytest_runtest_setup(item):
    """The first test above the unit tier does not start while a unit test has failed: the
    unit tier is the gate that costs seconds, the rest costs minutes."""
    if tier_of(item) == "unit":
        if _unit["started"] is None:
            _unit["started"] = time.monotonic()
        return
    if _unit["failed"]:
        pytest.exit(f"{_unit['failed']} unit test(s) failed: the slower tiers did not run", 1)


def pytest_runtest_logreport(report):
    if not report.nodeid.startswith("tests/unit/"):
        return
    _unit["ended"] = time.monotonic()
    _unit["failed"] += report.failed


def pytest_terminal_summary(terminalreporter):
    """The unit tier's own time, against its budget (``pytest tests/unit`` under 60 s)."""
    if _unit["started"] is None or _unit["ended"] is None:
        return
    took = _unit["ended"] - _unit["started"]
    over = " OVER BUDGET" if took > UNIT_BUDGET_S else ""
    terminalreporter.write_line(f"unit tier: {took:.1f} s (budget {UNIT_BUDGET_S:.0f} s){over}")
