"""A resolved config as plain values, as YAML and as a digest: what goes to workers, into
the run directory and into the checkpoint manifest (``config_digest``)."""

from __future__ import annotations

import hashlib
import json

from omegaconf import DictConfig, OmegaConf


def to_dict(cfg: DictConfig) -> dict:
    """Plain values only: a choice is written as its string (``"fsdp"``), not an enum member,
    so the dict serialises to JSON/YAML anywhere and rebuilds without this package's enums."""
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


def config_digest(cfg: DictConfig) -> str:
    """A stable digest of the resolved config (sorted JSON)."""
    blob = json.dumps(to_dict(cfg), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
