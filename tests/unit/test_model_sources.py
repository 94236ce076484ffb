"""model.source=hf and model.source=python: what the driver checks before Ray (each refusal
names the key and the fix), the HF model's shape in the config and the planner's exact count of
its parameters, the family's TP and sequence-parallel plans, a sharded pretrained build on the
meta device, and pipeline stages of an HF model that compute what the whole model computes."""

from __future__ import annotations

import json

import pytest
import torch

from raytrain_ext.cli import main
from raytrain_ext.config import ConfigError, load_config
from raytrain_ext.models import model_spec
from raytrain_ext.models.hf_config import SPEC_FAMILIES
from raytrain_ext.models.hf_parallel import hf_block_plan
from raytrain_ext.models.hf_spec import HF_SPEC, HFStage, build_hf, hf_logits
from raytrain_ext.models.user_model import python_spec
from raytrain_ext.ops.plan import count_params, shape_from_config
from raytrain_ext.ops.plan.hf_shape import FAMILY_BIASES
from raytrain_ext.parallel.fsdp import FSDPStrategy
from tests.helpers.hf_models import hf_overrides, save_tiny

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("llama"))


def test_an_hf_model_directory_gives_the_config_its_shape(llama_dir):
    cfg = load_config(None, hf_overrides(llama_dir))
    m = cfg.model
    assert (m.n_layers, m.d_model, m.n_heads, m.vocab_size, m.mlp_ratio) == (2, 64, 4, 512, 2)
    assert model_spec(m) is HF_SPEC


def test_an_inline_architecture_needs_no_directory():
    inline = "{model_type: qwen2, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 3, num_attention_heads: 2, num_key_value_heads: 1, vocab_size: 300}"  # noqa: E501
    cfg = load_config(None, ["model.source=hf", f"model.hf.config={inline}", "model.seq_len=64"])
    assert (cfg.model.n_layers, cfg.model.d_model, cfg.model.vocab_size) == (3, 32, 300)
    model = build_hf(cfg.model, seed=0)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert len(HF_SPEC.blocks(model)) == 3


@pytest.mark.parametrize(
    "change,overrides,message",
    [
        (None, ["model.source=hf"], r"model.hf: model.source=hf needs model.hf.path"),
        (None, ["model.source=hf", "model.hf.path=/no/such/dir"], r"model.hf.path: /no/such"),
        ("no-config", [], r"model.hf.path: .* has no config.json"),
        ("gpt2", [], r"model_type 'gpt2' has no model spec here; families with one: llama"),
        ("encoder", [], r"holds BertForMaskedLM, not a causal LM"),
        ("no-weights", [], r"no \*.safetensors weights.*model.hf.pretrained=false"),
        (None, ["model.seq_len=512"], r"model.seq_len: 512 exceeds .*max_position_embeddings=128"),
        (
            None,
            ["parallel.strategy=fsdp", "parallel.tp=4", "scaling.num_workers=4"],
            r"tp: 4 does not divide the model's num_key_value_heads=2",
        ),  # noqa: E501
    ],
)
def test_bad_hf_models_are_refused_before_ray_naming_the_key(
    tmp_path, llama_dir, change, overrides, message
):
    directory = llama_dir
    if change is not None:
        directory = tmp_path / "model"
        directory.mkdir()
        config = json.loads((llama_dir / "config.json").read_text())
        if change == "gpt2":
            config["model_type"] = "gpt2"
        if change == "encoder":
            config["architectures"] = ["BertForMaskedLM"]
        if change != "no-config":
            (directory / "config.json").write_text(json.dumps(config))
    base = [] if overrides[:1] == ["model.source=hf"] else hf_overrides(directory)
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*base, *overrides])


