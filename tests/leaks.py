"""What a finished run may not leave behind: live worker actors, placement groups, processes."""

import time

import psutil


def live_worker_actors():
    from ray._private.state import actors

    return [a for a in actors().values()
            if a["ActorClassName"].endswith("TrainWorker") and a["State"] != "DEAD"]


def live_placement_groups():
    from ray.util import placement_group_table

    return [pg for pg in placement_group_table().values() if pg["state"] != "REMOVED"]


def worker_processes():
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if "ray::TrainWorker" in cmd:
            found.append(proc.pid)
    return found


def assert_nothing_left(timeout_s: float = 15.0) -> None:
    deadline = time.time() + timeout_s
    while True:
        left = (live_worker_actors(), live_placement_groups(), worker_processes())
        if not any(left) or time.time() > deadline:
            break
        time.sleep(0.25)
    assert left == ([], [], []), f"left behind (actors, placement groups, pids): {left}"
