"""The memory planner: known numbers, agreement with DeepSpeed, recommendations, CLI, errors."""

import json
import os
import re

import pytest

from raytrain_ext.cli import main
from raytrain_ext.config import load_config
from raytrain_ext.models import build_model
from raytrain_ext.ops.plan import Cluster, ModelShape, PlanError, Settings, count_params, make_plan
from raytrain_ext.ops.plan.memory import (
    Layout,
    activations,
    bytes_per_param,
    host_bytes_per_node,
    layer_activation_bytes,
    model_states,
)
from raytrain_ext.ops.plan.shape import ParamCounts, shape_from_config

GB = 1e9
GIB = 2**30


def shape(layers, hidden, heads, vocab=50304, seq=2048, **kw):
    return ModelShape(
        n_layers=layers, d_model=hidden, n_heads=heads, vocab_size=vocab, seq_len=seq, **kw
    )


LLAMA70_LIKE = shape(80, 8192, 64, vocab=128256, seq=4096)


def plan_for(model, nodes=1, gpn=8, mem=80.0, host=1024.0, micro=1, seq=None, **kw):
    cluster = Cluster(nodes=nodes, gpus_per_node=gpn, gpu_mem_gib=mem, host_mem_gib=host)
    return make_plan(
        model, cluster, Settings(micro_batch=micro, seq_len=seq or model.seq_len), **kw
    )


# --- model states -------------------------------------------------------------------------------


def test_zero_paper_example_7_5b_on_64_gpus():
    """Rajbhandari et al. Figure 1: Ψ=7.5B, Nd=64, K=12."""
    counts = ParamCounts(total=7_500_000_000, expert=0, largest_module=0, largest_fsdp_unit=0)
    bpp = bytes_per_param("bf16", "pytorch")
    per_device = {
        stage: model_states(counts, Layout("x", dp=64, zero_stage=stage), bpp).total / GB
        for stage in (0, 1, 2, 3)
    }
    assert round(per_device[0], 1) == 120.0
    assert round(per_device[1], 1) == 31.4
    assert round(per_device[2], 1) == 16.6
    assert round(per_device[3], 1) == 1.9
    assert bpp.total == 16


def test_cpu_offload_keeps_optimizer_and_gradient_shards_in_host_ram():
    counts = ParamCounts(total=1_000_000_000, expert=0, largest_module=0, largest_fsdp_unit=0)
    states = model_states(
        counts,
        Layout("x", dp=8, zero_stage=3, offload_optimizer=True, offload_params=True),
        bytes_per_param("bf16", "pytorch"),
    )
    assert states.total == 0
    assert states.host_offload_per_rank == pytest.approx(
        (12 + 2 + 2) * 1e9 / 8
    )  # opt + grad16 + param16
    host = host_bytes_per_node(states, counts, 8, meta_init=True, buffer_factor=1.0)
    assert host["offload"] == pytest.approx(16e9)


# --- agreement with DeepSpeed's estimators ---------------------------------------------------------


@pytest.fixture(scope="module")
def deepspeed_estimators():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    stage2 = pytest.importorskip(
        "deepspeed.runtime.zero.stage_1_and_2", reason="deepspeed is not importable"
    )
    stage3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
    return stage2, stage3


SIZES = [
    shape(12, 768, 12),
    shape(24, 2048, 16),
    shape(32, 4096, 32),
    LLAMA70_LIKE,
    shape(12, 1024, 16, num_experts=8, top_k=2),
]
HARDWARE = [(1, 1), (8, 1), (4, 2), (8, 16)]


def ours(counts, gpn, nodes, stage, offload_opt, offload_params=False, meta_init=False):
    layout = Layout(
        "x",
        dp=gpn * nodes,
        zero_stage=stage,
        offload_optimizer=offload_opt,
        offload_params=offload_params,
        engine="deepspeed",
    )
    states = model_states(counts, layout, bytes_per_param("bf16", "deepspeed"))
    host = host_bytes_per_node(states, counts, gpn, meta_init, 1.5)
    # With offload and zero_init DeepSpeed counts only the offloaded states, not the model-init transient.
    return host["offload" if offload_opt and meta_init else "total"], states.total


