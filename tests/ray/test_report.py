"""The run report (plot + Markdown) from real training runs, and the MFU arithmetic."""

import json
import math

import pytest
import torch.nn as nn
from PIL import Image

from raytrain_ext import Trainer, load_config
from raytrain_ext.cli import main
from raytrain_ext.metrics.flops import matmul_params, mfu, model_flops_per_token, peak_flops_for
from raytrain_ext.models import build_model
from raytrain_ext.ops.report import load_run_config, render_markdown
from raytrain_ext.ops.report_plot import plot_run
from raytrain_ext.ops.run_series import recovery_phases
from tests.helpers.runs import tiny_overrides

_RUNS = {}
# The recovery of tests/ray/test_worker_group.py: rank 1 dies after step 7, restore from step 4.
RECOVERY = [
    "run.max_steps=12",
    "optim.decay_steps=12",
    "checkpoint.every_steps=4",
    "chaos.kill_rank=1",
    "chaos.kill_at_step=7",
    "elastic.max_failures=1",
    "checkpoint.memory=true",
    "elastic.state_from_peers=false",  # restore the checkpoint: steps are redone, and plotted
]
TOKENS_PER_STEP = 16 * 128  # the default global_batch_size x seq_len


@pytest.fixture()
def trained(ray_local, tmp_path_factory):
    """Run directories of real tiny trainings, each trained once per module."""

    def run(name, *extra):
        if name not in _RUNS:
            out = tmp_path_factory.mktemp("runs")
            Trainer(load_config(None, tiny_overrides(out, f"run.name={name}", *extra))).fit()
            _RUNS[name] = out / name
        return _RUNS[name]

    return run


def finite(values):
    return [v for v in values if not math.isnan(v)]


def last_good_step_end(summary, recovery):
    return max(t for _, t in summary["step_end_times"] if t <= recovery["detected_at"])


@pytest.mark.slow
@pytest.mark.chaos
def test_report_files_and_plot_of_a_run_with_a_recovery(trained, capsys):
    run_dir = trained("recovered", *RECOVERY)
    capsys.readouterr()  # the training's progress lines
    assert main(["report", str(run_dir)]) == 0
    written = f"wrote {run_dir / 'report.md'} and {run_dir / 'report.png'}"
    assert capsys.readouterr().out.strip() == written
    png = run_dir / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 30_000
    assert Image.open(png).size == (1100, 770)  # 10 x 7 in at 110 dpi

    summary = json.loads((run_dir / "summary.json").read_text())
    (recovery,) = summary["recoveries"]
    assert recovery["restored_from"] == "memory" and recovery["restored_step"] == 4
    ax_loss, ax_rate, ax_world = plot_run(summary, TOKENS_PER_STEP).axes
    loss, rate, world = ax_loss.get_lines()[0], ax_rate.get_lines()[0], ax_world.get_lines()[0]
    assert [line.get_label() for line in (loss, rate, world)] == ["loss", "tokens/s", "world size"]
    start = summary["started_at"]
    assert finite(loss.get_xdata()) == [t - start for _, t in summary["step_end_times"]]
    assert finite(loss.get_ydata()) == [v for _, v in summary["loss_history"]]
    assert len(finite(loss.get_ydata())) == 12 + 3  # 12 steps, steps 5-7 ran twice
    assert len(loss.get_ydata()) == 15 + 1  # one break, where the steps go back to 5
    assert finite(rate.get_ydata()) == pytest.approx(
        [TOKENS_PER_STEP / t for t in summary["step_times"]]
    )
    assert list(world.get_ydata()) == [2, 2, 2]  # formed, re-formed, end of run
    (detected,) = [line for line in ax_loss.get_lines() if line.get_gid() == "recovery-1"]
    assert detected.get_xdata()[0] == pytest.approx(recovery["detected_at"] - start)
    assert detected.get_label().startswith("recovery 1 at ")
    assert detected.get_label().endswith(recovery["reason"])
    (span,) = [p for p in ax_loss.patches if p.get_gid() == "recovery-1-span"]
    first_after = recovery["detected_at"] + recovery["first_step_after_s"] - start
    assert span.get_x() == pytest.approx(last_good_step_end(summary, recovery) - start)
    assert span.get_x() + span.get_width() == pytest.approx(first_after)


@pytest.mark.slow
@pytest.mark.chaos
def test_report_markdown_mttr_table_matches_the_summary(trained):
    run_dir = trained("recovered", *RECOVERY)
    assert main(["report", str(run_dir)]) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    (recovery,) = summary["recoveries"]
    detect = recovery["detected_at"] - last_good_step_end(summary, recovery)
    at = {(t["source"], t["target"]): t["at"] for t in summary["transitions"][1:]}
    reform = at[("SCHEDULING", "RUNNING")] - at[("RECOVERING", "SCHEDULING")]
    mttr = detect + recovery["first_step_after_s"]

    report = (run_dir / "report.md").read_text()
    (row,) = [line for line in report.splitlines() if line.startswith("| 1 |")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2] == recovery["reason"]
    assert (cells[3], cells[5], cells[6], cells[8]) == (
        f"{detect:.2f}",
        f"{reform:.2f}",
        f"{recovery['restore_s']:.2f}",
        f"{mttr:.2f}",
    )
    assert sum(float(c) for c in cells[3:8]) == pytest.approx(mttr, abs=0.03)  # phases add up
    assert cells[9:] == ["memory @ step 4", "3"]
    (mean,) = [line for line in report.splitlines() if line.startswith("| mean |")]
    assert f"| {mttr:.2f} |" in mean
    assert f"| goodput | {summary['goodput']:.3f} (time in kept steps / wall time" in report
    assert "| steps | 12 (15 step records, 3 redone) |" in report
    assert "| MFU | n/a: no accelerator peak in summary.json" in report
    assert "| RUNNING | RECOVERING |" in report
    assert "![loss and throughput over wall time](report.png)" in report
    phases = recovery["restore_phases"]  # where the recovery's restore spent its time
    (restore_row,) = [line for line in report.splitlines() if line.startswith("| recovery 1 |")]
    assert restore_row == "| recovery 1 | " + " | ".join(f"{v:.3f}" for v in phases.values()) + " |"
    assert phases["fetch_s"] > 0 and phases["read_s"] > 0  # from the memory tier
    assert sum(phases.values()) == pytest.approx(recovery["restore_s"], abs=0.05)
    split = recovery["phases"]  # every second from the last step's end to the first after
    (split_row,) = [line for line in report.splitlines() if line.startswith("| #1 |")]
    cells = [float(c) for c in split_row.strip("|").split("|")[1:]]
    assert cells[:-1] == pytest.approx(list(split.values()), abs=0.001)
    after_fault = (
        recovery["first_step_after_s"] + recovery["detected_at"] - recovery["last_step_at"]
    )
    assert cells[-1] == pytest.approx(after_fault, abs=0.002)  # the total: they add up


