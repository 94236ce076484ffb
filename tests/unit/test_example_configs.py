"""The GPU twins of the example SFT and DPO configs are valid as shipped (not run here):
they load and validate against a directory holding Llama 3.1 8B's config.json, without its
16 GB of weights (so ``model.hf.pretrained=false`` here: the presence of safetensors is the
one check this cannot make), and their objective fits their data format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raytrain_ext.config import load_config
from raytrain_ext.objectives import check_objective

pytest.importorskip("transformers")
CONFIGS = Path(__file__).parents[2] / "configs"
LLAMA_31_8B = {  # config.json of meta-llama/Llama-3.1-8B-Instruct, the shape-bearing keys
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}


@pytest.mark.parametrize("name", ["sft_llama3_8b_16gpu", "dpo_llama3_8b_16gpu"])
def test_gpu_twin_configs_validate(tmp_path, name):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_31_8B))
    cfg = load_config(
        CONFIGS / f"{name}.yaml", [f"model.hf.path={tmp_path}", "model.hf.pretrained=false"]
    )
    assert (cfg.model.n_layers, cfg.model.d_model, cfg.model.vocab_size) == (32, 4096, 128256)
    assert cfg.scaling.num_workers == 16 and cfg.parallel.backend == "nccl"
    check_objective(cfg)


QWEN25_15B = {  # config.json of Qwen/Qwen2.5-1.5B-Instruct, the shape-bearing keys
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}


def test_the_grpo_gpu_twin_validates_and_asks_for_the_vllm_extra_where_it_is_missing(tmp_path):
    """The twin of configs/grpo_tiny.yaml: Qwen2.5-1.5B, 4 FSDP trainers, 4 vLLM engines of
    one GPU each.  Where vLLM is not installed (the CI machine) the rollout check refuses it
    before Ray, naming the extra; where it is, the config passes."""
    import importlib.util

    from raytrain_ext.errors import InputError
    from raytrain_ext.rollout.config import check_rollout

    (tmp_path / "config.json").write_text(json.dumps(QWEN25_15B))
    cfg = load_config(
        CONFIGS / "grpo_qwen2.5_1.5b_8gpu.yaml",
        [f"model.hf.path={tmp_path}", "model.hf.pretrained=false"],
    )
    assert (cfg.model.n_layers, cfg.model.d_model, cfg.model.vocab_size) == (28, 1536, 151936)
    assert cfg.scaling.num_workers == 4 and cfg.parallel.backend == "nccl"
    assert cfg.rollout.backend == "vllm" and cfg.rollout.resources_per_engine["GPU"] == 1
    check_objective(cfg)
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(InputError, match=r"rollout.backend: vllm is not installed here"):
            check_rollout(cfg)
    else:
        check_rollout(cfg)
