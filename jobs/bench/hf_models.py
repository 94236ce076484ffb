"""A Hugging Face Llama through raytrain-ext, torchrun DDP and Ray Train; export and load.

The same Llama-family model (random init from an inline config, ``--size``) and global batch
are trained, each as its own command, by
(a) raytrain-ext, through its real CLI (``jobs/train.py``, DDP, checkpoint at the end),
(b) a plain torchrun DDP script and (c) Ray Train's ``TorchTrainer`` (both in
jobs/bench/hf_baselines.py, which trains the same samples with the same optimizer).
Printed per framework: the median step time (steps 3 on) and the time from the command's
start to the end of its first step; and the ratios ours / torchrun and ours / Ray Train.
Ours' start is split into its phases per run (``metrics.start_phases``): the first run checks
the HF config with ``transformers`` on the driver, later ones read that check's cache.
Then ``raytrain-ext ckpt export RUN --to-hf DIR`` is timed on (a)'s checkpoint, and the
pretrained load under FSDP is measured on 2 gloo ranks (jobs/bench/hf_pretrained_load.py:
bytes each rank reads vs the safetensors total).

Usage: python jobs/bench/hf_models.py [--size tiny|20m|50m] [--steps 30] [--repeats 1]
(``tiny``, the default, is a smoke run of seconds; measure with 20m or 50m on a quiet
machine).  CPU and gloo throughout; every framework's workers get one thread each.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[2]
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH))

from hf_pretrained_load import measure_load, print_load  # noqa: E402

from raytrain_ext.worker.rendezvous import free_port  # noqa: E402

LLAMA = {"model_type": "llama", "max_position_embeddings": 1024, "tie_word_embeddings": False}
SIZES = {  # hidden, intermediate, layers, heads, kv heads, vocab
    "tiny": (64, 128, 2, 4, 2, 512),
    "20m": (384, 1024, 8, 6, 2, 8192),
    "50m": (512, 1536, 12, 8, 4, 8192),
}
WARMUP_STEPS = 2  # left out of the median: allocator and DDP bucket warm-up
ENV = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def architecture(size: str) -> Dict:
    hidden, inter, layers, heads, kv_heads, vocab = SIZES[size]
    return {
        **LLAMA,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
    }


def parameter_count(arch: Dict) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**arch)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def run_overrides(args, arch: Dict) -> List[str]:
    """The training config all three frameworks read (raytrain-ext's own config keys)."""
    inline = "{" + ", ".join(f"{k}: {str(v).lower()}" for k, v in arch.items()) + "}"
    return [
        "model.source=hf",
        f"model.hf.config={inline}",
        f"model.seq_len={args.seq_len}",
        f"data.global_batch_size={args.global_batch}",
        f"data.micro_batch_size={args.micro_batch}",
        f"run.max_steps={args.steps}",
        f"optim.decay_steps={args.steps}",
        "optim.warmup_steps=2",
    ]


def timings(step_times: List[float], first_step_at: float, start: float, loss: float) -> Dict:
    return {
        "median_step_s": statistics.median(step_times[WARMUP_STEPS:] or step_times),
        "first_step_s": first_step_at - start,
        "final_loss": loss,
    }


def run_ours(workdir: Path, args, overrides: List[str], name: str) -> Dict:
    cmd = [
        sys.executable,
        str(REPO / "jobs" / "train.py"),
        f"run.output_dir={workdir}",
        f"run.name={name}",
        f"scaling.num_workers={args.workers}",
        "run.tensorboard=false",
        f"run.log_every={args.steps}",
        *overrides,
    ]
    start = time.time()
    subprocess.run(cmd, check=True, capture_output=True, cwd=workdir, env=ENV, timeout=1800)
    summary = json.loads((workdir / name / "summary.json").read_text())
    out = timings(summary["step_times"], summary["first_step_at"], start, summary["final_loss"])
    start_s = {"command": summary["started_at"] - start, **summary["start_phases_s"]}
    return {**out, "run_dir": str(workdir / name), "start_s": start_s}


def run_torchrun(workdir: Path, args, overrides: List[str]) -> Dict:
    out = workdir / "torchrun.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={args.workers}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port('127.0.0.1')}",
        str(BENCH / "hf_baselines.py"),
        "--out",
        str(out),
        *overrides,
    ]
    start = time.time()
    subprocess.run(cmd, check=True, capture_output=True, cwd=workdir, env=ENV, timeout=1800)
    result = json.loads(out.read_text())
    return timings(result["step_times"], result["first_step_at"], start, result["final_loss"])