def test_sequence_parallel_refuses_a_sliding_window_shorter_than_the_sequence(tmp_path):
    directory = save_tiny(tmp_path, "mistral", sliding_window=32)
    layout = ["parallel.strategy=fsdp", "parallel.tp=2", "scaling.num_workers=2"]
    assert load_config(None, [*hf_overrides(directory), *layout]).model.seq_len == 64
    with pytest.raises(ConfigError, match=r"sequence_parallel: .*sliding window of 32 .*<= 32"):
        load_config(None, [*hf_overrides(directory), *layout, "parallel.sequence_parallel=true"])


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["model.factory=no_colon"], r"model.factory: 'no_colon' is not 'pkg.module:name'"),
        (["model.factory=no_such_pkg.mod:build"], r"model.factory: cannot import no_such_pkg"),
        (["model.factory=tests.helpers.user_models:nothing"], r"has no 'nothing'"),
        (
            [
                "model.factory=tests.helpers.user_models:build_tiny_lm",
                "parallel.strategy=fsdp",
                "parallel.tp=2",
                "scaling.num_workers=2",
            ],
            r"parallel.tp: .*build_tiny_lm gives no ModelSpec.tp_block_plan",
        ),
    ],
)
def test_bad_user_factories_are_refused_before_ray(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["model.source=python", *overrides])


def test_a_user_factory_without_a_spec_is_wrapped_by_its_block_class():
    cfg = load_config(
        None,
        [
            "model.source=python",
            "model.factory=tests.helpers.user_models:build_tiny_lm",
            "model.block_class=TinyBlock",
        ],
    )
    spec = python_spec(cfg.model)
    model = spec.build(cfg.model, 0)
    assert [type(b).__name__ for b in spec.blocks(model)] == ["TinyBlock"] * cfg.model.n_layers
    assert spec.tp_block_plan is None and spec.pipeline_stage is None


def test_the_family_tp_plan_becomes_torch_styles_and_an_unknown_style_is_named(llama_dir):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    cfg = load_config(None, hf_overrides(llama_dir))
    block = HF_SPEC.blocks(build_hf(cfg.model, 0))[0]
    plan = hf_block_plan(block, sequence_parallel=False)
    assert {k: type(v) for k, v in plan.items()} == {
        "self_attn.q_proj": ColwiseParallel,
        "self_attn.k_proj": ColwiseParallel,
        "self_attn.v_proj": ColwiseParallel,
        "self_attn.o_proj": RowwiseParallel,
        "mlp.gate_proj": ColwiseParallel,
        "mlp.up_proj": ColwiseParallel,
        "mlp.down_proj": RowwiseParallel,
    }
    inline = "{model_type: qwen3, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 256, head_dim: 16}"  # noqa: E501
    qwen3 = load_config(None, ["model.source=hf", f"model.hf.config={inline}", "model.seq_len=64"])
    with pytest.raises(ValueError, match=r"qwen3 plan splits self_attn.q_norm as 'replicated"):
        hf_block_plan(HF_SPEC.blocks(build_hf(qwen3.model, 0))[0], sequence_parallel=False)


