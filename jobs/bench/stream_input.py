"""A streamed Ray dataset (``Trainer(cfg, dataset=...)``, ``data.ray_dataset=stream``) against
its peers, on one local Ray of this machine, in one run:

1. **Input throughput**: samples/s delivered to 2 workers, each taking its half of every
   global batch as int64 tensors: our reader actor and the ranks' clients, against Ray
   Train's ``get_dataset_shard(...).iter_torch_batches`` in a ``TorchTrainer`` over the same
   Parquet files (rows of ``seq_len + 1`` ids), same global batch.  Goal >= 0.9x.
2. **Memory**: the reader's and the driver's peak RSS while (1) streams the whole dataset,
   against the dataset's size: bounded by what is held ahead, not by the dataset.
3. **Time from ``fit`` to the first step** on the whole dataset: streamed against today's
   materialised view (written into the run directory first).
4. **After a re-form, after a lost reader**: a fresh client's first step from a live reader
   (a re-formed group's path), and the first step from a reader SIGKILLed and restarted by
   Ray (it reads the dataset again to the position), at two positions.

Usage: ``python jobs/bench/stream_input.py [--gb 1.0] [--repeats 2]``.  Nothing else
should run on the machine.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

SEQ, BATCH, WORKERS = 512, 32, 2
ROWS_PER_FILE = 4096


def write_dataset(root: Path, gigabytes: float) -> int:
    """Parquet files of rows of SEQ + 1 random int32 ids (incompressible); the row count."""
    rows = int(gigabytes * 2**30 / ((SEQ + 1) * 4))
    rng = np.random.default_rng(0)
    for i, start in enumerate(range(0, rows, ROWS_PER_FILE)):
        count = min(ROWS_PER_FILE, rows - start)
        ids = rng.integers(0, 32000, (count, SEQ + 1), dtype=np.int32)
        column = pa.FixedSizeListArray.from_arrays(pa.array(ids.ravel()), SEQ + 1)
        table = pa.table({"tokens": column.cast(pa.list_(pa.int32()))})
        pq.write_table(table, root / f"{i:05d}.parquet", compression="none")
    return rows


class PeakRss:
    """The peak unique memory (USS: not the object store's shared pages a process maps) of
    ``pids`` and of this process, sampled every 50 ms."""

    def __init__(self, pids):
        import psutil

        self.procs = [psutil.Process(p) for p in pids] + [psutil.Process()]
        self.peaks = [0] * len(self.procs)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.05):
            for i, p in enumerate(self.procs):
                try:
                    self.peaks[i] = max(self.peaks[i], p.memory_full_info().uss)
                except Exception:
                    pass

    def stop(self):
        self._stop.set()
        self._thread.join()
        return [p / 2**20 for p in self.peaks]


AHEAD: list = []  # --ahead: data.stream_ahead_steps (default: the config's)


def stream_cfg(out: Path, name: str, mode: str, steps: int):
    from raytrain_ext import load_config

    return load_config(
        None,
        [
            f"run.output_dir={out}",
            f"run.name={name}",
            f"run.max_steps={steps}",
            "run.tensorboard=false",
            "checkpoint.enabled=false",
            "model.n_layers=2",
            "model.d_model=64",
            "model.n_heads=2",
            f"model.seq_len={SEQ}",
            "model.vocab_size=32000",
            f"data.global_batch_size={BATCH}",
            "data.micro_batch_size=16",
            "data.shuffle=false",
            f"data.ray_dataset={mode}",
            f"scaling.num_workers={WORKERS}",
            *AHEAD,
        ],
    )


def ours_throughput(ds, steps: int, out: Path):
    """(samples/s over ``steps`` steps on WORKERS clients, peak USS MiB of reader, driver)."""
    import ray

    from raytrain_ext.data.stream_client import open_stream
    from raytrain_ext.data.stream_input import start_stream_reader, stream_config

    cfg = stream_config(stream_cfg(out, "throughput", "stream", steps))
    reader, _dataset_ref = start_stream_reader(cfg, ds)  # the ref held while it reads
    pid = ray.get(reader.stats.remote())["pid"]

    port = _free_port()

    @ray.remote(num_cpus=1)
    def rank(r: int) -> float:
        import torch.distributed as dist

        from raytrain_ext.data.sampler import rank_slice

        dist.init_process_group("gloo", f"tcp://127.0.0.1:{port}", rank=r, world_size=WORKERS)
        dataset, sampler = open_stream(cfg, (r, WORKERS))
        first = None
        for _ in range(steps):
            indices = rank_slice(sampler.next_global_batch(), r, WORKERS)
            dataset.batch(indices)
            dist.barrier()  # the ranks of a training step are in lock-step
            first = first or time.perf_counter()
        dist.destroy_process_group()
        return time.perf_counter() - first

    rss = PeakRss([pid])
    seconds = max(ray.get([rank.remote(r) for r in range(WORKERS)]))
    peaks = rss.stop()
    stats = ray.get(reader.stats.remote())
    ray.kill(reader)
    return BATCH * (steps - 1) / seconds, peaks, stats


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ray_train_throughput(ds, steps: int, out: Path) -> float:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    def loop(config):
        import ray.train

        shard = ray.train.get_dataset_shard("train")
        first, seen = None, 0
        import torch
        import torch.distributed as dist

        for batch in shard.iter_torch_batches(batch_size=BATCH // WORKERS, dtypes=None):
            batch["tokens"].to(dtype=torch.int64)
            dist.barrier()  # as ours: the ranks of a training step are in lock-step
            first = first or time.perf_counter()
            seen += 1
            if seen == config["steps"]:
                break
        seconds = time.perf_counter() - first
        rank = ray.train.get_context().get_world_rank()
        Path(config["out"], f"rank{rank}.txt").write_text(str(seconds))

    out.mkdir(parents=True, exist_ok=True)
    TorchTrainer(
        loop,
        train_loop_config={"steps": steps, "out": str(out)},
        scaling_config=ScalingConfig(num_workers=WORKERS),
        run_config=RunConfig(storage_path=str(out / "ray-train"), name="shard"),
        datasets={"train": ds},
    ).fit()
    seconds = max(float((out / f"rank{r}.txt").read_text()) for r in range(WORKERS))
    return BATCH * (steps - 1) / seconds


def first_step(ds, out: Path, mode: str, name: str) -> float:
    from raytrain_ext import Trainer

    summary = Trainer(stream_cfg(out, name, mode, 2), dataset=ds).fit()
    return summary["time_to_first_step_s"]


def after_loss(ds, out: Path, positions) -> dict:
    """Seconds to a step from a fresh client (live reader), and after the reader's SIGKILL."""
    import ray

    from raytrain_ext.data.stream_client import StreamClient
    from raytrain_ext.data.stream_input import start_stream_reader, stream_config

    cfg = stream_config(stream_cfg(out, "loss", "stream", 10))
    reader, _dataset_ref = start_stream_reader(cfg, ds)  # the ref held while it reads
    timings = {}
    for step in positions:
        StreamClient(cfg.data.path, 600).step(step)  # the reader is there
        started = time.perf_counter()
        StreamClient(cfg.data.path, 600).step(step)
        timings[f"re-form, step {step}"] = time.perf_counter() - started
        os.kill(ray.get(reader.stats.remote())["pid"], signal.SIGKILL)
        started = time.perf_counter()
        StreamClient(cfg.data.path, 600).step(step)
        timings[f"lost reader, step {step}"] = time.perf_counter() - started
    ray.kill(reader)
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--ahead", type=int, default=None, help="data.stream_ahead_steps")
    parser.add_argument("--only-throughput", action="store_true")
    args = parser.parse_args()
    if args.ahead is not None:
        AHEAD[:] = [f"data.stream_ahead_steps={args.ahead}"]
    import ray

    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR")
    ray.data.DataContext.get_current().enable_progress_bars = False
    with tempfile.TemporaryDirectory(prefix="stream-bench-") as tmp:
        root = Path(tmp)
        (root / "data").mkdir()
        rows = write_dataset(root / "data", args.gb)
        size = sum(f.stat().st_size for f in (root / "data").iterdir()) / 2**20
        print(f"== dataset: {rows} rows of {SEQ + 1} ids, {size:.0f} MiB of Parquet")
        ds = ray.data.read_parquet(str(root / "data"))
        steps = min(args.steps, rows // BATCH - 1)
        ours, theirs = [], []
        for i in range(args.repeats):
            rate, peaks, stats = ours_throughput(ds, steps, root / f"o{i}")
            ours.append(rate)
            theirs.append(ray_train_throughput(ds, steps, root / f"t{i}"))
            print(
                f"run {i}: ours {rate:,.0f} samples/s, Ray Train {theirs[-1]:,.0f} samples/s "
                f"({rate / theirs[-1]:.2f}x); peak USS reader {peaks[0]:.0f} MiB, driver "
                f"{peaks[1]:.0f} MiB while streaming {steps * BATCH * (SEQ + 1) * 4 / 2**20:.0f} "
                f"MiB; reader held steps {stats['held_steps']}"
            )
        print(
            f"throughput: ours {min(ours):,.0f}-{max(ours):,.0f}, Ray Train "
            f"{min(theirs):,.0f}-{max(theirs):,.0f} samples/s; ratio "
            f"{min(o / t for o, t in zip(ours, theirs, strict=True)):.2f}-"
            f"{max(o / t for o, t in zip(ours, theirs, strict=True)):.2f}x"
        )
        if args.only_throughput:
            return
        for i in range(args.repeats):
            s = first_step(ds, root / f"f{i}", "stream", "streamed")
            m = first_step(ds, root / f"f{i}", "materialise", "materialised")
            print(f"fit -> first step: streamed {s:.1f} s, materialised {m:.1f} s ({s / m:.2f}x)")
        epoch = rows // BATCH
        for label, seconds in after_loss(ds, root / "loss", [epoch // 4, epoch // 2]).items():
            print(f"{label}: {seconds * 1e3:,.0f} ms")
        print(f"(median of ours {statistics.median(ours):,.0f} samples/s)")
    ray.shutdown()


if __name__ == "__main__":
    main()
