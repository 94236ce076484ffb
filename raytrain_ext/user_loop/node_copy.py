"""One local copy per node of the held report a group starts from, shared by the node's ranks.

Why: ``get_checkpoint()`` of a group that starts from a report held in the memory tier names
a local directory with the report's files.  Written once per process, a node of 8 ranks
would read the report from the object store 8 times and keep 8 copies on its disk; the
node's ranks share one instead, as they would share a directory on a shared filesystem
under Ray Train.

How: the copy is ``<root>/<group>`` (the group that starts from it, so a later group never
meets a half-written or older copy).  Under an exclusive ``flock`` on ``<root>/.lock`` (one
per run and node: one group starts at a time) the first rank writes it into a private
directory and renames it into place; the others find it there.  Each rank that uses it
leaves ``<root>/<group>.users/<pid>``; releasing removes that, and the last live user
removes the copy (a user's process that died is not counted: its pid is gone).  The lock
file stays (empty): removing it could let a rank that waits on it and a later one hold two
different locks.

Invariants: a rank sees the copy only once it is complete (the rename); a rank whose write
fails leaves nothing behind, and the next rank tries again itself; the copy is removed only
when no live process of the node uses it.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from contextlib import contextmanager
from typing import Any, Callable, Iterator


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class NodeCopy:
    """This process's use of its node's copy for group ``group`` under ``root``."""

    def __init__(self, root: str, group: str):
        self.directory = os.path.join(root, group)
        self._lock = os.path.join(root, ".lock")
        self._users = os.path.join(root, f"{group}.users")
        self._mine = os.path.join(self._users, str(os.getpid()))

    @contextmanager
    def _locked(self) -> Iterator[None]:
        os.makedirs(self._users, exist_ok=True)
        with open(self._lock, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or its process dies
            yield

    def take(self, write: Callable[[str], Any]) -> str:
        """The copy's directory, written by ``write(directory)`` if no rank of the node has
        written it yet; raises what ``write`` raised (nothing is then left behind)."""
        with self._locked():
            if not os.path.isdir(self.directory):
                partial = f"{self.directory}.partial-{os.getpid()}"
                shutil.rmtree(partial, ignore_errors=True)
                try:
                    write(partial)
                    os.rename(partial, self.directory)
                except BaseException:
                    shutil.rmtree(partial, ignore_errors=True)
                    raise
            open(self._mine, "w").close()
        return self.directory

    def release(self) -> None:
        """This process no longer uses the copy; the last live user removes it."""
        if not os.path.isdir(self._users):
            return
        with self._locked():
            if os.path.exists(self._mine):
                os.remove(self._mine)
            if any(_alive(int(pid)) for pid in os.listdir(self._users)):
                return
            shutil.rmtree(self.directory, ignore_errors=True)
            shutil.rmtree(self._users, ignore_errors=True)
