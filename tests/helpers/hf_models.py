"""Tiny Hugging Face causal LMs built in the tests (never downloaded): 2 layers, hidden 64, 4 heads,
2 key/value heads, vocabulary 512 (the built-in corpus's byte ids fit in it); and placing such a
model from its files on gloo ranks the way a sharding strategy does, without the training loop."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List

import torch

TINY = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}


def tiny_config(family: str = "llama", **changes):
    from transformers import AutoConfig

    return AutoConfig.for_model(family, **{**TINY, **changes})


def save_tiny(directory: Path, family: str = "llama", seed: int = 3, **changes) -> Path:
    """A model directory as ``save_pretrained`` writes it: config.json + model.safetensors."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(tiny_config(family, **changes)).save_pretrained(directory)
    return directory


def hf_overrides(directory: Path) -> list:
    return ["model.source=hf", f"model.hf.path={directory}", "model.seq_len=64"]


def probe_ids() -> torch.Tensor:
    """A fixed batch of token ids (2 x 64) to compare logits on."""
    return torch.randint(0, TINY["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(0))


def _place_rank(rank: int, world: int, port: int, overrides: List[str], out_dir: str) -> None:
    from raytrain_ext.config import load_config
    from raytrain_ext.models import model_spec
    from raytrain_ext.parallel.dims import ParallelDims
    from raytrain_ext.parallel.fsdp import FSDPStrategy
    from raytrain_ext.parallel.strategy import DistContext
    from raytrain_ext.worker.dist_env import destroy_distributed
    from tests.helpers.dist import init_local_rank

    device = init_local_rank(rank, world, port)
    try:
        cfg = load_config(None, overrides)
        spec = model_spec(cfg.model)
        strategy = FSDPStrategy(cfg.parallel, spec)
        module = strategy.build_model(cfg.model, cfg.run.seed)
        built_on_meta = all(t.is_meta for t in [*module.parameters(), *module.buffers()])
        dims = ParallelDims.build(cfg.parallel, cfg.model, world)
        wrapped = strategy.wrap(module, DistContext(rank, world, rank, device, None, dims))
        spec.load_pretrained(wrapped, cfg.model)
        with torch.no_grad():
            logits = spec.logits(wrapped, probe_ids())
        torch.save(
            {
                "built_on_meta": built_on_meta,
                "params": strategy.full_parameters(wrapped),
                "buffers": {n: b.clone() for n, b in wrapped.named_buffers()},
                "tied": wrapped.lm_head.weight is wrapped.model.embed_tokens.weight,
                "logits": logits,
            },
            Path(out_dir) / f"rank{rank}.pt",
        )
    finally:
        destroy_distributed()


def place_from_files(world: int, overrides: List[str], out_dir: Path) -> List[Dict]:
    """Build (``FSDPStrategy.build_model``), wrap and load a pretrained HF model on ``world``
    gloo ranks; each rank's record: built on meta?, full parameters, buffers, tied?, logits."""
    from raytrain_ext.worker.rendezvous import free_port
    from tests.helpers.dist import spawn_ranks

    out_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    overrides = [f"scaling.num_workers={world}", *overrides]
    spawn_ranks(_place_rank, (world, free_port("127.0.0.1"), overrides, str(out_dir)), world)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]


def tiny_policy(seed: int = 5):
    """A tiny Llama causal LM (a rollout engine's model factory: importable by Ray's
    workers, built the same in every process)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config("llama"))
