"""A storage filesystem on which one report's upload is slow: what a large checkpoint going
to a remote store looks like to the ranks (an upload still in flight when a fault comes).

It is the local filesystem (fsspec's, through pyarrow's ``FSSpecHandler``, as a user would
pass an fsspec store in ``RunConfig(storage_filesystem=...)``); picklable, so every rank
gets one."""

from __future__ import annotations

import time

import pyarrow.fs as pafs
from fsspec.implementations.local import LocalFileSystem


class SlowReportFileSystem(LocalFileSystem):
    """Writing a file of ``checkpoint_<slow_index>`` (whose path holds ``only``, when given)
    first sleeps ``delay_s``."""

    def __init__(self, slow_index: int, delay_s: float, only: str = "", **kwargs):
        super().__init__(**kwargs)
        self.slow_index, self.delay_s, self.only = slow_index, delay_s, only

    def open(self, path, mode="rb", **kwargs):
        slow = f"checkpoint_{self.slow_index:06d}/" in str(path) and self.only in str(path)
        if "w" in mode and slow:
            time.sleep(self.delay_s)
        return super().open(path, mode, **kwargs)


def slow_storage(slow_index: int, delay_s: float, only: str = "") -> pafs.FileSystem:
    return pafs.PyFileSystem(pafs.FSSpecHandler(SlowReportFileSystem(slow_index, delay_s, only)))
