"""Shared fixtures. Ray, gloo and servers stay on loopback (see FIELD_NOTES)."""

import os

# Must be set before ray is imported: Ray then resolves its own address to 127.0.0.1.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def ray_local():
    """One single-node Ray for the tests that need it (4 logical CPUs on 2 cores)."""
    import ray

    ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1",
             object_store_memory=200 * 1024**2, log_to_driver=False)
    yield ray
    ray.shutdown()


def tiny_overrides(tmp_path, *extra):
    """The packaged default, shortened for tests, writing under tmp_path."""
    return [f"run.output_dir={tmp_path}", "run.max_steps=6", "run.log_every=2",
            "run.tensorboard=false", *extra]


@pytest.fixture(scope="session")
def aws_env():
    """Dummy credentials for the local S3 server (never real ones)."""
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():
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
