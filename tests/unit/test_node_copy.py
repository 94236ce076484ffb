"""One local copy per node of a held report (``user_loop.node_copy``): the node's ranks
(processes here) write it once and share it, and the last live one removes it."""

import multiprocessing
import os
import subprocess
import sys
import time

import pytest

from raytrain_ext.user_loop.node_copy import NodeCopy


def write_report(target: str, log: str) -> None:
    """A slow write (so the other process waits on the lock), counted in ``log``."""
    with open(log, "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(0.2)
    with open(os.path.join(target, "state.pt"), "w") as f:
        f.write("weights")


def take_and_read(root: str, log: str, out) -> None:
    directory = NodeCopy(root, "g1").take(lambda target: write_report(target, log))
    with open(os.path.join(directory, "state.pt")) as f:
        out.put((directory, f.read()))


def dead_pid() -> int:
    """The pid of a process that has ended."""
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True
    )
    return int(done.stdout)


def test_two_ranks_of_a_node_write_one_copy_and_the_last_user_removes_it(tmp_path):
    root, log = str(tmp_path / "held"), str(tmp_path / "writes")
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    ranks = [context.Process(target=take_and_read, args=(root, log, out)) for _ in range(2)]
    for rank in ranks:
        rank.start()
    seen = [out.get(timeout=30) for _ in ranks]
    for rank in ranks:
        rank.join(timeout=30)
    assert seen == [(os.path.join(root, "g1"), "weights")] * 2
    assert len(open(log).read().split()) == 1  # written once, by the first to take the lock
    # both users' processes have ended: the next release (this process's) removes the copy
    mine = NodeCopy(root, "g1")
    assert mine.take(lambda target: pytest.fail("the copy is there")) == seen[0][0]
    mine.release()
    assert os.listdir(root) == [".lock"]


def test_a_failed_write_leaves_no_copy_and_the_nodes_other_ranks_give_up_at_once(tmp_path):
    root = str(tmp_path / "held")

    def unreadable(target: str) -> None:
        with open(os.path.join(target, "half.pt"), "w") as f:
            f.write("half")
        raise OSError("the holder's node is gone")

    with pytest.raises(OSError, match="node is gone"):
        NodeCopy(root, "g2").take(unreadable)
    assert sorted(os.listdir(root)) == [".lock", "g2.failed"]  # no copy, no half of one
    with pytest.raises(OSError, match="another rank of this node could not read g2"):
        NodeCopy(root, "g2").take(lambda target: pytest.fail("not read again"))


def test_a_live_user_keeps_the_copy_and_what_dead_processes_left_is_swept(tmp_path):
    root = str(tmp_path / "held")
    copy = NodeCopy(root, "g3")
    directory = copy.take(lambda target: None)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        open(os.path.join(root, "g3.users", str(other.pid)), "w").close()  # a live user
        copy.release()
        assert os.path.isdir(directory)
    finally:
        other.kill()
        other.wait()
    # that user was killed without releasing, and so was a writer of the next group: the
    # next group's first take removes both
    os.makedirs(os.path.join(root, f"g4.partial-{dead_pid()}"))
    later = NodeCopy(root, "g5")
    later.take(lambda target: None)
    assert sorted(os.listdir(root)) == [".lock", "g5", "g5.users"]
    later.release()
    assert os.listdir(root) == [".lock"]
