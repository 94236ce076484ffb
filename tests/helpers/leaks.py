"""What a finished run may not leave behind: live worker actors, placement groups, processes."""

import time

import psutil


def live_worker_actors():
    from ray._private.state import actors

    return [
        a
        for a in actors().values()
        if a["ActorClassName"].endswith("TrainWorker") and a["State"] != "DEAD"
    ]


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


def describe(pid: int) -> str:
    """What a left-behind process is doing: its state (``disk-sleep``: a SIGKILL waits for
    I/O to finish), age and parent."""
    try:
        proc = psutil.Process(pid)
        parent = proc.parent()
        return (
            f"pid {pid} {proc.status()}, {time.time() - proc.create_time():.0f} s old, "
            f"parent {' '.join(parent.cmdline()[:1]) if parent else None}"
        )
    except psutil.Error as e:
        return f"pid {pid}: {type(e).__name__}"


def assert_nothing_left(timeout_s: float = 30.0) -> None:
    """Every worker actor dead, every placement group removed and every worker process gone
    within ``timeout_s`` (a killed process may first finish a write on a loaded disk)."""
    deadline = time.time() + timeout_s
    while True:
        left = (live_worker_actors(), live_placement_groups(), worker_processes())
        if not any(left) or time.time() > deadline:
            break
        time.sleep(0.25)
    assert left == ([], [], []), (
        f"left behind (actors, placement groups, pids): {left}; "
        + "; ".join(describe(pid) for pid in left[2])
    )


def idle_processes_with_torch() -> set:
    """Ray's idle worker processes on this machine that have torch loaded."""
    found = set()
    for proc in psutil.process_iter(["cmdline"]):
        if "ray::IDLE" not in " ".join(proc.info["cmdline"] or []):
            continue
        try:
            if any("libtorch_cpu" in m.path for m in proc.memory_maps()):
                found.add(proc.pid)
        except psutil.Error:
            continue  # gone meanwhile
    return found
