"""Step time and peak memory per worker for each parallel layout, same model and world size.

Every layout trains the same GPT with the same global batch through the real entrypoint
(`jobs/train.py`, one subprocess each, run one after the other), and the table shows the
median step time (warm-up steps dropped), tokens/s, rank 0's peak memory (the process's
peak resident set on CPU, peak CUDA allocation on GPU) and the ratio of each to DDP (the
MoE rows change the model: compare them with each other). A layout the framework refuses
(not supported yet, or impossible here) is listed with the config error instead of a number.

Usage: python jobs/bench/strategies.py [--steps 12] [--workers 2] [key=value ...]
On a GPU box: add `scaling.use_gpu=true` and a bigger model, e.g. `model.d_model=2048`.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

LAYOUTS = {  # name -> overrides; world size comes from --workers
    "ddp": ["parallel.strategy=ddp"],
    "fsdp": ["parallel.strategy=fsdp"],
    "fsdp+ac": ["parallel.strategy=fsdp", "parallel.activation_checkpointing=true"],
    "fsdp tp=2": ["parallel.strategy=fsdp", "parallel.tp=2"],
    "fsdp tp=2 sp": ["parallel.strategy=fsdp", "parallel.tp=2", "parallel.sequence_parallel=true"],
    "zero-1": ["parallel.strategy=zero", "parallel.zero.stage=1"],
    "zero-2": ["parallel.strategy=zero", "parallel.zero.stage=2"],
    "zero-3": ["parallel.strategy=zero", "parallel.zero.stage=3"],
    "pp=2 1f1b": ["parallel.pp=2", "parallel.pp_schedule=1f1b"],
    "pp=2 gpipe": ["parallel.pp=2", "parallel.pp_schedule=gpipe"],
    "moe ddp": ["model.moe.num_experts=4", "model.moe.top_k=2"],
    "moe ep=2": ["model.moe.num_experts=4", "model.moe.top_k=2", "parallel.ep=2"],
    "moe fsdp ep=2": [
        "model.moe.num_experts=4",
        "model.moe.top_k=2",
        "parallel.strategy=fsdp",
        "parallel.ep=2",
    ],
    "moe fsdp tp=2": [
        "model.moe.num_experts=4",
        "model.moe.top_k=2",
        "parallel.strategy=fsdp",
        "parallel.tp=2",
    ],
    "moe pp=2": ["model.moe.num_experts=4", "model.moe.top_k=2", "parallel.pp=2"],
}


def run_layout(workdir: Path, name: str, overrides: list) -> dict:
    run = name.replace(" ", "_").replace("=", "").replace("+", "_")
    cmd = [
        sys.executable,
        str(REPO / "jobs" / "train.py"),
        f"run.output_dir={workdir}",
        f"run.name={run}",
        "run.tensorboard=false",
        "checkpoint.enabled=false",
        *overrides,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=workdir, timeout=900)
    if done.returncode != 0:
        lines = [ln for ln in done.stderr.splitlines() if "error" in ln.lower()]
        return {"error": (lines[-1] if lines else done.stderr[-300:]).strip()[:150]}
    summary = json.loads((workdir / run / "summary.json").read_text())
    return {
        "step_s": summary["median_step_time_s"],
        "tokens_per_s": summary["tokens_per_s"],
        "peak_gb": summary["peak_memory_gb"],
        "loss": summary["final_loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--only", default=None, help="comma-separated layout names")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    common = [
        f"run.max_steps={args.steps}",
        f"optim.decay_steps={args.steps}",
        f"scaling.num_workers={args.workers}",
        "model.n_layers=4",
        "model.d_model=256",
        "data.global_batch_size=16",
        "data.micro_batch_size=4",
        *args.overrides,
    ]
    names = args.only.split(",") if args.only else list(LAYOUTS)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            results[name] = run_layout(Path(tmp), name, [*common, *LAYOUTS[name]])
            print(f"  {name}: {results[name]}", file=sys.stderr, flush=True)
    base = results.get("ddp", {})
    print(f"\n{args.workers} workers, {args.steps} steps; ratios are to DDP\n")
    print(
        f"{'layout':<15} {'step ms':>9} {'x ddp':>7} {'tokens/s':>10} {'peak GB':>8} "
        f"{'x ddp':>7} {'loss':>8}"
    )
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<15} n/a: {r['error']}")
            continue
        step_ratio = r["step_s"] / base["step_s"] if "step_s" in base else float("nan")
        mem_ratio = r["peak_gb"] / base["peak_gb"] if base.get("peak_gb") else float("nan")
        print(
            f"{name:<15} {r['step_s'] * 1e3:>9.1f} {step_ratio:>7.2f} {r['tokens_per_s']:>10.0f} "
            f"{r['peak_gb']:>8.3f} {mem_ratio:>7.2f} {r['loss']:>8.4f}"
        )


if __name__ == "__main__":
    main()