@pytest.mark.parametrize("model", SIZES, ids=lambda s: f"L{s.n_layers}h{s.d_model}e{s.num_experts}")
@pytest.mark.parametrize("gpn,nodes", HARDWARE)
def test_agrees_with_deepspeed_zero2_estimator(deepspeed_estimators, model, gpn, nodes):
    stage2, _ = deepspeed_estimators
    counts = count_params(model)
    for offload in (True, False):
        ds_cpu, ds_gpu = stage2.estimate_zero2_model_states_mem_needs(
            counts.total, num_gpus_per_node=gpn, num_nodes=nodes, cpu_offload=offload
        )
        cpu, gpu = ours(counts, gpn, nodes, 2, offload)
        assert gpu == pytest.approx(ds_gpu, rel=0.05)
        if (
            nodes == 1 or not offload
        ):  # DeepSpeed's multi-node offload host figure does not divide by nodes
            assert cpu == pytest.approx(ds_cpu, rel=0.05)


@pytest.mark.parametrize("model", SIZES, ids=lambda s: f"L{s.n_layers}h{s.d_model}e{s.num_experts}")
@pytest.mark.parametrize("gpn,nodes", HARDWARE)
def test_agrees_with_deepspeed_zero3_estimator(deepspeed_estimators, model, gpn, nodes):
    _, stage3 = deepspeed_estimators
    counts = count_params(model)
    for offload_opt, offload_params in ((True, True), (True, False), (False, False)):
        for zero_init in (True, False):
            ds_cpu, ds_gpu, _ = stage3.estimate_zero3_model_states_mem_needs(
                counts.total,
                counts.largest_module,
                num_gpus_per_node=gpn,
                num_nodes=nodes,
                cpu_offload=offload_opt,
                cpu_offload_params=offload_params,
                zero_init=zero_init,
            )
            cpu, gpu = ours(counts, gpn, nodes, 3, offload_opt, offload_params, meta_init=zero_init)
            assert gpu == pytest.approx(ds_gpu, rel=0.05)
            assert cpu == pytest.approx(ds_cpu, rel=0.05)


def _printed_rows(capsys):
    rows = re.findall(r"^\s*([\d.]+)GB \|\s*([\d.]+)GB \| (.+)$", capsys.readouterr().out, re.M)

    def key(
        options,
    ):  # "offload_param=OffloadDeviceEnum.cpu" or "cpu " depending on Python -> "cpu"
        pairs = (item.split("=") for item in options.split(","))
        return ",".join(f"{k.strip()}={'cpu' if 'cpu' in v else v.strip()}" for k, v in pairs)

    return {key(options): (float(cpu), float(gpu)) for cpu, gpu, options in rows}


def test_matches_the_all_cold_printouts(deepspeed_estimators, capsys):
    stage2, stage3 = deepspeed_estimators
    counts = count_params(shape(32, 4096, 32))
    stage2.estimate_zero2_model_states_mem_needs_all_cold(
        counts.total, num_gpus_per_node=8, num_nodes=1
    )
    rows = _printed_rows(capsys)
    cpu, gpu = ours(counts, 8, 1, 2, offload_opt=False)
    assert rows["offload_optimizer=none"] == pytest.approx((cpu / GIB, gpu / GIB), rel=0.05)
    stage3.estimate_zero3_model_states_mem_needs_all_cold(
        counts.total, counts.largest_module, num_gpus_per_node=8, num_nodes=2
    )
    rows = _printed_rows(capsys)
    cpu, gpu = ours(counts, 8, 2, 3, True, True, meta_init=True)
    assert rows["offload_param=cpu,offload_optimizer=cpu,zero_init=1"] == pytest.approx(
        (cpu / GIB, gpu / GIB), rel=0.05
    )


