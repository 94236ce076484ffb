"""``raytrain-ext report RUN_DIR``: a plot and a Markdown summary of a finished (or failed) run.

Reads ``summary.json`` (written by ``Trainer.fit``, also for failed runs) and,
when present, the resolved ``config.yaml`` next to it, and writes
``report.png`` (loss and throughput over wall time, world size, recoveries)
and ``report.md`` (status, loss, throughput, goodput, MFU, and the time to
recover from each failure, split into phases).

Every figure comes from the summary; nothing is re-measured.  Times on the
plot are seconds since ``started_at``.  The records of steps that a recovery
redid stay in the series: the plot shows what the cluster did, the loss
dropping back to the checkpoint and training again.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from raytrain_ext.metrics.attempts import attempt_rows, attempts_section, failed
from raytrain_ext.metrics.flops import mfu, model_flops_per_token, peak_flops_for
from raytrain_ext.ops.report_plot import plot_run
from raytrain_ext.ops.run_series import recovery_phases

PHASES = ("detect_s", "decide_s", "reform_s", "restore_s", "first_step_s", "mttr_s")
PHASE_TITLES = ("detect", "stop + decide", "re-form", "restore", "first step", "MTTR")


def load_summary(run_dir: Path) -> Dict[str, Any]:
    path = Path(run_dir) / "summary.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"RUN_DIR {run_dir}: no summary.json there; pass the run "
            "directory <run.output_dir>/<run.name> of a run that "
            "`raytrain-ext train` started"
        )
    return json.loads(path.read_text())


def load_run_config(run_dir: Path):
    """The run's resolved config, or None when config.yaml is missing or no longer loads."""
    from raytrain_ext.config import ConfigError, load_saved_config

    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return None
    try:
        return load_saved_config(path)
    except ConfigError:
        return None


def run_mfu(summary: Dict[str, Any], cfg) -> tuple:
    """(MFU or None, why it is n/a).  Peak from summary ``peak_flops`` or ``device_name``."""
    if summary.get("mfu") is not None:
        return summary["mfu"], ""
    peak = summary.get("peak_flops") or peak_flops_for(summary.get("device_name"))
    if peak is None:
        return None, "no accelerator peak in summary.json: a CPU run or an unknown device"
    if cfg is None:
        return None, "config.yaml missing: model shape unknown"
    history = summary.get("world_size_history") or [{"world_size": 1}]
    value = mfu(
        summary.get("tokens_per_s"),
        model_flops_per_token(cfg.model),
        peak,
        num_devices=history[-1]["world_size"],
    )
    return value, "" if value is not None else "no throughput in summary.json"


def render_markdown(
    summary: Dict[str, Any],
    cfg=None,
    image: Optional[str] = "report.png",
    attempts: Optional[List[Dict[str, Any]]] = None,
) -> str:
    """The Markdown report; every number is read from (or derived from) ``summary``, and
    ``attempts`` (``metrics.attempts.attempt_rows``) lists every ``fit()`` of the run."""
    attempts = attempts or []
    lines = [f"# Run report: {summary.get('run_name', '?')}", ""]
    if image:
        lines += [f"![loss and throughput over wall time]({image})", ""]
    lines += ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in _overview(summary, cfg))]
    if summary.get("error"):
        lines += ["", "Error:", "", "```", summary["error"].strip(), "```"]
    lines += ["", *_recovery_section(recovery_phases(summary), failed(attempts))]
    lines += ["", *attempts_section(attempts)] if attempts else []
    lines += ["", *_restore_section(summary), *_recovery_split_section(summary)]
    lines += [
        "",
        "## State transitions",
        "",
        "| at (s) | from | to | reason |",
        "|---|---|---|---|",
    ]
    start = summary["started_at"]
    lines += [
        f"| {t['at'] - start:.2f} | {t['source']} | {t['target']} | {_cell(t['reason'])} |"
        for t in summary.get("transitions", [])
    ]
    return "\n".join(lines) + "\n"


