"""A worker process ends once the raylet that started it is gone (no Ray needed to show it:
the "raylet" here is a plain parent process, killed with SIGKILL)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil

WORKER = textwrap.dedent(
    """
    import os, signal, sys, time
    from raytrain_ext.worker.actor import exit_when_orphaned
    signal.signal(signal.SIGTERM, lambda *_: None)  # as a worker's preemption handler does
    exit_when_orphaned(os.getppid(), period_s=0.1)
    print("ready", flush=True)
    time.sleep(600)
    """
)
PARENT = textwrap.dedent(
    """
    import subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    print(child.pid, flush=True)
    import time; time.sleep(600)
    """
)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_worker_whose_parent_dies_exits_even_though_it_ignores_sigterm():
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, WORKER], stdout=subprocess.PIPE, text=True
    )
    try:
        worker = int(parent.stdout.readline())
        time.sleep(0.3)
        assert not gone(worker)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.time() + 10
        while not gone(worker) and time.time() < deadline:
            time.sleep(0.05)
        assert gone(worker), "the orphaned worker kept running"
    finally:
        parent.kill()
