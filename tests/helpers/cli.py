"""Running the real ``raytrain-ext`` command in a subprocess, as a user would."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

AWS_KEYS = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
)


def clean_env(**extra):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **extra}
    env.pop("RAY_ADDRESS", None)
    return env


def without_aws_credentials(env: dict) -> dict:
    """No credentials anywhere boto3 looks (and no instance-metadata probing)."""
    env = {k: v for k, v in env.items() if k not in AWS_KEYS}
    env.update(
        {
            "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
            "AWS_CONFIG_FILE": "/nonexistent",
            "AWS_EC2_METADATA_DISABLED": "true",
        }
    )
    return env


def raytrain_ext_cmd():
    exe = Path(sys.executable).with_name("raytrain-ext")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "raytrain_ext"]


def run(cmd, cwd, env=None, timeout=300):
    return subprocess.run(
        cmd, cwd=cwd, env=env or clean_env(), capture_output=True, text=True, timeout=timeout
    )


class RaySessionWatch:
    """A private Ray temp dir (``RAY_TMPDIR``) for one command: a Ray session started by
    it leaves ``session_*`` there, so an empty directory proves Ray never started.
    Short path: Ray's socket paths must fit in 107 bytes."""

    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="rtx-"))

    def env(self, base=None):
        return {**(base or clean_env()), "RAY_TMPDIR": str(self.dir)}

    def sessions(self):
        return sorted(p.name for p in self.dir.rglob("session_*"))
