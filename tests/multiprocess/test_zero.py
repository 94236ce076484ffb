"""DeepSpeed ZeRO-1/2/3 in the real training loop on multi-process gloo, and its config.

Every ZeRO run trains the same global batches as a DDP run with the same AdamW
and LR schedule, so it must reach DDP's parameters.  Measured here after 4
steps (2 ranks, fp32 on CPU): ZeRO-1 and ZeRO-2 bit-identical to DDP (0.0),
ZeRO-3 3.7e-9, the uneven split (3 ranks with 3/3/2 samples: 2/2/1
micro-batches) against 2-rank DDP 6.9e-8 (losses within 2.4e-7), a ZeRO-2
checkpoint from 2 ranks resumed on 1 rank 3.7e-9.  Asserted: ``PARAM_ATOL = 1e-6`` (one lr-sized AdamW update is
~1e-3, so a lost micro-batch, a double-scaled loss or a skipped update fails),
every step's loss within ``LOSS_ATOL = 1e-6`` and every pre-clip grad norm
within 1e-5 relative (a gradient averaged twice halves it).
"""

import json
import os
from pathlib import Path

import pytest

from raytrain_ext.config import load_config
from raytrain_ext.errors import ConfigError
from raytrain_ext.parallel.zero import deep_merge, deepspeed_config
from tests.helpers.dist import train_processes

# Any op DeepSpeed JIT-builds is cached here (its CPU shm all-reduce op is off: parallel/zero.py).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions"))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

SMALL = [
    "model.n_layers=2",
    "model.d_model=32",
    "model.n_heads=2",
    "model.seq_len=32",
    "data.global_batch_size=8",
    "data.micro_batch_size=2",
    "run.max_steps=4",
    "run.tensorboard=false",
]
NO_CKPT = ["checkpoint.enabled=false"]
PARAM_ATOL = 1e-6
LOSS_ATOL = 1e-6
NORM_RTOL = 1e-5


def zero(stage, *extra):
    return ["parallel.strategy=zero", f"parallel.zero.stage={stage}", *extra]


def train(world, tmp: Path, *extra):
    return train_processes(world, SMALL + [f"run.output_dir={tmp}", *extra], tmp)


def curve(ranks, key):
    return [r[key] for r in ranks[0]["records"]]


def max_param_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def assert_matches(run, reference, steps=slice(None)):
    assert max_param_diff(run[0]["params"], reference[0]["params"]) <= PARAM_ATOL
    for got, want in zip(curve(run, "loss"), curve(reference, "loss")[steps], strict=False):
        assert got == pytest.approx(want, abs=LOSS_ATOL)
    for got, want in zip(
        curve(run, "grad_norm"), curve(reference, "grad_norm")[steps], strict=False
    ):
        assert got == pytest.approx(want, rel=NORM_RTOL)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    return train(2, tmp_path_factory.mktemp("ddp"), *NO_CKPT)


# ---- pure: config generation and validation ------------------------------------------------
def zero_cfg(*overrides):
    return load_config(None, [*SMALL, "parallel.strategy=zero", *overrides]).parallel.zero