def run_ray_train(workdir: Path, args, overrides: List[str]) -> Dict:
    out = workdir / "ray_train.json"
    cmd = [sys.executable, str(BENCH / "hf_baselines.py"), "--ray-train", str(args.workers)]
    cmd += ["--out", str(out), *overrides]
    start = time.time()
    subprocess.run(cmd, check=True, capture_output=True, cwd=workdir, env=ENV, timeout=1800)
    result = json.loads(out.read_text())
    return timings(result["step_times"], result["first_step_at"], start, result["final_loss"])


def time_export(run_dir: str, workdir: Path) -> Dict:
    """``raytrain-ext ckpt export RUN --to-hf DIR`` as a command, timed from its start."""
    target = workdir / "exported"
    cmd = [sys.executable, "-m", "raytrain_ext", "ckpt", "export", run_dir, "--to-hf", str(target)]
    start = time.time()
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=ENV, timeout=1800)
    seconds = time.time() - start
    files = sorted(p.name for p in target.iterdir())
    size = sum((target / f).stat().st_size for f in files if f.endswith(".safetensors"))
    return {"export_s": seconds, "files": files, "bytes": size, "said": done.stdout.strip()}


def save_pretrained(arch: Dict, directory: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**arch)).save_pretrained(directory)
    return directory


def print_training(runs: Dict[str, List[Dict]], header: str) -> None:
    best = {name: min(r["median_step_s"] for r in rs) for name, rs in runs.items()}
    first = {name: min(r["first_step_s"] for r in rs) for name, rs in runs.items()}
    names = list(runs)
    print(header)
    print(f"{'':26}" + "".join(f"{n:>14}" for n in names))
    print(f"{'median step time (ms)':26}" + "".join(f"{best[n] * 1e3:14.1f}" for n in names))
    print(f"{'command to 1st step (s)':26}" + "".join(f"{first[n]:14.2f}" for n in names))
    for n in names:
        medians = ", ".join(f"{r['median_step_s'] * 1e3:.1f}" for r in runs[n])
        starts = ", ".join(f"{r['first_step_s']:.2f}" for r in runs[n])
        print(f"  {n}: median step per run (ms) {medians}; command to 1st step (s) {starts}")
    for i, run in enumerate(runs[names[0]]):
        cache = "its HF config built and checked" if i == 0 else "its HF config from the cache"
        phases = ", ".join(f"{k} {v:.2f}" for k, v in run["start_s"].items())
        print(f"  {names[0]} run {i + 1} ({cache}): start (s) {phases}")
    loss = {n: runs[n][-1]["final_loss"] for n in names}
    print(f"{'final loss':26}" + "".join(f"{loss[n]:14.4f}" for n in names))
    ours = names[0]
    for other in names[1:]:
        pairs = ", ".join(  # runs made one after the other: the drift between them is least
            f"{a['median_step_s'] / b['median_step_s']:.3f}"
            for a, b in zip(runs[ours], runs[other], strict=True)
        )
        print(
            f"{ours} / {other}: step time {best[ours] / best[other]:.3f} (run by run: "
            f"{pairs}), command to 1st step {first[ours] / first[other]:.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each framework, best kept")
    args = parser.parse_args()
    arch = architecture(args.size)
    overrides = run_overrides(args, arch)
    workdir = Path(tempfile.mkdtemp(prefix="hf-bench-"))
    # the driver's cache of checked HF configs (models.hf_shape_cache) starts empty: the
    # first run of ours builds the config, as a model's first run does; later ones read it
    ENV["RAYTRAIN_EXT_CACHE_DIR"] = str(workdir / "driver-cache")
    runs: Dict[str, List[Dict]] = {"raytrain-ext": [], "torchrun DDP": [], "Ray Train": []}
    try:
        for repeat in range(args.repeats):  # alternating, so drift hits all three alike
            runs["raytrain-ext"].append(run_ours(workdir, args, overrides, f"ours-{repeat}"))
            runs["torchrun DDP"].append(run_torchrun(workdir, args, overrides))
            runs["Ray Train"].append(run_ray_train(workdir, args, overrides))
        export = time_export(runs["raytrain-ext"][-1]["run_dir"], workdir)
        load = measure_load(save_pretrained(arch, workdir / "pretrained"), world=2)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print_training(
        runs,
        f"{arch['model_type']} {args.size}: {parameter_count(arch) / 1e6:.1f} M parameters "
        f"(hidden {arch['hidden_size']}, {arch['num_hidden_layers']} layers, vocab "
        f"{arch['vocab_size']}); seq {args.seq_len}, global batch {args.global_batch} (micro "
        f"{args.micro_batch}), {args.workers} workers, {args.steps} steps, best of {args.repeats}",
    )
    print(
        f"ckpt export --to-hf: {export['export_s']:.2f} s from the command's start, "
        f"{export['bytes'] / 2**20:.1f} MiB safetensors, files: {', '.join(export['files'])}"
    )
    print_load(load)


if __name__ == "__main__":
    main()