def test_the_sequence_parallel_plan_comes_from_the_models_own_names(llama_dir):
    """torchtitan's Llama plan, derived: sublayer inputs gathered along the sequence (the
    attention's by keyword, as the decoder layer passes it), rowwise outputs reduce-scattered
    back to sequence shards, the residual norms on sequence shards."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    cfg = load_config(None, hf_overrides(llama_dir))
    plan = hf_block_plan(HF_SPEC.blocks(build_hf(cfg.model, 0))[0], sequence_parallel=True)
    assert {k: type(v) for k, v in plan.items()} == {
        "self_attn": PrepareModuleInput,
        "mlp": PrepareModuleInput,
        "self_attn.q_proj": ColwiseParallel,
        "self_attn.k_proj": ColwiseParallel,
        "self_attn.v_proj": ColwiseParallel,
        "self_attn.o_proj": RowwiseParallel,
        "mlp.gate_proj": ColwiseParallel,
        "mlp.up_proj": ColwiseParallel,
        "mlp.down_proj": RowwiseParallel,
        "input_layernorm": SequenceParallel,
        "post_attention_layernorm": SequenceParallel,
    }
    attention, mlp = plan["self_attn"], plan["mlp"]
    assert attention.input_layouts is None
    assert attention.input_kwarg_layouts == {"hidden_states": Shard(1)}
    assert attention.desired_input_kwarg_layouts == {"hidden_states": Replicate()}
    assert (mlp.input_layouts, mlp.desired_input_layouts) == ((Shard(1),), (Replicate(),))
    assert plan["self_attn.o_proj"].output_layouts == (Shard(1),)
    assert plan["mlp.down_proj"].output_layouts == (Shard(1),)
    assert HF_SPEC.tp_model_plan is not None


def test_fsdp_builds_a_pretrained_model_on_meta_and_a_random_one_whole(llama_dir):
    """No storage before sharding when the files fill every value; a random initialisation is
    built on the CPU with the values every other layout builds."""
    overrides = [*hf_overrides(llama_dir), "parallel.strategy=fsdp"]
    cfg = load_config(None, overrides)
    strategy = FSDPStrategy(cfg.parallel, model_spec(cfg.model))
    pretrained = strategy.build_model(cfg.model, 0)
    assert all(t.is_meta for t in [*pretrained.parameters(), *pretrained.buffers()])
    cfg = load_config(None, [*overrides, "model.hf.pretrained=false"])
    random = strategy.build_model(cfg.model, 0)
    whole = build_hf(cfg.model, 0).state_dict()
    assert random.state_dict().keys() == whole.keys()
    assert all(torch.equal(v, whole[k]) for k, v in random.state_dict().items())


LLAMA_LIKE = {
    "llama": {},
    "llama-biases": {"attention_bias": True, "mlp_bias": True},
    "mistral": {},
    "qwen2": {"tie_word_embeddings": True},
    "qwen3": {"head_dim": 16},
}


@pytest.mark.parametrize("case", sorted(LLAMA_LIKE))
def test_the_planner_counts_an_hf_models_parameters_exactly(tmp_path, capsys, case):
    """Gated MLP (3 x intermediate_size), grouped-query k/v (num_key_value_heads x head_dim),
    tied or untied lm_head, per-family biases and q/k norms: the planner's counts are the real
    model's, through ``raytrain-ext plan --config`` too."""
    family = case.split("-")[0]
    directory = save_tiny(tmp_path / "model", family, **LLAMA_LIKE[case])
    cfg = load_config(None, hf_overrides(directory))
    model = build_hf(cfg.model, 0)
    counts = count_params(shape_from_config(cfg.model))
    assert counts.total == sum(p.numel() for p in model.parameters())
    own = [sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()]
    assert counts.largest_module == max(own)
    root = counts.total - sum(p.numel() for p in model.model.layers.parameters())
    block = sum(p.numel() for p in model.model.layers[0].parameters())
    assert counts.largest_fsdp_unit == max(root, block)
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {{source: hf, hf: {{path: {directory}}}, seq_len: 64}}\n")
    argv = ["plan", "--config", str(config), "--nodes", "1", "--gpus-per-node", "1"]
    capsys.readouterr()
    assert main([*argv, "--gpu-mem-gb", "80", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["params_total"] == counts.total


def test_every_family_with_a_spec_has_its_planner_biases():
    assert set(FAMILY_BIASES) == set(SPEC_FAMILIES)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_pipeline_stages_of_an_hf_model_compute_what_the_whole_model_computes(tmp_path, family):
    cfg = load_config(None, hf_overrides(save_tiny(tmp_path, family, head_dim=16)))
    model = build_hf(cfg.model, 0).eval()
    assert model.config.model_type == family
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    stages = [HFStage(model, s, 2) for s in range(2)]
    with torch.no_grad():
        whole = hf_logits(model, ids)
        staged = stages[1](stages[0](ids))
    torch.testing.assert_close(staged, whole)
    names = {n for stage in stages for n, _ in stage.named_parameters()}
    assert names == {n for n, _ in model.named_parameters()}  # the model's own names


def test_export_to_hf_refuses_a_run_without_an_hf_architecture(tmp_path):
    from raytrain_ext.checkpoint.export import ExportError
    from raytrain_ext.config import to_yaml
    from raytrain_ext.ops.export_hf import export_hf

    with pytest.raises(
        ExportError, match=r"--to-hf: no config.yaml of the run found .* --run-config"
    ):
        export_hf(str(tmp_path), tmp_path / "hf")
    (tmp_path / "config.yaml").write_text(to_yaml(load_config(None, [])))
    with pytest.raises(ExportError, match=r"model.source=gpt, which has no Hugging Face arch"):
        export_hf(str(tmp_path), tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
