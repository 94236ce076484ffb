"""Sweep the learning rate with Ray Tune, one elastic training run per trial.

    python examples/tune_lr.py --lr 1e-3,3e-3,1e-2 run.max_steps=50

Run from the repository root. Attaches to RAY_ADDRESS when set, else starts a local
Ray. Each trial's run directory is <run.output_dir>/<run.name>-<trial id>/ (summary.json
etc.); Tune's own records go to <run.output_dir>/lr-sweep/.
"""

import argparse
import os
import sys
from pathlib import Path

import ray
from ray import tune

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from raytrain_ext import load_config  # noqa: E402
from raytrain_ext.tune import concurrent_trials, training_trial  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny_cpu.yaml")
    parser.add_argument("--lr", default="1e-3,3e-3,1e-2", help="comma-separated learning rates")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()

    output_dir = Path(load_config(args.config, args.overrides).run.output_dir).absolute()
    ray.init(address=os.environ.get("RAY_ADDRESS"))
    tuner = tune.Tuner(
        training_trial(args.config, args.overrides),
        param_space={"optim.lr": tune.grid_search([float(lr) for lr in args.lr.split(",")])},
        tune_config=tune.TuneConfig(
            metric="final_loss",
            mode="min",
            max_concurrent_trials=concurrent_trials(args.config, args.overrides),
        ),
        run_config=tune.RunConfig(name="lr-sweep", storage_path=str(output_dir), verbose=0),
    )
    results = tuner.fit()
    for result in sorted(results, key=lambda r: r.config["optim.lr"]):
        m = result.metrics
        print(
            f"lr {result.config['optim.lr']:.0e}  {m.get('status')}  "
            f"steps {m.get('steps_completed')}  "
            f"final_loss {m.get('final_loss', float('nan')):.4f}  {m.get('run_dir')}"
        )
    best = results.get_best_result()
    print(f"best: lr {best.config['optim.lr']:.0e} (final_loss {best.metrics['final_loss']:.4f})")


if __name__ == "__main__":
    main()
