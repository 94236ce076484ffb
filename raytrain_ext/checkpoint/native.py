"""A strategy's own checkpoint files (DeepSpeed's ``save_checkpoint``) carried in our step dirs.

Tiers hold flat file sets, so a native checkpoint's tree is flattened into the
step directory under reversible names (``native--<path with / as -->``) and is
checksummed, replicated and committed with the DCP files by the same manifest.
A restore rebuilds the tree as symlinks to the verified files, so the engine's
own loader (and DeepSpeed's ``zero_to_fp32``) read it where it expects it.

Invariant: each rank saves into a directory of its own, so the files a rank
lists are exactly the ones it wrote, even where ranks share a staging disk.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List

PREFIX = "native--"
SEP = "--"


@dataclass
class NativeFiles:
    """One rank's native files of a save (flat names in the step dir) and the
    format record the manifest keeps (``{"format", "stage", "tag"}``)."""

    names: List[str] = field(default_factory=list)
    info: Dict[str, Any] = field(default_factory=dict)


def flat_name(relative: str) -> str:
    if SEP in relative:
        raise ValueError(
            f"native checkpoint file {relative!r} contains {SEP!r}, which the "
            "flat naming in checkpoint step directories reserves"
        )
    return PREFIX + relative.replace("/", SEP)


def tree_path(name: str) -> str:
    return name[len(PREFIX) :].replace(SEP, "/")


def is_native(name: str) -> bool:
    return name.startswith(PREFIX)


def private_dir(step_dir: Path, rank: int) -> Path:
    return step_dir / f".native-rank{rank}"


def collect(saved_root: Path, step_dir: Path) -> List[str]:
    """Move every file under ``saved_root`` into ``step_dir`` under its flat name."""
    names = []
    for path in sorted(p for p in saved_root.rglob("*") if p.is_file()):
        name = flat_name(path.relative_to(saved_root).as_posix())
        path.replace(step_dir / name)
        names.append(name)
    shutil.rmtree(saved_root, ignore_errors=True)
    return names


def rebuild(directory: Path, names: List[str], dest: Path) -> Path:
    """The native tree under ``dest``, as symlinks to the flat files in ``directory``."""
    shutil.rmtree(dest, ignore_errors=True)
    for name in names:
        link = dest / tree_path(name)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to((directory / name).resolve())
    return dest
