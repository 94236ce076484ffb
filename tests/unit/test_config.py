"""Config: precedence, interpolation, and a clear error for each kind of bad input."""

import json
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ReadonlyConfigError

from raytrain_ext.config import ConfigError, TrainConfig, config_from_dict, load_config, to_dict
from raytrain_ext.parallel.config import PipelineSchedule, StrategyName
from raytrain_ext.typed_config.choice import Choice
from raytrain_ext.typed_config.fields import choice_of, declared_ranges, leaf_fields

REPO = Path(__file__).resolve().parents[2]


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
    with pytest.raises(ReadonlyConfigError):
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
        ["checkpoint.snapshot_every_step=true", "checkpoint.memory=false"],
        r"checkpoint\.snapshot_every_step: the per-step snapshot goes to the memory tier.*"
        r"set checkpoint\.memory=true",
    ),
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
    (
        ["parallel.pp_schedule=1F1B"],
        r"parallel\.pp_schedule: '1F1B' is not one of gpipe, 1f1b \(from command line\)\. "
        r"Set parallel\.pp_schedule to one of them",
    ),
    (
        ["guards.nan_policy=skip"],
        r"guards\.nan_policy: 'skip' is not one of skip_step, rollback, fail",
    ),
    (["parallel.strategy=${run.name}"], r"parallel\.strategy: cannot resolve .*'tiny'.*ddp, fsdp"),
    (["optim.lr=inf"], r"optim\.lr: must be a positive finite number, got inf"),
    (["chaos.kill_rank=-3"], r"chaos\.kill_rank: must be -1 \(none/unlimited\) or >= 0, got -3"),
    (["model.dropout=1.0"], r"model\.dropout: must be in \[0, 1\), got 1\.0"),
    (["checkpoint.every_seconds=-1"], r"checkpoint\.every_seconds: must be > 0 or null"),
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


CHOICE_KEYS = [
    (key, choice_of(TrainConfig, key))
    for key, _, _ in leaf_fields(TrainConfig)
    if choice_of(TrainConfig, key)
]


def test_choice_keys_are_the_closed_sets_the_code_uses():
    assert {key: kind.values() for key, kind in CHOICE_KEYS} == {
        "run.device": ("auto", "cpu", "cuda"),
        "model.source": ("gpt", "hf", "python"),
        "data.format": ("tokens", "text", "chat", "preference", "prompts"),
        "data.ray_dataset": ("auto", "stream", "materialise"),
        "objective.name": ("causal_lm", "sft", "dpo", "grpo", "user"),
        "objective.grpo.loss_type": ("dapo", "grpo", "dr_grpo", "bnpo"),
        "objective.grpo.scale_rewards": ("group", "batch", "none"),
        "rollout.backend": ("hf", "vllm"),
        "scaling.placement_strategy": ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"),
        "elastic.replacement": ("in_place", "background", "auto"),
        "parallel.strategy": ("ddp", "fsdp", "zero"),
        "parallel.backend": ("auto", "nccl", "gloo"),
        "parallel.mixed_precision": ("auto", "bf16", "fp32"),
        "parallel.pp_schedule": ("gpipe", "1f1b"),
        "parallel.zero.offload_optimizer": ("none", "cpu", "nvme"),
        "parallel.zero.offload_param": ("none", "cpu", "nvme"),
        "checkpoint.on_busy": ("skip", "wait"),
        "guards.nan_policy": ("skip_step", "rollback", "fail"),
    }


@pytest.mark.parametrize("key,kind", CHOICE_KEYS, ids=[key for key, _ in CHOICE_KEYS])
def test_every_choice_is_accepted_as_users_spell_it(tmp_path, key, kind):
    """Member names are their values: OmegaConf writes names, users write values."""
    schema = OmegaConf.structured(TrainConfig)
    for value in kind.values():
        assert kind[value].value == value
        from_cli = OmegaConf.merge(schema, OmegaConf.from_dotlist([f"{key}={value}"]))
        nested: object = value
        for part in reversed(key.split(".")):
            nested = {part: nested}
        from_yaml = OmegaConf.merge(schema, OmegaConf.create(yaml.safe_dump(nested)))
        assert OmegaConf.select(from_cli, key) == OmegaConf.select(from_yaml, key) == value


def test_choice_values_behave_as_plain_strings():
    """Code compares them with strings, keys dicts by strings and formats them with !r."""
    cfg = load_config(None, ["parallel.pp_schedule=gpipe"])
    strategy, schedule = cfg.parallel.strategy, cfg.parallel.pp_schedule
    assert strategy is StrategyName.ddp and schedule is PipelineSchedule("gpipe")
    assert strategy == "ddp" and strategy != "fsdp" and schedule in ("gpipe", "1f1b")
    assert {"ddp": 1}[strategy] == 1 and {"gpipe": 2}[schedule] == 2
    assert f"{strategy} {strategy!r} {schedule}" == "ddp 'ddp' gpipe"


def test_written_configs_hold_plain_strings():
    """config.yaml, summary/digest JSON and the dict shipped to workers name no enum class."""
    cfg = load_config(None, ["parallel.strategy=fsdp", "parallel.pp_schedule=gpipe"])
    data = to_dict(cfg)
    assert type(data["parallel"]["strategy"]) is str and data["parallel"]["strategy"] == "fsdp"
    assert yaml.safe_load(yaml.safe_dump(data)) == data  # safe_dump refuses enum members
    text = OmegaConf.to_yaml(cfg)
    assert "strategy: fsdp" in text and "pp_schedule: gpipe" in text and "StrategyName." not in text
    assert '"fsdp"' in json.dumps(data)
    again = config_from_dict(data)
    assert again.parallel.strategy is StrategyName.fsdp and to_dict(again) == data


def test_declared_ranges_hold_for_the_defaults():
    """A default outside its own range would make every run fail validation."""
    cfg = load_config(None, use_default=False)
    ranges = dict(declared_ranges(TrainConfig))
    assert ranges and "run.max_steps" in ranges and "chaos.kill_rank" in ranges
    assert all(
        bounds.problem(key, OmegaConf.select(cfg, key)) is None for key, bounds in ranges.items()
    )
    assert not any(issubclass(type(v), Choice) for v in to_dict(cfg)["parallel"].values())


def test_a_bracketed_string_override_is_told_to_quote_itself():
    """``data.eos_token=[EOS]`` is a list in OmegaConf's override grammar: the error says how
    to give the string."""
    with pytest.raises(ConfigError, match=r"needs quotes: 'data\.eos_token=\"\[EOS\]\"'"):
        load_config(None, ["data.eos_token=[EOS]"])
    assert load_config(None, ['data.eos_token="[EOS]"']).data.eos_token == "[EOS]"