def _phases_line(phases: Dict[str, float]) -> str:
    """Where a median step's time goes (``train.step_clock``), largest first, in ms."""
    if not phases:
        return "n/a (no step records with phases)"
    ranked = sorted(phases.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{name} {seconds * 1e3:.1f} ms" for name, seconds in ranked)


def _start_line(phases: Dict[str, float]) -> str:
    """Where the time to the first step went (``metrics.start_phases``), in its order."""
    if not phases:
        return "n/a (no step records)"
    return ", ".join(f"{name} {seconds:.2f} s" for name, seconds in phases.items())


def _eval_line(history: List[Dict[str, Any]]) -> str:
    if not history:
        return "none (eval.every_steps)"
    last = history[-1]
    fields = ", ".join(f"{k[len('eval_') :]} {v:.4f}" for k, v in last.items() if k != "step")
    return f"{len(history)} evaluations; at step {last['step']}: {fields}"


def _overview(summary: Dict[str, Any], cfg) -> List[tuple]:
    history = summary.get("loss_history", [])
    redone = len(history) - len({step for step, _ in history})
    mfu_value, why = run_mfu(summary, cfg)
    sizes = " -> ".join(str(e["world_size"]) for e in summary.get("world_size_history", []))
    goodput = summary.get("goodput")
    return [
        ("status", summary.get("status")),
        (
            "steps",
            f"{summary.get('steps_completed', 0)} ({len(history)} step records, {redone} redone)",
        ),
        (
            "wall time",
            f"{summary['wall_time_s']:.2f} s (first step after "
            f"{_num(summary.get('time_to_first_step_s'))} s)",
        ),
        ("start", _start_line(summary.get("start_phases_s") or {})),
        ("loss", f"{_num(summary.get('first_loss'), 4)} -> {_num(summary.get('final_loss'), 4)}"),
        ("evaluation", _eval_line(summary.get("eval_history", []))),
        (
            "throughput",
            f"{_num(summary.get('tokens_per_s'), 0)} tokens/s (steady state, all "
            f"ranks); median step {_num(summary.get('median_step_time_s'), 4)} s",
        ),
        ("step phases", _phases_line(summary.get("step_phases_s") or {})),
        (
            "goodput",
            f"{_num(goodput, 3)} (time in kept steps / wall time: the last run of "
            "each step counts, redone steps and all setup, checkpoint and recovery "
            "time do not)",
        ),
        ("MFU", f"{mfu_value:.1%}" if mfu_value is not None else f"n/a: {why}"),
        ("world size", sizes or "n/a"),
        ("checkpoint stall", f"{_num(summary.get('checkpoint_stall_s'), 3)} s"),
        (
            "backend",
            f"{summary.get('backend')}, torch {summary.get('versions', {}).get('torch')}, "
            f"ray {summary.get('versions', {}).get('ray')}",
        ),
        ("newest usable checkpoint", newest_local_checkpoint(cfg)),
    ]


def newest_local_checkpoint(cfg) -> str:
    """The step a resume would load from local disk now, by the same routine the restore
    and ``ckpt export`` use, with the newer steps it would skip and why."""
    if cfg is None or not (cfg.checkpoint.enabled and cfg.checkpoint.local):
        return "n/a (no local checkpoint tier in config.yaml)"
    from raytrain_ext.checkpoint.resolve import newest_usable
    from raytrain_ext.checkpoint.tiers.disk import DiskTier

    found = newest_usable(DiskTier(cfg.checkpoint.dir))
    text = (
        f"step {found.step} in {cfg.checkpoint.dir}"
        if found.step is not None
        else f"none in {cfg.checkpoint.dir}"
    )
    return text + "".join(f"; skipped {problem}" for problem in found.skipped)


def _restore_section(summary: Dict[str, Any]) -> List[str]:
    """Where each restore spent its time (rank 0's ``checkpoint/phases.py`` record)."""
    named = [("start", (summary.get("restored") or {}).get("phases"))]
    named += [
        (f"recovery {i}", r.get("restore_phases"))
        for i, r in enumerate(summary.get("recoveries", []), 1)
    ]
    rows = [(name, phases) for name, phases in named if isinstance(phases, dict) and phases]
    if not rows:
        return ["## Restores", "", "No checkpoint was restored."]
    return _phase_table("Restores", "Seconds on rank 0, by phase.", "restore", rows)


def _recovery_split_section(summary: Dict[str, Any]) -> List[str]:
    """Each recovery from the last step's end to the first step's end, by the record's
    phases (``elastic.records.RECOVERY_PHASES``; they add up to the total)."""
    rows = [
        (f"#{i}", {**r["phases"], "total": sum(r["phases"].values())})
        for i, r in enumerate(summary.get("recoveries", []), 1)
        if r.get("phases")
    ]
    if not rows:
        return []
    caption = (
        "Seconds from the last step's end before the fault to the first step's end after "
        "it (the fault lies in detect; rank 0's moments from dispatch on)."
    )
    return ["", *_phase_table("Recovery phases", caption, "recovery", rows)]


def _phase_table(title: str, caption: str, what: str, rows: List[tuple]) -> List[str]:
    names = list(rows[0][1])
    lines = [
        f"## {title}",
        "",
        caption,
        "",
        f"| {what} | " + " | ".join(n.removesuffix("_s") for n in names) + " |",
        "|---|" + "---|" * len(names),
    ]
    lines += [
        f"| {name} | " + " | ".join(_num(phases.get(n), 3) for n in names) + " |"
        for name, phases in rows
    ]
    return lines


def _recovery_section(phases: List[Dict[str, Any]], failed_attempts: List[int]) -> List[str]:
    lines = ["## Recoveries (MTTR)", ""]
    if not phases and failed_attempts:
        shown = ", ".join(str(a) for a in failed_attempts)
        return lines + [f"No recoveries in this attempt; attempt(s) {shown} failed (Attempts)."]
    if not phases:
        return lines + ["No failures."]
    lines += [
        "Seconds. detect: last good step -> failure detected; stop + decide: survivors "
        "stopped and capacity settled; re-form: new group placed and rendezvoused; "
        "restore: checkpoint loaded; first step: worker setup and the first step after "
        "the re-form; MTTR: the sum, last good step -> first new step.",
        "",
        "| # | at (s) | reason | " + " | ".join(PHASE_TITLES) + " | restored | redone |",
        "|---|---|---|" + "---|" * len(PHASES) + "---|---|",
    ]
    for i, p in enumerate(phases, 1):
        restored = (
            f"{p['restored_from']} @ step {p['restored_step']}"
            if p["restored_from"]
            else "from scratch"
            if p["restored_step"] == 0
            else "n/a"
        )
        lines.append(
            f"| {i} | {p['at_s']:.2f} | {_cell(p['reason'])} | "
            + " | ".join(_num(p[k]) for k in PHASES)
            + f" | {restored} | {_num(p['steps_redone'], 0)} |"
        )
    means = [_mean([p[k] for p in phases]) for k in PHASES]
    lines.append("| mean | | | " + " | ".join(_num(m) for m in means) + " | | |")
    return lines


def _mean(values: List[Optional[float]]) -> Optional[float]:
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if known else None


def _num(value: Optional[float], digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def write_report(run_dir: Path, out_dir: Optional[Path] = None) -> Dict[str, Path]:
    """Write report.png and report.md into ``out_dir`` (default: the run directory)."""
    run_dir = Path(run_dir)
    out_dir = Path(out_dir) if out_dir else run_dir
    summary = load_summary(run_dir)
    cfg = load_run_config(run_dir)
    tokens_per_step = cfg.data.global_batch_size * cfg.model.seq_len if cfg is not None else None
    out_dir.mkdir(parents=True, exist_ok=True)
    png, md = out_dir / "report.png", out_dir / "report.md"
    plot_run(summary, tokens_per_step).savefig(png, dpi=110)
    md.write_text(render_markdown(summary, cfg, image=png.name, attempts=attempt_rows(run_dir)))
    return {"png": png, "markdown": md}


def _report_command(args: argparse.Namespace) -> int:
    from raytrain_ext.storage.paths import writable_dir_problem

    problem = writable_dir_problem(
        Path(args.out or args.run_dir), "--out" if args.out else "RUN_DIR"
    )
    if problem and Path(args.run_dir).is_dir():
        print(f"report failed: {problem}", file=sys.stderr)
        return 2
    try:
        paths = write_report(Path(args.run_dir), Path(args.out) if args.out else None)
    except (FileNotFoundError, json.JSONDecodeError, KeyError) as e:
        print(f"report failed: {e}", file=sys.stderr)
        return 2
    print(f"wrote {paths['markdown']} and {paths['png']}")
    return 0


def add_parser(commands) -> None:
    """``raytrain-ext report RUN_DIR [--out DIR]``."""
    report = commands.add_parser("report", help="plot and summarise a run from its summary.json")
    report.add_argument("run_dir", metavar="RUN_DIR", help="<run.output_dir>/<run.name>")
    report.add_argument("--out", default=None, help="output directory (default: RUN_DIR)")
    report.set_defaults(func=_report_command)
