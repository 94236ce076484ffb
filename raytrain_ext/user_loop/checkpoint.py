"""``Checkpoint``: a directory of the user's files, local or in storage (Ray Train's own
semantics: ``from_directory``, ``to_directory``, ``as_directory``, ``path``, ``filesystem``).

A checkpoint handed to ``report`` is staged before ``report`` returns (its files
hard-linked, ``staging``): the user may delete the directory next, but a file rewritten in
place before its upload ends makes that checkpoint not kept; one returned by ``get_checkpoint`` or in a
``Result`` names persisted storage and is read through its ``filesystem``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Iterator, Optional

import pyarrow.fs as pafs


class Checkpoint:
    """``path`` on ``filesystem`` (None: the local filesystem)."""

    def __init__(self, path: str, filesystem: Optional[pafs.FileSystem] = None):
        self.path = str(path)
        self.filesystem = filesystem or pafs.LocalFileSystem()

    @classmethod
    def from_directory(cls, path: str | os.PathLike) -> "Checkpoint":
        """A local directory as a checkpoint (``report`` stages it at once)."""
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise ValueError(f"Checkpoint.from_directory: {path!r} is not a directory")
        return cls(os.path.abspath(path))

    @property
    def is_local(self) -> bool:
        return isinstance(self.filesystem, pafs.LocalFileSystem)

    def to_directory(self, path: Optional[str | os.PathLike] = None) -> str:
        """Copy the checkpoint's files into ``path`` (a new temporary directory when None)
        and return it."""
        target = os.fspath(path) if path is not None else tempfile.mkdtemp(prefix="ckpt-")
        os.makedirs(target, exist_ok=True)
        if self.is_local:
            shutil.copytree(self.path, target, dirs_exist_ok=True)
        else:
            pafs.copy_files(
                self.path,
                target,
                source_filesystem=self.filesystem,
                destination_filesystem=pafs.LocalFileSystem(),
            )
        return target

    @contextlib.contextmanager
    def as_directory(self) -> Iterator[str]:
        """A local directory with the files: the checkpoint's own when it is local (do not
        modify it), else a temporary copy removed afterwards."""
        if self.is_local:
            yield self.path
            return
        target = self.to_directory()
        try:
            yield target
        finally:
            shutil.rmtree(target, ignore_errors=True)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Checkpoint)
            and other.path == self.path
            and other.filesystem.type_name == self.filesystem.type_name
        )

    def __hash__(self) -> int:
        return hash(self.path)

    def __repr__(self) -> str:
        return f"Checkpoint(filesystem={self.filesystem.type_name}, path={self.path})"
