"""``ckpt export RUN --to-hf DIR``: a checkpoint of a Hugging Face model, in any layout, as a
directory ``transformers.AutoModelForCausalLM.from_pretrained`` loads.

The checkpoint's ``model.*`` tensors are whole-model tensors under the model's own names
whatever layout saved them (DCP reshards on load; pipeline stages and expert shards save
under global names), so the export reads them as :mod:`.export` does and hands them to
``save_pretrained`` on the run's architecture: ``config.json``, safetensors sharded with an
index above ``max_shard_size``, and the run's tokenizer (``data.tokenizer``, else the one a
prepared ``data.path`` was tokenized with, else the model directory's files), so the
directory is a complete ``from_pretrained`` for model and tokenizer.  Its generation config
takes the tokenizer's EOS (and pad) ids, the ids the run ended its documents with.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Dict, Optional, Tuple

from raytrain_ext.checkpoint.export import ExportError, export_info, read_newest_model
from raytrain_ext.config import load_saved_config
from raytrain_ext.data.config import DataFormat
from raytrain_ext.errors import ConfigError
from raytrain_ext.models.sources import model_source
from raytrain_ext.run_dir import CONFIG


def run_config_path(location: str, given: Optional[str]) -> Path:
    """The run's ``config.yaml``: ``--run-config``, or found beside the checkpoints."""
    if given:
        return Path(given)
    path = Path(location.rstrip("/"))
    for candidate in (path, path.parent, path.parent.parent):
        if (candidate / CONFIG).is_file():
            return candidate / CONFIG
    raise ExportError(
        f"--to-hf: no {CONFIG} of the run found at or above {location}; the export needs the "
        "run's model config. Pass --run-config RUN_DIR/config.yaml."
    )


def _hf_model(config_path: Path):
    """An empty model of the run's architecture (random weights, replaced by the export)."""
    from transformers import AutoModelForCausalLM

    try:
        cfg = load_saved_config(config_path)
        config = model_source(cfg.model).hf_config(cfg.model)
    except ConfigError as e:
        raise ExportError(f"--to-hf: the run's {e}") from None
    if config is None:
        raise ExportError(
            f"--to-hf: the run trained model.source={cfg.model.source}, which has no Hugging "
            "Face architecture. Export its tensors with --to FILE.safetensors instead."
        )
    return AutoModelForCausalLM.from_config(config), cfg


def _install(model, tensors: Dict) -> None:
    """Every parameter from the checkpoint; only a tied ``lm_head`` may be absent."""
    result = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    missing = sorted(set(result.missing_keys) - tied)
    if missing or result.unexpected_keys:
        raise ExportError(
            "RUN_OR_PATH: the checkpoint does not match the run's architecture "
            f"(missing {missing[:5]}, unexpected {sorted(result.unexpected_keys)[:5]})."
        )


def export_hf(
    location: str,
    out_dir: Path,
    s3_endpoint_url: Optional[str] = None,
    run_config: Optional[str] = None,
    max_shard_size: str = "5GB",
) -> Dict:
    """Write the newest usable checkpoint at ``location`` as a Hugging Face model directory."""
    config_path = run_config_path(location, run_config)
    model, cfg = _hf_model(config_path)
    found, tensors, fetched = read_newest_model(location, s3_endpoint_url)
    _install(model, tensors)
    source = _tokenizer_source(cfg)
    tokenizer = None if source is None else _run_tokenizer(*source)
    if tokenizer is not None:
        _align_generation_ids(model, tokenizer)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out_dir, max_shard_size=max_shard_size)
        if tokenizer is not None:
            tokenizer.save_pretrained(out_dir)
    except OSError as e:
        raise ExportError(
            f"--to-hf: cannot write {out_dir}: {e}. Give a writable directory."
        ) from None
    from raytrain_ext.models.hf_config import local_dir
    from raytrain_ext.models.hf_spec import hf_files

    source_dir = cfg.model.hf.path
    carried = hf_files(local_dir(source_dir)) if source_dir and tokenizer is None else []
    for path in carried:
        shutil.copy2(path, out_dir / path.name)
    return {
        **export_info(found, tensors, out_dir, fetched),
        "carried": [p.name for p in carried],
        "tokenizer": None if source is None else source[0],
    }


def _tokenizer_source(cfg) -> Optional[Tuple[str, Optional[str], Optional[int]]]:
    """The tokenizer the run's data was tokenized with, with its EOS token (by name, or by
    the id a prepared index recorded), when it is not the model directory's own:
    ``data.tokenizer``, else the prepared ``data.path``'s."""
    if cfg.data.tokenizer:
        return cfg.data.tokenizer, cfg.data.eos_token, None
    if cfg.data.format == DataFormat.tokens or cfg.data.path.startswith("s3://"):
        return None
    from raytrain_ext.prepare.prepared_index import read_index

    path = Path(cfg.data.path)
    index = read_index(path) if path.is_dir() else None
    if index is None:
        return None
    return index.tokenizer.source, None, index.tokenizer.eos_id


def _run_tokenizer(spec: str, eos_token: Optional[str], eos_id: Optional[int]):
    """The run's tokenizer as it trained, its EOS token included."""
    from raytrain_ext.errors import InputError
    from raytrain_ext.prepare.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(spec, eos_token)
    except InputError as e:
        raise ExportError(
            f"--to-hf: the run's tokenizer cannot be exported: {e} Put it back where the run "
            "read it, or pass --run-config with a config whose data.tokenizer names it."
        ) from None
    if eos_id is not None:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos_id)
    return tokenizer


def _align_generation_ids(model, tokenizer) -> None:
    """``generate`` stops at the EOS the run trained on and pads with its pad id."""
    from raytrain_ext.prepare.tokenizer import eos_token_id

    eos = eos_token_id(tokenizer, "of the run")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    for config in (model.config, model.generation_config):
        config.eos_token_id = eos
        config.pad_token_id = pad
    if tokenizer.bos_token_id is not None:
        model.generation_config.bos_token_id = tokenizer.bos_token_id
        model.config.bos_token_id = tokenizer.bos_token_id