def test_deepspeed_config_from_our_config():
    config = deepspeed_config(
        zero_cfg(
            "parallel.zero.stage=3",
            "parallel.zero.offload_optimizer=cpu",
            "parallel.zero.offload_param=cpu",
        ),
        micro_batch_size=2,
        grad_clip=0.5,
        bf16=True,
    )
    assert config["train_micro_batch_size_per_gpu"] == 2
    assert config["gradient_accumulation_steps"] == 1  # the loop owns accumulation and scaling
    assert config["gradient_clipping"] == 0.5
    assert config["bf16"] == {"enabled": True}
    assert config["zero_optimization"]["stage"] == 3
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert config["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert config["zero_allow_untested_optimizer"] is True
    json.dumps(config)  # DeepSpeed takes it as JSON


def test_nvme_offload_without_libaio_names_the_key_and_the_fix():
    from raytrain_ext.parallel.zero import check_nvme_support

    cfg = zero_cfg(
        "parallel.zero.stage=3",
        "parallel.zero.offload_param=nvme",
        "parallel.zero.nvme_path=/local_nvme",
    )
    with pytest.raises(
        RuntimeError,
        match=r"parallel\.zero\.offload_param: nvme offload needs "
        r"DeepSpeed's async_io op.*libaio-dev.*or offload to cpu",
    ):
        check_nvme_support(cfg, async_io_available=False)
    check_nvme_support(cfg, async_io_available=True)
    check_nvme_support(zero_cfg("parallel.zero.offload_optimizer=cpu"), async_io_available=False)


def test_nvme_offload_carries_its_path():
    cfg = zero_cfg(
        "parallel.zero.stage=3",
        "parallel.zero.offload_optimizer=nvme",
        "parallel.zero.nvme_path=/local_nvme",
    )
    section = deepspeed_config(cfg, 2, 1.0, False)["zero_optimization"]["offload_optimizer"]
    assert (section["device"], section["nvme_path"]) == ("nvme", "/local_nvme")


def test_extra_keys_merge_last_and_deep():
    cfg = zero_cfg(
        "parallel.zero.extra={zero_optimization: {reduce_bucket_size: 1000}, "
        "gradient_clipping: 2.0}"
    )
    config = deepspeed_config(cfg, 2, 1.0, False)
    assert config["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 1000}
    assert config["gradient_clipping"] == 2.0
    assert deep_merge({"a": {"b": 1, "c": 2}}, {"a": {"c": 3}}) == {"a": {"b": 1, "c": 3}}


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel.zero.stage=4"], "parallel.zero.stage: 4 is not a ZeRO stage"),
        (
            ["parallel.zero.offload_param=cpu"],
            "parallel.zero.offload_param: offloading parameters needs ZeRO stage 3 (got stage 2)",
        ),
        (
            ["parallel.zero.stage=3", "parallel.zero.offload_optimizer=nvme"],
            "parallel.zero.offload_optimizer: nvme offload needs a directory",
        ),
        (
            ["parallel.zero.offload_optimizer=nvme", "parallel.zero.nvme_path=/nvme"],
            "nvme offload (ZeRO-Infinity) needs ZeRO stage 3",
        ),
        (
            ["parallel.zero.offload_optimizer=disk"],
            "parallel.zero.offload_optimizer: 'disk' is not one of",
        ),
        (
            ["parallel.tp=2"],
            "parallel.tp: tensor parallelism (tp=2) is not supported with parallel.strategy=zero",
        ),
        (
            ["parallel.zero.stage=3", "scaling.num_workers=2", "scaling.max_workers=3"],
            "ZeRO stage 3 gathers parameters in every forward",
        ),
    ],
)
def test_invalid_zero_configs_name_the_key_and_the_fix(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, [*SMALL, "parallel.strategy=zero", *overrides])
    assert message in str(error.value)
    assert "Set " in str(error.value) or "Use " in str(error.value)


def test_zero_is_a_strategy_choice():
    assert load_config(None, [*SMALL, "parallel.strategy=zero"]).parallel.zero.stage == 2


# ---- multi-process: numerics against DDP ---------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stage_matches_ddp(stage, ddp, tmp_path):
    run = train(2, tmp_path, *NO_CKPT, *zero(stage))
    assert_matches(run, ddp)
    losses = curve(run, "loss")
    assert losses[-1] < losses[0]
    assert run[0]["result"]["params_sha256"] == run[1]["result"]["params_sha256"]


@pytest.mark.slow
def test_zero2_uneven_micro_batch_counts_match_ddp(ddp, tmp_path):
    """3 ranks, 8 samples, micro-batches of 2: ranks run 2, 2 and 1 micro-batches, and reach
    the 2-rank DDP run (4 and 4 samples) within the same tolerances."""
    run = train(3, tmp_path, "scaling.num_workers=2", *NO_CKPT, *zero(2))
    assert_matches(run, ddp)


@pytest.mark.slow
def test_offload_optimizer_and_params_to_cpu_match_ddp(ddp, tmp_path):
    run = train(
        2,
        tmp_path,
        *NO_CKPT,
        *zero(3, "parallel.zero.offload_optimizer=cpu", "parallel.zero.offload_param=cpu"),
    )
    assert_matches(run, ddp)


