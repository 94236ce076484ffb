"""A worker thread that ends with an exception is reported in one line, not a traceback
on the driver's console (Ray forwards a worker's stderr there).

DCP's writer threads (``_write_files_from_queue``) fail together when a disk fills up,
each printing its traceback; their error also reaches the save that started them, which
says what happened in one line (:mod:`raytrain_ext.checkpoint.save_failure`), so theirs
go to the debug log.  Any other thread's exception is one ERROR line, its traceback at
debug.
"""

from __future__ import annotations

import logging
import threading

from raytrain_ext.errors.text import one_line

log = logging.getLogger(__name__)
REPORTED_BY_THEIR_CALLER = ("_write_files_from_queue",)


def report_thread_errors_in_one_line() -> None:
    threading.excepthook = _one_line


def _one_line(args: threading.ExceptHookArgs) -> None:
    name = args.thread.name if args.thread is not None else "?"
    error = args.exc_value
    if any(part in name for part in REPORTED_BY_THEIR_CALLER):
        log.debug("thread %s raised", name, exc_info=error)
        return
    what = args.exc_type.__name__ if error is None else one_line(error)
    log.error("thread %s raised %s", name, what)
    log.debug("thread %s raised", name, exc_info=error)
