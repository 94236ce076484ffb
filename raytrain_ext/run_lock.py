"""One writer per run directory: a second start of a run that is training is refused.

Two ``fit()`` calls of the same ``run.output_dir``/``run.name`` would write one set of
checkpoints and records from two groups.  The driver holds an exclusive ``flock`` on
``<run>/.lock`` from its attempt's start to its end.  The kernel drops the lock with the
process (also a SIGKILL or an OOM kill), so a lock that can be taken is provably not
held: no timer, no pid guessing, no pid reuse to confuse.  The file's text (host, pid,
attempt, since when) is only for the messages: a start refused names the attempt that
runs; a start that finds the text of a holder that did not end cleanly (it was killed)
takes the lock over and says so.  On a shared filesystem Linux's NFS client maps
``flock`` to a lock the server sees, so a driver on another machine is refused too.

The descriptor is not inherited (Python opens files close-on-exec), so a Ray started by
the driver does not keep the lock after the driver ends.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Dict, Optional

from raytrain_ext.errors import InputError

LOCK = ".lock"
log = logging.getLogger(__name__)


class RunInUse(InputError):
    """The run is training in another process (this one or another machine's)."""


class RunLock:
    """The exclusive right to write one run directory's attempts and checkpoints."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.path = self.root / LOCK
        self._fd: Optional[int] = None

    def acquire(self) -> None:
        """Take the lock or raise :class:`RunInUse` naming the holder."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder_text(_read(fd))
            os.close(fd)
            raise RunInUse(
                f"run.name: run {self.root.name} is already training in {self.root} "
                f"({holder}). Two runs must not write one run directory: wait for it to end "
                "or stop it, or start this one with another run.name (or run.output_dir)."
            ) from None
        stale = _read(fd)
        if stale:
            log.warning(
                "run %s: took over the lock of %s, which ended without releasing it (killed);"
                " no process holds it now",
                self.root.name,
                _holder_text(stale),
            )
        self._fd = fd
        self.record(attempt=None)

    def record(self, attempt: Optional[int]) -> None:
        """Write this holder's text (the attempt, once it has a number)."""
        assert self._fd is not None, "record() needs the lock"
        mine = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "attempt": attempt,
            "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        }
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, json.dumps(mine).encode(), 0)

    def release(self) -> None:
        """Clear the holder's text, then the lock (the file stays: deleting it would let a
        waiter lock a name another process is about to create anew)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
        finally:
            os.close(fd)


def _read(fd: int) -> Dict:
    raw = os.pread(fd, 4096, 0)
    try:
        return json.loads(raw) if raw.strip() else {}
    except ValueError:
        return {"text": raw.decode(errors="replace")[:200]}


def _holder_text(holder: Dict) -> str:
    if not holder:
        return "holder unknown"
    if "pid" not in holder:
        return f"lock text {holder.get('text', '')!r}"
    return (
        f"attempt {holder.get('attempt')}: host {holder.get('host')}, pid {holder['pid']}, "
        f"since {holder.get('since')}"
    )