@pytest.mark.slow
def test_skipped_nan_step_matches_ddp(tmp_path):
    """guards.nan_policy=skip_step: the poisoned step's reduced gradients are discarded."""
    nan = [*NO_CKPT, "chaos.nan_rank=1", "chaos.nan_at_step=2", "run.max_steps=3"]
    reference = train(2, tmp_path / "ddp", *nan)
    run = train(2, tmp_path / "zero", *nan, *zero(2))
    assert run[0]["records"][1]["skipped"] is True
    assert max_param_diff(run[0]["params"], reference[0]["params"]) <= PARAM_ATOL
    assert curve(run, "loss") == pytest.approx(curve(reference, "loss"), abs=LOSS_ATOL)


# ---- multi-process: checkpoints --------------------------------------------------------------
@pytest.mark.slow
def test_zero2_checkpoint_resumes_on_fewer_workers_and_in_ddp(ddp, tmp_path):
    """Saved by 2 ZeRO-2 ranks at step 2; resumed by 1 ZeRO-2 rank and by 2 DDP ranks."""
    saved = train(
        2, tmp_path / "save", *zero(2), "run.max_steps=2", f"checkpoint.dir={tmp_path / 'ckpt'}"
    )
    step_dir = tmp_path / "ckpt" / "step-00000002"
    manifest = json.loads((step_dir / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and "__1_0.distcp" in manifest["files"]
    assert curve(saved, "loss") == pytest.approx(curve(ddp, "loss")[:2], abs=LOSS_ATOL)
    for name, world, extra in (("zero1rank", 1, zero(2)), ("ddp", 2, [])):
        run = train(
            world,
            tmp_path / name,
            *extra,
            f"scaling.num_workers={world}",
            f"checkpoint.resume={step_dir}",
            f"checkpoint.dir={tmp_path / name / 'ck'}",
        )
        restored = run[0]["result"]["restored"]
        assert (restored["step"], restored["saved_world_size"]) == (2, 2)
        assert_matches(run, ddp, steps=slice(2, None))


@pytest.mark.slow
def test_native_deepspeed_files_are_committed_and_restored_through_load_checkpoint(ddp, tmp_path):
    """``parallel.zero.native_checkpoint``: DeepSpeed's own files ride in the manifest, its
    ``zero_to_fp32`` reads them, a same-size resume loads them through ``load_checkpoint``,
    and a resume on another world size reshards the DCP files instead."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from raytrain_ext.checkpoint import native

    native_on = zero(2, "parallel.zero.native_checkpoint=true")
    saved = train(
        2, tmp_path / "save", *native_on, "run.max_steps=2", f"checkpoint.dir={tmp_path / 'ckpt'}"
    )
    step_dir = tmp_path / "ckpt" / "step-00000002"
    manifest = json.loads((step_dir / "manifest.json").read_text())
    assert manifest["native"] == {"format": "deepspeed", "stage": 2, "tag": "step-00000002"}
    names = sorted(n for n in manifest["files"] if native.is_native(n))
    tag = "native--step-00000002--"
    assert {
        f"{tag}mp_rank_00_model_states.pt",
        f"{tag}zero_pp_rank_0_mp_rank_00_optim_states.pt",
        f"{tag}zero_pp_rank_1_mp_rank_00_optim_states.pt",
    } <= set(names)
    assert not list(step_dir.glob(".native-rank*"))  # private save dirs are emptied into the step

    tree = native.rebuild(step_dir, names, tmp_path / "tree")
    fp32 = get_fp32_state_dict_from_zero_checkpoint(str(tree), tag="step-00000002")
    assert max_param_diff(fp32, saved[0]["params"]) == 0.0

    for name, world, expect_native in (("same", 2, True), ("fewer", 1, False)):
        run = train(
            world,
            tmp_path / name,
            *native_on,
            f"scaling.num_workers={world}",
            f"checkpoint.resume={step_dir}",
            f"checkpoint.dir={tmp_path / name / 'ck'}",
        )
        restored = run[0]["result"]["restored"]
        assert (restored["step"], restored["native"]) == (2, expect_native)
        assert_matches(run, ddp, steps=slice(2, None))


def test_native_checkpoint_needs_the_zero_strategy():
    with pytest.raises(ConfigError, match=r"parallel.zero.native_checkpoint.*strategy=zero"):
        load_config(None, [*SMALL, "parallel.zero.native_checkpoint=true"])
