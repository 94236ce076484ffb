"""The local-disk tier: ``<dir>/step-<N>/`` on each node (NVMe, or a shared filesystem)."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import List, Optional

from raytrain_ext.checkpoint.manifest import MANIFEST, Manifest, parse_step_dir, step_dir_name
from raytrain_ext.checkpoint.recycle import POOL, recycle_step
from raytrain_ext.checkpoint.tiers.base import Tier, TierError


class DiskTier(Tier):
    name = "local"
    node_local = True

    def __init__(self, root: str | Path, recycle: bool = False):
        """``recycle``: deleted steps leave their data files to the next save's writer
        (``checkpoint/recycle.py``)."""
        self.root = Path(root)
        self.recycle = recycle

    def step_dir(self, step: int) -> Path:
        return self.root / step_dir_name(step)

    def location(self, step: int) -> str:
        return str(self.step_dir(step))

    def probe(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".probe-{uuid.uuid4().hex}"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as e:
            raise TierError(
                f"checkpoint.dir: cannot write to {self.root}: {e}. Point "
                "checkpoint.dir at a writable directory or set checkpoint.local=false."
            ) from e

    def upload(self, step: int, src_dir: Path, names: List[str]) -> None:
        dest = self.step_dir(step)
        if src_dir.resolve() == dest.resolve():
            return  # DCP wrote straight into this tier
        dest.mkdir(parents=True, exist_ok=True)
        for name in names:
            shutil.copyfile(src_dir / name, dest / name)

    def commit(self, manifest: Manifest) -> None:
        target = self.step_dir(manifest.step) / MANIFEST
        tmp = target.with_name(f".{MANIFEST}.{uuid.uuid4().hex}")
        with open(tmp, "w") as f:
            f.write(manifest.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)

    def committed_steps(self) -> List[int]:
        return [s for s in self.all_steps() if (self.step_dir(s) / MANIFEST).is_file()]

    def manifest_text(self, step: int) -> Optional[str]:
        try:
            return (self.step_dir(step) / MANIFEST).read_text(errors="replace")
        except FileNotFoundError:
            return None

    def materialize(self, step: int, names: List[str], cache_dir: Path) -> Path:
        return self.step_dir(step)

    def all_steps(self) -> List[int]:
        if not self.root.is_dir():
            return []
        steps = (parse_step_dir(p.name) for p in self.root.iterdir() if p.is_dir())
        return sorted(s for s in steps if s is not None)

    def delete(self, step: int) -> None:
        step_dir = self.step_dir(step)
        if self.recycle and step_dir.is_dir():
            try:
                (step_dir / MANIFEST).unlink(missing_ok=True)  # uncommitted before files move
                recycle_step(step_dir, self.root / POOL)
            except OSError:  # a node sharing the directory moved them first: just delete
                pass
        shutil.rmtree(step_dir, ignore_errors=True)
