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
    """Writing a file of ``checkpoint_<slow_index>`` first sleeps ``delay_s``."""

    def __init__(self, slow_index: int, delay_s: float, **kwargs):
        super().__init__(**kwargs)
        self.slow_index, self.delay_s = slow_index, delay_s

    def open(self, path, mode="rb", **kwargs):
        if "w" in mode and f"checkpoint_{self.slow_index:06d}/" in str(path):
            time.sleep(self.delay_s)
        return super().open(path, mode, **kwargs)


def slow_storage(slow_index: int, delay_s: float) -> pafs.FileSystem:
    return pafs.PyFileSystem(pafs.FSSpecHandler(SlowReportFileSystem(slow_index, delay_s)))
