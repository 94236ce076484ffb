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
    os.makedirs(target)
    time.sleep(0.2)
    with open(os.path.join(target, "state.pt"), "w") as f:
        f.write("weights")


def take_and_read(root: str, log: str, out) -> None:
    directory = NodeCopy(root, "g1").take(lambda target: write_report(target, log))
    with open(os.path.join(directory, "state.pt")) as f:
        out.put((directory, f.read()))


def test_two_ranks_of_a_node_write_one_copy_and_the_last_user_removes_it(tmp_path):
    root, log = str(tmp_path / "held"), str(tmp_path / "writes")
    context = multiprocessing.get_context("fork")
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
    assert not os.path.exists(seen[0][0])
    assert os.listdir(root) == [".lock"]


def test_a_live_user_keeps_the_copy_and_a_failed_write_leaves_nothing(tmp_path):
    root = str(tmp_path / "held")
    failing = NodeCopy(root, "g2")

    def unreadable(target: str) -> None:
        os.makedirs(target)
        raise OSError("the holder's node is gone")

    with pytest.raises(OSError, match="node is gone"):
        failing.take(unreadable)
    assert sorted(os.listdir(root)) == [".lock", "g2.users"]  # no copy, no half of one
    copy = NodeCopy(root, "g2")
    directory = copy.take(lambda target: os.makedirs(target))  # the next rank tries itself
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        open(os.path.join(root, "g2.users", str(other.pid)), "w").close()  # a live user
        copy.release()
        assert os.path.isdir(directory)
    finally:
        other.kill()
        other.wait()
    NodeCopy(root, "g2").release()  # that user died without releasing: not counted
    assert not os.path.exists(directory)
