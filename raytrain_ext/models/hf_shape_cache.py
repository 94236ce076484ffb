"""The shape of a checked Hugging Face config, kept on disk per (config values, ``transformers``
version), so that the driver builds each config once.

Why: checking ``model.hf`` on the driver builds the ``transformers`` config, and importing
``transformers`` imports torch with it: 2.5-3 s of the driver's time before Ray starts
(measured here: ``load_config`` of ``configs/sft_llama_tiny.yaml`` 2.9 s, of which 0.1 s
without the import), for a check whose answer the same values under the same version always
repeat.  So the fields the driver reasons about (:class:`HFShape`) are written down once the
config has been accepted, and a later run with the same values reads them instead.

Invariants: only a config that ``transformers`` accepted is written, so a bad value fails
on every run with the same error.  The key covers every value given (``config.json`` merged
with ``model.hf.config``), the family and the installed ``transformers`` version, so any
change builds and checks the config again.  The cache never changes an outcome: an entry
that cannot be read (damaged, another layout) is a miss, a directory that cannot be written
costs only the next run's time, and values that cannot be keyed (not JSON) skip it.  Only
the driver reads it; workers build the config itself (``hf_config``).

``RAYTRAIN_EXT_CACHE_DIR`` names the directory (default ``$XDG_CACHE_HOME/raytrain_ext``,
else ``~/.cache/raytrain_ext``); set it empty to turn the cache off.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Dict, Optional

from raytrain_ext.errors import ConfigError
from raytrain_ext.models.hf_config import build_config, checked_values, pretrained_dir

logger = logging.getLogger(__name__)

CACHE_ENV = "RAYTRAIN_EXT_CACHE_DIR"
LAYOUT = 1  # of an entry: a change of HFShape's fields changes it


@dataclass(frozen=True)
class HFShape:
    """What the driver reads from a model's ``transformers`` config."""

    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: Optional[int]
    vocab_size: int
    intermediate_size: int
    max_position_embeddings: int
    sliding_window: Optional[int]  # None: full attention (Llama, Qwen)

    @classmethod
    def of(cls, config: Any) -> "HFShape":
        return cls(
            num_hidden_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads,
            vocab_size=config.vocab_size,
            intermediate_size=config.intermediate_size,
            max_position_embeddings=config.max_position_embeddings,
            # a family without windowed attention has no such attribute
            sliding_window=getattr(config, "sliding_window", None),
        )


def hf_shape(model_cfg) -> HFShape:
    """``model.hf``'s shape: from the cache when these values were accepted before, else
    from the ``transformers`` config built and checked now (then written down)."""
    family, values = checked_values(model_cfg)
    entry = _entry(family, values)
    if entry is not None:
        cached = _read(entry)
        if cached is not None:
            return cached
    shape = HFShape.of(build_config(family, values))
    if entry is not None:
        _write(entry, shape)
    return shape


def cache_dir() -> Optional[Path]:
    """Where entries live, or None when ``RAYTRAIN_EXT_CACHE_DIR`` is set empty (off)."""
    configured = os.environ.get(CACHE_ENV)
    if configured is not None:
        return Path(configured) if configured else None
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "raytrain_ext"


def _entry(family: str, values: Dict[str, Any]) -> Optional[Path]:
    """The file of these values' entry; None when the cache is off, ``transformers`` is
    missing (its error comes from building the config) or the values are not JSON."""
    directory = cache_dir()
    if directory is None:
        return None
    try:
        version = metadata.version("transformers")
        key = json.dumps(
            {"layout": LAYOUT, "transformers": version, "family": family, "values": values},
            sort_keys=True,
            default=_plain,
        )
    except (metadata.PackageNotFoundError, TypeError, ValueError):
        return None
    digest = hashlib.sha256(key.encode()).hexdigest()
    return directory / "hf_shapes" / f"{digest}.json"


def _plain(value: Any) -> Any:
    """A value of ``model.hf.config`` that OmegaConf holds (a nested mapping or list)."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    raise TypeError(f"not JSON: {type(value).__name__}")


def _read(entry: Path) -> Optional[HFShape]:
    try:
        return HFShape(**json.loads(entry.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as e:  # damaged, or another layout
        logger.debug("hf shape cache: %s unreadable (%s); building the config", entry, e)
        return None


def _write(entry: Path, shape: HFShape) -> None:
    """Written whole or not at all (a temporary file renamed), so a reader never sees half."""
    temporary: Optional[str] = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=entry.parent, suffix=".tmp", delete=False) as f:
            temporary = f.name
            json.dump(dataclasses.asdict(shape), f)
        os.replace(temporary, entry)
    except OSError as e:
        if temporary is not None:
            Path(temporary).unlink(missing_ok=True)
        logger.debug("hf shape cache: cannot write %s (%s)", entry, e)


def resolve_hf_shape(cfg) -> None:
    """Write the HF model's shape into ``model.*`` and check what must hold before Ray."""
    config = hf_shape(cfg.model)
    weights = pretrained_dir(cfg.model)
    if weights is not None:
        from raytrain_ext.models.safetensors_check import check_safetensors

        check_safetensors(weights)
    m = cfg.model
    m.n_layers = config.num_hidden_layers
    m.d_model = config.hidden_size
    m.n_heads = config.num_attention_heads
    m.vocab_size = config.vocab_size
    m.mlp_ratio = max(1, round(config.intermediate_size / config.hidden_size))
    limit = config.max_position_embeddings
    if m.seq_len > limit:
        raise ConfigError(
            f"model.seq_len: {m.seq_len} exceeds the model's max_position_embeddings={limit}. "
            f"Set model.seq_len <= {limit}."
        )
    window = config.sliding_window
    if cfg.parallel.sequence_parallel and window is not None and m.seq_len > window:
        raise ConfigError(
            f"parallel.sequence_parallel: the model attends within a sliding window of {window} "
            f"positions, shorter than model.seq_len={m.seq_len}; its mask is built from each "
            "rank's sequence shard, which sequence parallelism cuts. Set "
            f"model.seq_len <= {window} or parallel.sequence_parallel=false."
        )
    kv_heads = config.num_key_value_heads or config.num_attention_heads
    tp = cfg.parallel.tp
    if tp > 1 and kv_heads % tp:
        raise ConfigError(
            f"parallel.tp: {tp} does not divide the model's num_key_value_heads={kv_heads}; "
            "tensor parallelism splits whole key/value heads. Choose a tp that divides it."
        )
