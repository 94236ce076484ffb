"""Storage that takes a while to take each checkpoint, as a large model going to a remote
store does (``ray_train_loop.py --scenario kill-slow-storage``).

Its own module, not the bench script: the ranks unpickle the filesystem by reference
(Ray puts the driver script's folder on their path), and fsspec's cached-instance classes
do not pickle by value from ``__main__``."""

from __future__ import annotations

import time

import pyarrow.fs as pafs
from fsspec.implementations.local import LocalFileSystem


class SlowStorage(LocalFileSystem):
    """The local filesystem, on which writing a checkpoint's ``state.pt`` first takes
    ``delay_s``."""

    def __init__(self, delay_s: float, **kwargs):
        super().__init__(**kwargs)
        self.delay_s = delay_s

    def open(self, path, mode="rb", **kwargs):
        if "w" in mode and str(path).endswith("state.pt"):
            time.sleep(self.delay_s)
        return super().open(path, mode, **kwargs)


def slow_storage(delay_s: float) -> pafs.FileSystem:
    return pafs.PyFileSystem(pafs.FSSpecHandler(SlowStorage(delay_s)))
