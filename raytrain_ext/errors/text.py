"""What a user reads when a worker failed: one line, and the whole story in a log file.

Ray wraps a worker's exception in ``RayTaskError``, whose text is the remote traceback
with terminal colour codes.  The one line is the worker's own exception (type and the
first and last lines of its message, where our errors put the key and the fix), with
colour codes removed; the full text, also without colour codes, goes to a file.
"""

from __future__ import annotations

import re
import traceback
from typing import List, Optional

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
MAX_LINE = 600


def strip_ansi(text: str) -> str:
    return ANSI.sub("", text)


# What a collective raises when a peer vanished (an echo of another rank's failure).
PEER_LOSS_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "DistNetworkError",
    "AbandonedWait",  # rollout.waits: a wait on the rollout service, given up by a re-form
)


def is_peer_loss(error: BaseException) -> bool:
    """A collective that raised because a peer vanished (an echo of another rank's failure)."""
    return peer_loss_marker(error) is not None


def peer_loss_marker(error: BaseException) -> Optional[str]:
    """Which of ``PEER_LOSS_MARKERS`` the error carries (None: not a vanished peer)."""
    text = f"{type(root_cause(error)).__name__}: {error}"
    return next((marker for marker in PEER_LOSS_MARKERS if marker in text), None)


def root_cause(error: BaseException) -> BaseException:
    """The worker's own exception inside Ray's wrapper (``RayTaskError.cause``)."""
    seen = set()
    while id(error) not in seen:
        seen.add(id(error))
        inner = _ray_cause(error)
        if inner is None:
            break
        error = inner
    return error


def one_line(error: BaseException, with_type: bool = True) -> str:
    """``Type: first line ... last line`` of the root cause's message, without colour
    (``with_type=False``: the message alone, for a caller that names the type already)."""
    cause = root_cause(error)
    lines: List[str] = [
        line.strip() for line in strip_ansi(_own_message(cause)).splitlines() if line.strip()
    ]
    if not lines:
        text = ""
    elif len(lines) <= 2:
        text = " ".join(lines)
    else:
        text = f"{lines[0]} {lines[1]} ... {lines[-1]}"
    if with_type or not text:
        text = f"{type(cause).__name__}: {text}" if text else type(cause).__name__
    return text if len(text) <= MAX_LINE else text[: MAX_LINE - 3] + "..."


def full_text(error: BaseException) -> str:
    """The whole error as Python and Ray render it (remote traceback included), no colour."""
    rendered = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    return strip_ansi(rendered)


def _ray_cause(error: BaseException):
    from ray.exceptions import RayTaskError

    if isinstance(error, RayTaskError):
        cause = error.cause
        return cause if isinstance(cause, BaseException) and cause is not error else None
    return None


def _own_message(error: BaseException) -> str:
    """The exception's message without the remote traceback Ray may have folded into it."""
    text = str(error.args[0]) if error.args and isinstance(error.args[0], str) else str(error)
    return text.split("\n\nTraceback (most recent call last)")[0]