# --- parameter counts against the real model -----------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["model.mlp_ratio=2", "model.n_layers=3"],
        ["model.moe.num_experts=4", "model.moe.top_k=2"],
    ],
)
def test_param_count_is_exact_against_the_real_model(deepspeed_estimators, overrides):
    cfg = load_config(None, overrides)
    model = build_model(cfg.model, seed=0)
    counts = count_params(shape_from_config(cfg.model))
    assert counts.total == sum(p.numel() for p in model.parameters())
    total, largest = deepspeed_estimators[1].model_to_params(model)
    assert (counts.total, counts.largest_module) == (total, largest)
    expert = sum(p.numel() for n, p in model.named_parameters() if ".w_up" in n or ".w_down" in n)
    assert counts.expert == expert


# --- activations -------------------------------------------------------------------------------


def test_activations_follow_korthikanti():
    m = shape(1, 4096, 32, seq=2048)
    s, b, h, a = 2048, 2, 4096, 32
    eager = layer_activation_bytes(m, b, s, tp=1, flash_attention=False)
    assert eager == s * b * h * (34 + 5 * a * s / h)
    assert layer_activation_bytes(m, b, s, tp=8, flash_attention=False) == eager / 8
    assert layer_activation_bytes(m, b, s, tp=1) == 34 * s * b * h  # flash: no a*s^2 scores
    full = activations(m, b, s, tp=1, pp=1, recompute=True)
    assert full.stored_layers == 2 * s * b * h
    assert full.recompute_working == 34 * s * b * h


def test_pipelining_does_not_shrink_first_stage_activations():
    one = activations(LLAMA70_LIKE, 1, 4096, tp=8, pp=1, recompute=False)
    four = activations(LLAMA70_LIKE, 1, 4096, tp=8, pp=4, recompute=False)
    assert four.stored_layers == one.stored_layers


# --- recommendations ---------------------------------------------------------------------------


def test_350m_gets_ddp():
    plan = plan_for(shape(24, 1024, 16))
    assert 3.0e8 < plan.counts.total < 4.5e8
    assert plan.recommended.layout.name == "DDP"
    assert plan.rule_held


def test_7b_on_one_node_of_80gb_gets_fsdp():
    plan = plan_for(shape(32, 4096, 32))
    rec = plan.recommended
    assert rec.layout.zero_stage == 3 and rec.layout.name.startswith("FSDP")
    ddp = next(ev for ev in plan.rows if ev.layout.name == "DDP")
    assert not ddp.fits and ddp.states.total / GIB > 100  # 16 B/param x 6.9B
    assert any("ZeRO-1 also fits" in n for n in plan.notes)


def test_70b_on_8_nodes_gets_tensor_parallel_within_a_node():
    plan = plan_for(LLAMA70_LIKE, nodes=8)
    lay = plan.recommended.layout
    assert lay.tp == 8 and lay.tp <= 8 and lay.dp * lay.pp == 8
    rejected = " ".join(ev.rejection() for ev in plan.rejected)
    assert "TP=2" in rejected and "over the 68.0 GiB usable" in rejected


def test_405b_class_on_32_nodes_gets_tp8_times_pp_times_dp():
    plan = plan_for(shape(128, 16384, 128, vocab=128256, seq=4096), nodes=32)
    lay = plan.recommended.layout
    assert (lay.tp, lay.pp > 1, lay.dp > 1) == (8, True, True)
    assert lay.tp * lay.pp * lay.dp == 256
    assert any("pipelining shrinks model states, not activations" in n for n in plan.notes)


def test_moe_gets_expert_parallelism():
    plan = plan_for(shape(24, 2048, 16, num_experts=8, top_k=2), nodes=2)
    assert plan.recommended.layout.ep == 8
    assert "EP=8" in plan.recommended.layout.split()
    assert any(n.startswith("MoE:") and "EP=8" in n for n in plan.notes)


def test_70b_on_one_gpu_needs_offload_and_host_memory():
    small_host = plan_for(LLAMA70_LIKE, gpn=1, host=512, seq=2048)
    assert small_host.recommended is None
    note = next(n for n in small_host.notes if "ZeRO-3 trains a" in n)
    assert "one GPU" in note and "shards nothing" in note and "NVMe" in note
    big_host = plan_for(LLAMA70_LIKE, gpn=1, host=4096, seq=2048)
    assert big_host.recommended.layout.name == "ZeRO-3 + CPU offload (optimizer+params)"
    assert big_host.recommended.host["offload"] / GIB > 1000


