"""Config: precedence, interpolation, and a clear error for each kind of bad input."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from raytrain_ext.config import ConfigError, config_from_dict, load_config, to_dict

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


def test_packaged_default_is_the_tiny_cpu_config():
    packaged = load_config()
    from_repo = load_config(REPO / "configs" / "tiny_cpu.yaml")
    assert to_dict(packaged) == to_dict(from_repo)
    assert packaged.scaling.num_workers == 2 and packaged.parallel.strategy == "ddp"


def test_precedence_defaults_then_yaml_then_overrides(tmp_path):
    path = write(tmp_path, "optim:\n  lr: 0.01\n  warmup_steps: 3\nrun:\n  max_steps: 7\n")
    cfg = load_config(path, ["optim.lr=0.02"], use_default=False)
    assert cfg.optim.lr == 0.02  # override beats YAML
    assert cfg.optim.warmup_steps == 3  # YAML beats default
    assert cfg.optim.weight_decay == 0.1  # dataclass default
    assert cfg.run.max_steps == 7


def test_interpolations_are_resolved_on_the_driver(tmp_path):
    cfg = load_config(None, ["run.seed=99", "run.max_steps=12", "run.name=abc"])
    assert cfg.data.seed == 99 and cfg.optim.decay_steps == 12
    assert cfg.checkpoint.dir == "runs/abc/checkpoints"
    assert "${" not in OmegaConf.to_yaml(cfg)


def test_derived_scaling_defaults_and_read_only():
    cfg = load_config(None, ["scaling.num_workers=4", "data.global_batch_size=16"])
    assert (cfg.scaling.min_workers, cfg.scaling.max_workers) == (4, 4)
    with pytest.raises(Exception):
        cfg.run.max_steps = 3


def test_config_round_trips_through_a_plain_dict():
    cfg = load_config(None, ["model.moe.num_experts=4"])
    again = config_from_dict(to_dict(cfg))
    assert to_dict(again) == to_dict(cfg) and again.model.moe.num_experts == 4


def test_realistic_gpu_config_validates():
    cfg = load_config(REPO / "configs" / "gpt_1b_2x8gpu.yaml")
    assert cfg.scaling.use_gpu and cfg.scaling.resources_per_worker["GPU"] == 1
    assert cfg.data.global_batch_size % (cfg.data.micro_batch_size * cfg.scaling.num_workers) == 0


BAD_INPUTS = [
    (
        ["data.global_batch_sise=32"],
        r"data\.global_batch_sise: unknown key in section 'data'.*"
        r"Did you mean 'data\.global_batch_size'",
    ),
    (["modle.n_layers=2"], r"modle: unknown key in the top level.*Did you mean 'model'"),
    (["run.max_steps=abc"], r"run\.max_steps: .*'abc'.*Integer"),
    (["run.max_steps=-5"], r"run\.max_steps: must be a positive .* got -5"),
    (
        ["data.global_batch_size=18"],
        r"data\.global_batch_size: 18 is not a multiple of "
        r"data\.micro_batch_size x scaling\.num_workers = 4 x 2 = 8",
    ),
    (["model.d_model=130"], r"model\.d_model: 130 is not divisible by model\.n_heads=4"),
    (["parallel.strategy=ddpp"], r"parallel\.strategy: 'ddpp' is not one of ddp"),
    (["parallel.backend=nccl"], r"parallel\.backend: 'nccl' needs GPUs"),
    (
        ["scaling.min_workers=3"],
        r"scaling\.num_workers: need 1 <= min_workers <= num_workers "
        r"<= max_workers, got 3 <= 2 <= 2",
    ),
    (["optim.min_lr=1.0"], r"optim\.min_lr: 1\.0 is larger than optim\.lr"),
    (["optim.betas=[0.9]"], r"optim\.betas: \[0\.9\] must be two numbers"),
    (["model.moe.num_experts=4", "model.moe.top_k=5"], r"model\.moe\.top_k: 5 must be between 1"),
    (
        ["scaling.resources_per_worker.GPU=1"],
        r"scaling\.resources_per_worker\.GPU: GPUs are "
        r"requested but scaling\.use_gpu is false",
    ),
    (["scaling.placement_strategy=pack"], r"scaling\.placement_strategy: 'pack' is not one of"),
    (["parallel.timeout_s=0"], r"parallel\.timeout_s: must be a positive finite number"),
    (["run.name=a/b"], r"run\.name: 'a/b' must be a non-empty name without '/'"),
    (["model.vocab_size=100"], r"model\.vocab_size: 100 is too small for the byte-level"),
    (
        ["scaling.max_workers=40"],
        r"data\.global_batch_size: 16 is smaller than "
        r"scaling\.max_workers=40",
    ),
    (["run.seed=-1"], r"run\.seed: must be >= 0, got -1"),
    (["run.max_steps"], r"override 'run\.max_steps' is not of the form key=value"),
    (["data.seed=${nope.x}"], r"data\.seed: cannot resolve interpolation"),
]


@pytest.mark.parametrize("overrides,message", BAD_INPUTS, ids=[o[0] for o, _ in BAD_INPUTS])
def test_bad_input_names_the_key_and_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_unknown_key_in_yaml_names_the_file(tmp_path):
    path = write(tmp_path, "optim:\n  learning_rate: 0.1\n")
    with pytest.raises(
        ConfigError, match=r"optim\.learning_rate: unknown key .* \(from .*cfg\.yaml\)"
    ):
        load_config(path)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match=r"does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match=r"not valid YAML"):
        load_config(write(tmp_path, "run: [unclosed\n"))
    with pytest.raises(ConfigError, match=r"must hold a mapping"):
        load_config(write(tmp_path, "- a\n- b\n"))
