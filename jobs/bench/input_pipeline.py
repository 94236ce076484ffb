"""The input pipeline's cost in training: the share of each step rank 0 spends fetching its
micro-batches (``data_s`` of every step record, summed into ``data_time_share`` of
summary.json), for each data format, through the real CLI on 2 CPU workers.

Goal: <= 1% of step time.  The samples are memory-mapped and cut on the fly (text windows,
packed chat windows, preference pairs) by a prefetching thread (``data.prefetch``, on by
default); each case also runs with it off, in the same run, to show what it hides.  The
raw records are tokenized before step 1 (cached), so the steps see only
prepared data.  Usage: `python jobs/bench/input_pipeline.py [--steps 40] [--repeats 3]`.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CASES = {  # format -> config and overrides (the example configs, plus prepared text)
    "chat (sft)": ("configs/sft_llama_tiny.yaml", []),
    "preference (dpo)": ("configs/dpo_llama_tiny.yaml", []),
    "text (causal_lm)": (
        "configs/sft_llama_tiny.yaml",
        ["data.format=text", "objective.name=causal_lm", "data.text_column=prompt"],
    ),
}


def run_case(workdir: Path, config: str, overrides: list, steps: int, name: str) -> dict:
    cmd = [
        sys.executable,
        str(REPO / "jobs" / "train.py"),
        "--config",
        str(REPO / config),
        f"run.output_dir={workdir}",
        f"run.name={name}",
        f"run.max_steps={steps}",
        f"optim.decay_steps={steps}",
        "eval.every_steps=null",
        "checkpoint.enabled=false",
        "run.tensorboard=false",
        *overrides,
    ]
    subprocess.run(cmd, check=True, capture_output=True, cwd=REPO, timeout=900)
    summary = json.loads((workdir / name / "summary.json").read_text())
    return {
        "share": summary["data_time_share"],
        "median_step_ms": summary["median_step_time_s"] * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print("== Input pipeline cost (rank 0's batch fetch time / step time, 2 CPU workers)")
    for label, (config, overrides) in CASES.items():
        for prefetch in ("true", "false"):
            runs = []
            for r in range(args.repeats):
                with tempfile.TemporaryDirectory() as tmp:
                    extra = [*overrides, f"data.prefetch={prefetch}"]
                    runs.append(run_case(Path(tmp), config, extra, args.steps, f"ip{r}"))
            shares = [100 * x["share"] for x in runs]
            steps = [x["median_step_ms"] for x in runs]
            print(
                f"{label:<18} prefetch {prefetch:<5} data {min(shares):.2f}-{max(shares):.2f}% "
                f"of step time (median step {statistics.median(steps):.1f} ms; goal <= 1%)"
            )


if __name__ == "__main__":
    main()
