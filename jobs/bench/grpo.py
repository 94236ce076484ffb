"""GRPO throughput: raytrain-ext against TRL's ``GRPOTrainer``, same model, prompts and settings.

Both train the same Llama-family model (random init from an inline config, ``--size``) on the
prompts of ``configs/data/dpo_tiny.jsonl`` with TRL's quick-start reward (``reward_len``),
``num_generations`` 8, 4 prompt groups (32 completions) per optimizer step,
``max_completion_length`` ``--completion``, temperature 1, AdamW at the same learning rate:
(a) raytrain-ext through its real CLI (``configs/grpo_tiny.yaml``): one trainer rank and
``--engines`` rollout engines, Ray actors (on-policy: an engine generates step t+1 once step
t's weights are in); (b) TRL 1.16's ``GRPOTrainer`` in one process (``model.generate`` in
the trainer's process, as TRL does without vLLM), on the CPU.  Each is its own command,
alternating, ``--repeats`` times.

Printed per run: the median step time (steps 3 on; raytrain-ext's first rollout is
generated before step 1), completions per second, and raytrain-ext's split of a step (the
service's wait for the weights, generation, reward) beside it; then the ratio of the
throughputs.  CPU only; both get the whole machine.

``--overlap`` runs ours with ``rollout.overlap=true`` (step t+1 generated while step t
updates, one step off-policy).  ``--kill-engine-at N`` SIGKILLs one of our engines once step
N is recorded and prints the slowest step against the median (every anchor stops or
restarts at such a loss); ``--spare-engines N`` keeps N warm engines for that.

Usage: python jobs/bench/grpo.py [--size tiny|small] [--steps 15] [--repeats 2]
       [--engines 1] [--completion 32] [--kill-engine-at 6] [--overlap] [--spare-engines 1]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[2]
PROMPTS = REPO / "configs" / "data" / "dpo_tiny.jsonl"
TOKENIZER = REPO / "configs" / "data" / "tiny-tokenizer"
SIZES = {  # hidden, intermediate, layers, heads, kv heads
    "tiny": (64, 128, 2, 4, 2),
    "small": (256, 512, 4, 4, 2),
}
GENERATIONS, GROUPS, LR, SKIP = 8, 4, 1e-3, 2
ENV = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "HF_HUB_OFFLINE": "1"}


def architecture(size: str) -> Dict:
    hidden, inter, layers, heads, kv_heads = SIZES[size]
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": 128,
        "max_position_embeddings": 256,
    }


def engine_pids() -> List[int]:
    """The rollout engines' processes on this machine that run a call (Ray titles an
    actor's process ``ray::EngineActor``, and ``ray::EngineActor.generate`` while it
    generates): a spare waiting idle is not among them."""
    import psutil

    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        if any("EngineActor." in part for part in process.info["cmdline"] or []):
            found.append(process.info["pid"])
    return found


def kill_an_engine(metrics: Path, at_step: int, run: subprocess.Popen) -> float:
    """SIGKILL one engine once the run has recorded ``at_step``; when (time.time())."""
    while run.poll() is None:
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        busy = engine_pids() if len(lines) >= at_step else []
        if busy:
            os.kill(busy[0], signal.SIGKILL)
            return time.time()
        time.sleep(0.01)
    raise RuntimeError("the run ended before an engine could be killed")


def run_ours(args, out: Path) -> Dict:
    inline = json.dumps(architecture(args.size)).replace('"', "")
    command = [
        sys.executable, "-m", "raytrain_ext", "train", "--config",
        str(REPO / "configs" / "grpo_tiny.yaml"),
        f"run.output_dir={out}", "run.name=ours", f"run.max_steps={args.steps}",
        "run.tensorboard=false", f"run.log_every={args.steps}", f"model.hf.config={inline}",
        f"data.global_batch_size={GROUPS}", f"data.micro_batch_size={GROUPS}",
        f"objective.grpo.max_completion_length={args.completion}", f"optim.lr={LR}",
        "optim.warmup_steps=0", "scaling.num_workers=1", f"rollout.engines={args.engines}",
        f"rollout.groups_per_call={GROUPS // args.engines}",
        "checkpoint.enabled=false", f"rollout.overlap={str(args.overlap).lower()}",
        f"rollout.spare_engines={args.spare_engines}",
    ]  # fmt: skip
    started = time.time()
    metrics = out / "ours" / "metrics.jsonl"
    run = subprocess.Popen(command, env=ENV, cwd=REPO, stdout=subprocess.DEVNULL)
    if args.kill_engine_at:
        kill_an_engine(metrics, args.kill_engine_at, run)
    if run.wait() != 0:
        raise RuntimeError(f"raytrain-ext exited with {run.returncode}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()][SKIP:]
    phases = {
        p: statistics.median(r[f"rollout_{p}_s"] for r in records)
        for p in ("wait_weights", "generate", "reward")
    }
    summary = json.loads((out / "ours" / "summary.json").read_text())
    return {
        "step_s": statistics.median(r["step_time_s"] for r in records),
        "slowest_s": max(r["step_time_s"] for r in records),
        "wall_s": time.time() - started,
        "phases": phases,
        "engines_lost": summary.get("rollout_recoveries", []),
    }


def run_trl(args, out: Path) -> Dict:
    command = [
        sys.executable, __file__, "--trl-child", str(out), "--size", args.size,
        "--steps", str(args.steps), "--completion", str(args.completion),
    ]  # fmt: skip
    started = time.time()
    subprocess.run(command, env=ENV, check=True, capture_output=True)
    result = json.loads((out / "trl.json").read_text())
    times = result["step_s"][SKIP:]
    return {"step_s": statistics.median(times), "wall_s": time.time() - started, "phases": {}}


def trl_child(out: Path, size: str, steps: int, completion: int) -> None:
    """TRL's GRPOTrainer on the same model, prompts and settings; step times to trl.json."""
    import torch
    from datasets import Dataset
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from raytrain_ext.rollout.example_rewards import reward_len

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.times: List[float] = []
            self.began = 0.0

        def on_step_begin(self, *a, **k) -> None:
            self.began = time.perf_counter()

        def on_step_end(self, *a, **k) -> None:
            self.times.append(time.perf_counter() - self.began)

    values = architecture(size)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()]
    settings = GRPOConfig(
        output_dir=str(out / "trl"), per_device_train_batch_size=GENERATIONS * GROUPS,
        num_generations=GENERATIONS, max_completion_length=completion, max_steps=steps,
        learning_rate=LR, use_cpu=True, report_to=[], save_strategy="no", bf16=False,
        logging_steps=steps, lr_scheduler_type="cosine", warmup_steps=0,
    )  # fmt: skip
    callback = StepTimes()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_len,
        args=settings,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=AutoTokenizer.from_pretrained(str(TOKENIZER)),
        callbacks=[callback],
    )
    trainer.train()
    (out / "trl.json").write_text(json.dumps({"step_s": callback.times}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--completion", type=int, default=32)
    parser.add_argument(
        "--kill-engine-at",
        type=int,
        default=0,
        help="SIGKILL one of our engines once this step is recorded; prints the slowest step",
    )
    parser.add_argument(
        "--overlap",
        action="store_true",
        help="ours with rollout.overlap=true: step t+1 generated while step t updates",
    )
    parser.add_argument(
        "--spare-engines",
        type=int,
        default=0,
        help="ours with rollout.spare_engines: warm engines that take a lost one's place",
    )
    parser.add_argument("--trl-child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_child is not None:
        return trl_child(args.trl_child, args.size, args.steps, args.completion)
    completions = GENERATIONS * GROUPS
    print(
        f"GRPO, {args.size} Llama {SIZES[args.size]}, {completions} completions of up to "
        f"{args.completion} tokens per step, {args.steps} steps; ours: 1 trainer + "
        f"{args.engines} engine(s){', overlap' if args.overlap else ''}"
    )
    ratios = []
    for repeat in range(args.repeats):
        runs = {}
        for name, run in (("raytrain-ext", run_ours), ("TRL GRPOTrainer", run_trl)):
            with tempfile.TemporaryDirectory() as tmp:
                runs[name] = run(args, Path(tmp))
        for name, r in runs.items():
            split = "  ".join(f"{p} {s * 1e3:.0f} ms" for p, s in r["phases"].items())
            print(
                f"  run {repeat + 1} {name:16s} step {r['step_s'] * 1e3:7.1f} ms  "
                f"{completions / r['step_s']:7.1f} completions/s  wall {r['wall_s']:5.1f} s  "
                f"{split}"
            )
        ours = runs["raytrain-ext"]
        if args.kill_engine_at:
            print(
                f"    engine killed after step {args.kill_engine_at}: slowest step "
                f"{ours['slowest_s'] * 1e3:.0f} ms = {ours['slowest_s'] / ours['step_s']:.2f}x "
                f"the median; recorded {ours['engines_lost']}"
            )
        ratios.append(runs["TRL GRPOTrainer"]["step_s"] / ours["step_s"])
    print(f"throughput ours / TRL: {min(ratios):.2f}-{max(ratios):.2f}")


if __name__ == "__main__":
    main()