def test_requested_split_is_evaluated():
    plan = plan_for(LLAMA70_LIKE, nodes=8, split=(4, 2, None))
    row = next(ev for ev in plan.rows if (ev.layout.tp, ev.layout.pp) == (4, 2))
    assert row.layout.dp == 8
    assert any(n.startswith("Requested split TP=4 x PP=2 x DP=8") for n in plan.notes)


# --- CLI ---------------------------------------------------------------------------------------


def test_cli_json_is_parseable(capsys):
    rc = main(
        [
            "plan",
            "--params",
            "7e9",
            "--gpus-per-node",
            "8",
            "--gpu-mem-gb",
            "80",
            "--nodes",
            "1",
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert out["model"]["params_total"] == 7_000_000_000 and out["model"]["inferred"] is True
    assert out["recommended"]["strategy"] == "FSDP (full shard)"
    ddp = next(r for r in out["strategies"] if r["strategy"] == "DDP")
    assert ddp["per_gpu_gib"]["model_states"] == pytest.approx(16 * 7e9 / GIB, abs=0.01)
    assert ddp["fits"] is False


def test_cli_reads_a_config(capsys):
    rc = main(
        [
            "plan",
            "--config",
            "configs/gpt_1b_2x8gpu.yaml",
            "--nodes",
            "2",
            "--gpus-per-node",
            "8",
            "--gpu-mem-gb",
            "80",
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert (out["model"]["n_layers"], out["settings"]["micro_batch"]) == (24, 8)
    assert out["cluster"]["gpus"] == 16 and out["recommended"]["fits"]


def test_cli_text_lists_every_strategy(capsys):
    assert (
        main(
            [
                "plan",
                "--layers",
                "80",
                "--hidden",
                "8192",
                "--heads",
                "64",
                "--vocab",
                "128256",
                "--seq",
                "4096",
                "--nodes",
                "8",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    for name in (
        "DDP",
        "ZeRO-1",
        "ZeRO-2 + CPU offload",
        "ZeRO-3 + CPU offload (optimizer+params)",
        "FSDP (full shard)",
        "HSDP",
        "TP x DP (ZeRO-1) [TP=8 x PP=1 x DP=8]",
        "Chosen:",
    ):
        assert name in text


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--params", "7e9", "--tp", "3"], "--tp 3 x --pp 1 = 3 does not divide the 8 GPUs"),
        (
            ["--layers", "4", "--hidden", "96", "--heads", "6", "--tp", "4"],
            "--tp 4 does not divide the 6 attention heads",
        ),
        (
            ["--layers", "6", "--hidden", "64", "--heads", "4", "--pp", "4"],
            "--pp 4 does not divide the 6 layers",
        ),
        (
            ["--layers", "4", "--hidden", "100", "--heads", "8"],
            "--hidden 100 is not divisible by --heads 8",
        ),
        (
            ["--layers", "4", "--hidden", "64", "--heads", "4", "--ep", "2"],
            "--ep 2 needs a mixture-of-experts",
        ),
        (["--params", "7e9", "--gpu-mem-gb", "-80"], "--gpu-mem-gb must be a positive"),
        (["--params", "-1"], "--params must be a positive"),
        (["--params", "7e9", "--nodes", "0"], "--nodes must be a positive integer"),
        (["--params", "7e9", "--headroom", "1.5"], "--headroom"),
        (["--params", "7e9", "--layers", "4"], "either --params or --layers"),
        (["--layers", "4", "--hidden", "64"], "--heads missing"),
        ([], "describe the model"),
        (["--config", "configs/gpt_1b_2x8gpu.yaml", "--seq", "4096"], "exceeds model.seq_len 2048"),
    ],
)
def test_cli_rejects_invalid_input(capsys, argv, message):
    assert main(["plan", *argv]) == 2
    assert message in capsys.readouterr().err


def test_plan_error_is_a_value_error():
    with pytest.raises(PlanError, match="--micro-batch"):
        plan_for(shape(2, 64, 4), micro=0)