@pytest.mark.slow
def test_report_of_a_clean_run_and_mfu_with_a_known_device(trained, tmp_path):
    run_dir = trained("clean")
    summary = json.loads((run_dir / "summary.json").read_text())
    fig = plot_run(summary, TOKENS_PER_STEP)
    loss = fig.axes[0].get_lines()[0]
    assert list(loss.get_ydata()) == [v for _, v in summary["loss_history"]]
    assert len(loss.get_ydata()) == 6
    assert not [
        a
        for ax in fig.axes
        for a in [*ax.get_lines(), *ax.patches]
        if (a.get_gid() or "").startswith("recovery")
    ]
    cfg = load_run_config(run_dir)
    report = render_markdown(summary, cfg)
    assert "No failures." in report and "| steps | 6 (6 step records, 0 redone) |" in report
    on_h100 = {**summary, "device_name": "NVIDIA H100 80GB HBM3"}
    expected = summary["tokens_per_s"] * model_flops_per_token(cfg.model) / (989e12 * 2)
    assert f"| MFU | {expected:.1%} |" in render_markdown(on_h100, cfg)
    assert main(["report", str(run_dir), "--out", str(tmp_path / "elsewhere")]) == 0
    assert (tmp_path / "elsewhere" / "report.png").stat().st_size > 20_000


def test_missing_summary_names_the_argument_and_the_fix(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert (
        f"report failed: RUN_DIR {tmp_path}: no summary.json there; pass the run directory"
        in capsys.readouterr().err
    )


def test_recovery_that_never_resumed_reports_only_what_happened():
    summary = {
        "started_at": 100.0,
        "step_end_times": [[1, 101.0], [2, 102.0]],
        "recoveries": [{"reason": "worker rank 1 raised X", "detected_at": 102.5, "last_step": 2}],
        "transitions": [{"source": "RUNNING", "target": "RECOVERING", "at": 102.6, "reason": "x"}],
    }
    (phase,) = recovery_phases(summary)
    assert phase["at_s"] == 2.5 and phase["detect_s"] == 0.5
    assert [phase[k] for k in ("decide_s", "reform_s", "first_step_s", "mttr_s")] == [None] * 4


def tiny_model_cfg(*extra):
    return load_config(
        None,
        [
            "model.n_layers=2",
            "model.d_model=128",
            "model.n_heads=4",
            "model.seq_len=128",
            "model.vocab_size=256",
            *extra,
        ],
    ).model


def test_flops_per_token_by_hand():
    cfg = tiny_model_cfg()
    # per layer: attention 4 * 128^2 = 65536, MLP 2 * 128 * 512 = 131072; LM head 128 * 256
    assert matmul_params(cfg) == 2 * (65536 + 131072) + 32768 == 425984
    assert model_flops_per_token(cfg) == 6 * 425984 + 12 * 2 * 128 * 128 == 2949120
    model = build_model(cfg, seed=0)
    linear_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    assert matmul_params(cfg) == linear_weights  # N is what the real model multiplies through
    moe = tiny_model_cfg("model.moe.num_experts=4", "model.moe.top_k=2")
    # per layer: 2 of 4 experts (2 x 131072) + router 128 x 4
    assert matmul_params(moe) == 2 * (65536 + 2 * 131072 + 512) + 32768 == 689152


def test_mfu_and_peak_table():
    assert mfu(1e5, 2949120, 989e12, num_devices=2) == pytest.approx(1e5 * 2949120 / 1.978e15)
    assert mfu(1e5, 2949120, None) is None and mfu(None, 2949120, 312e12) is None
    names = {
        "NVIDIA H100 80GB HBM3": 989e12,
        "NVIDIA H100 PCIe": 756e12,
        "NVIDIA H100 NVL": 835e12,
        "NVIDIA H200": 989e12,
        "NVIDIA A100-SXM4-80GB": 312e12,
        "NVIDIA A100-PCIE-40GB": 312e12,
        "NVIDIA L4": 121e12,
        "NVIDIA L40S": 362e12,
        "NVIDIA A10": 125e12,
        "NVIDIA A10G": None,
        "cpu": None,
        None: None,
    }
    assert {name: peak_flops_for(name) for name in names} == names
    with pytest.raises(ValueError, match=r"peak_flops must be > 0 FLOP/s \(got 0\); pass None"):
        mfu(1e5, 1e6, 0)
    with pytest.raises(ValueError, match=r"num_devices must be >= 1 \(got 0\)"):
        mfu(1e5, 1e6, 1e12, num_devices=0)
