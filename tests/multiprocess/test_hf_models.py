"""The user's model on gloo processes: a Hugging Face Llama from pretrained weights under DDP,
FSDP2 + tensor parallelism, pipeline stages and ZeRO-3 (each against DDP), a Qwen2 from an inline
architecture under FSDP, the user's own nn.Module under FSDP, and a checkpoint of a sharded
layout exported to a directory ``from_pretrained`` loads."""

from __future__ import annotations

import pytest
import torch

from raytrain_ext.checkpoint.export_hf import export_hf
from raytrain_ext.config import load_config, to_yaml
from tests.helpers.dist import train_processes
from tests.helpers.hf_models import hf_overrides, save_tiny
from tests.helpers.layouts import ATOL_UNEVEN, max_param_diff

pytest.importorskip("transformers")

STEPS = [
    "run.max_steps=4",
    "data.global_batch_size=4",
    "data.micro_batch_size=2",
    "optim.warmup_steps=1",
]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def ddp(llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf-ddp")
    return train_processes(2, [*hf_overrides(llama_dir), *STEPS, "checkpoint.enabled=false"], tmp)


@pytest.mark.slow
def test_pretrained_weights_are_where_training_starts(llama_dir, ddp, tmp_path):
    """The same run from a random initialisation starts elsewhere; from the directory's
    weights, both ranks hold the same model after every step."""
    random = train_processes(
        1,
        [*hf_overrides(llama_dir), *STEPS, "model.hf.pretrained=false", "checkpoint.enabled=false"],
        tmp_path,
    )
    assert abs(ddp[0]["records"][0]["loss"] - random[0]["records"][0]["loss"]) > 1e-3
    assert ddp[0]["result"]["params_sha256"] == ddp[1]["result"]["params_sha256"]
    assert ddp[0]["records"][-1]["loss"] < ddp[0]["records"][0]["loss"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        ["parallel.strategy=fsdp", "parallel.tp=2"],
        ["parallel.pp=2"],
        ["parallel.strategy=zero", "parallel.zero.stage=3"],
    ],
    ids=["fsdp-tp2", "pp2", "zero3"],
)
def test_sharded_tensor_and_pipeline_parallel_llama_match_ddp(llama_dir, ddp, tmp_path, layout):
    ranks = train_processes(
        2, [*hf_overrides(llama_dir), *STEPS, "checkpoint.enabled=false", *layout], tmp_path
    )
    assert max_param_diff(ranks[0]["params"], ddp[0]["params"]) < ATOL_UNEVEN
    losses = [r["loss"] for r in ranks[0]["records"]]
    assert losses == pytest.approx([r["loss"] for r in ddp[0]["records"]], abs=1e-4)
    assert {r["result"]["samples_digest"] for r in ranks} == {ddp[0]["result"]["samples_digest"]}


@pytest.mark.slow
def test_fsdp_checkpoint_of_an_inline_qwen2_exports_to_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM

    inline = (
        "{model_type: qwen2, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, "
        "num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 256, "
        "max_position_embeddings: 128, tie_word_embeddings: true}"
    )
    run = tmp_path / "run"
    overrides = [
        "model.source=hf",
        f"model.hf.config={inline}",
        "model.seq_len=64",
        *STEPS,
        "parallel.strategy=fsdp",
        "checkpoint.every_steps=4",
        f"checkpoint.dir={run / 'checkpoints'}",
    ]
    ranks = train_processes(2, overrides, tmp_path / "out")
    (run / "config.yaml").write_text(to_yaml(load_config(None, overrides)))  # as runs keep it
    info = export_hf(str(run), tmp_path / "hf", max_shard_size="100KB")
    assert info["step"] == 4 and (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    trained = ranks[0]["params"]
    for name, value in exported.named_parameters():
        torch.testing.assert_close(value.detach(), trained[name], msg=name)


@pytest.mark.slow
def test_the_users_own_module_trains_under_fsdp_wrapped_by_its_block_class(tmp_path):
    ranks = train_processes(
        2,
        [
            "model.source=python",
            "model.factory=tests.helpers.user_models:build_tiny_lm",
            "model.block_class=TinyBlock",
            "parallel.strategy=fsdp",
            *STEPS,
            "checkpoint.enabled=false",
        ],
        tmp_path,
    )
    losses = [r["loss"] for r in ranks[0]["records"]]
    assert losses[-1] < losses[0]
    assert ranks[0]["result"]["params_sha256"] == ranks[1]["result"]["params_sha256"]
    assert {n.split(".")[0] for n in ranks[0]["params"]} == {"embed", "stack", "out"}
