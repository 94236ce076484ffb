"""Checkpoint benchmark: stall per save, bandwidth per tier vs a physical reference, restore time.

One run on this machine, everything measured in the same process tree:
- references: a plain tensor copy of the same state (memory), a raw write+fsync of the same
  bytes (disk), a raw boto3 multipart upload of the same bytes (S3, moto on 127.0.0.1);
- raytrain-ext: a training run saving to memory + local + S3, then restores from each tier;
- Ray Train: the same model in `TorchTrainer`, `ray.train.report(checkpoint=...)` every
  `--every` steps, timing how long each report blocks the training loop.

Usage: python jobs/bench/checkpoint.py [--d-model 512 --layers 8] [--skip-ray-train]
"""

import argparse
import io
import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.update(
    {
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
        "GLOO_SOCKET_IFNAME": "lo",
    }
)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from restore_reference import (  # noqa: E402  (this script's folder)
    drop_from_page_cache,
    local_read_s,
    object_store_get_s,
    s3_download_s,
    step_files,
)

from raytrain_ext.checkpoint.manifest import step_dir_name  # noqa: E402
from raytrain_ext.config import load_config  # noqa: E402
from raytrain_ext.models import build_model  # noqa: E402

MB = 1024 * 1024
KEEP_LAST = 2  # the local tier's retention: from save KEEP_LAST + 2 on, files are recycled


def model_overrides(args):
    return [
        f"model.d_model={args.d_model}",
        f"model.n_layers={args.layers}",
        f"model.n_heads={args.d_model // 64}",
        "data.global_batch_size=4",
        "data.micro_batch_size=2",
        f"scaling.num_workers={args.workers}",
        *args.set,
    ]


def state_tensors(args):
    """The model + AdamW moments, as the framework checkpoints them."""
    cfg = load_config(None, model_overrides(args))
    model = build_model(cfg.model, 0)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 256, (1, 16))).sum().backward()
    opt.step()
    tensors = list(model.state_dict().values())
    for state in opt.state.values():
        tensors += [v for v in state.values() if v.dim() > 0]
    return tensors


def best_of(n, fn):
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def concurrent_copy_s(args, tensors):
    """A plain copy of the state into warm buffers by `workers` threads at once.

    Each Ray worker copies with one intra-op thread (Ray sets OMP_NUM_THREADS=1),
    so the reference does too; torch releases the GIL while copying.
    """
    from concurrent.futures import ThreadPoolExecutor

    torch.set_num_threads(1)
    buffers = [[torch.empty_like(t) for t in tensors] for _ in range(args.workers)]

    def copy_all(i):
        for b, t in zip(buffers[i], tensors, strict=True):
            b.copy_(t)

    with ThreadPoolExecutor(args.workers) as pool:
        list(pool.map(copy_all, range(args.workers)))  # first touch
        return best_of(5, lambda: list(pool.map(copy_all, range(args.workers))))


def references(args, endpoint, bucket, raw_dir):
    tensors = state_tensors(args)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    copy_s = concurrent_copy_s(args, tensors)
    blob = b"".join(t.numpy().tobytes() for t in tensors)
    writes_s = raw_disk_writes_s(blob, 2, raw_dir)
    upload_s = s3_upload_s(endpoint, bucket, blob) if "s3" in args.tiers else None
    return {
        "bytes": nbytes,
        "workers": args.workers,
        "copy_s": copy_s,
        "disk_writes_s": writes_s,
        "s3_upload_s": upload_s,
    }


def s3_upload_s(endpoint, bucket, blob):
    import boto3
    from boto3.s3.transfer import TransferConfig

    client = boto3.client("s3", endpoint_url=endpoint)
    config = TransferConfig(
        multipart_threshold=16 * MB, multipart_chunksize=16 * MB, max_concurrency=8
    )
    upload_s = best_of(
        2, lambda: client.upload_fileobj(io.BytesIO(blob), bucket, "raw.bin", Config=config)
    )
    client.delete_object(Bucket=bucket, Key="raw.bin")
    return upload_s


def raw_disk_writes_s(blob, n, directory):
    """``n`` timed raw writes (+fsync) of ``blob`` to one file in ``directory``, a sibling
    of the run's ``step-N`` directories.

    Why there: this machine's virtual disk writes 0.33 GB/s into blocks never written
    before and 1.1-1.4 GB/s into freed ones, and ext4 places a directory's files near
    it, so a reference written elsewhere measures other blocks.  The bench writes
    before the framework's runs and again after them: the best is the strongest
    reference, the median the one measured in like conditions.
    """
    path = Path(directory) / "raw.bin"
    path.parent.mkdir(parents=True, exist_ok=True)
    times = []
    for _ in range(n):
        start = time.perf_counter()
        with open(path, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        times.append(time.perf_counter() - start)
    shutil.rmtree(path.parent)
    return times


def object_store_put_s(nbytes, workers):
    """The memory tier's physical ceiling: ``workers`` zero-CPU actors each ``ray.put`` an
    in-memory array of ``nbytes / workers`` at once (a holder puts each rank's file), best
    of 3; the plain copy stays the reference the goal names."""
    import numpy as np
    import ray

    @ray.remote(num_cpus=0)
    class Putter:
        def __init__(self, size):
            self.data = np.random.randint(0, 255, size, dtype=np.uint8)
            self.ref = None

        def put(self):
            self.ref = None  # the previous copy is freed first, as retention would
            start = time.perf_counter()
            self.ref = ray.put(self.data)
            return time.perf_counter() - start

    putters = [Putter.remote(nbytes // workers) for _ in range(workers)]
    try:
        return min(max(ray.get([p.put.remote() for p in putters])) for _ in range(3))
    finally:
        for putter in putters:
            ray.kill(putter)


def run_framework(args, endpoint, bucket, workdir, nbytes):
    import ray

    from raytrain_ext import Trainer
    from raytrain_ext.checkpoint.tiers.memory import start_memory_tier, stop_memory_tier
    from raytrain_ext.ray_session import connect_ray

    connect_ray(None)
    put_s = object_store_put_s(nbytes, args.workers)
    memory = start_memory_tier("bench")
    common = model_overrides(args) + [
        f"run.output_dir={workdir}",
        "run.name=bench",
        "run.tensorboard=false",
        f"run.max_steps={args.steps}",
        f"optim.decay_steps={args.steps}",
        f"checkpoint.every_steps={args.every}",
        "checkpoint.every_seconds=null",
        f"checkpoint.keep_last={KEEP_LAST}",
        "parallel.timeout_s=600",
    ]
    if "s3" in args.tiers:
        common += [
            f"checkpoint.s3.uri=s3://{bucket}/${{run.name}}",
            f"checkpoint.s3.endpoint_url={endpoint}",
        ]
    try:
        saved = Trainer(load_config(None, common + ["checkpoint.memory=true"])).fit()
        paused = (
            None
            if args.skip_paused
            else Trainer(
                load_config(
                    None,
                    common
                    + [
                        "checkpoint.memory=true",
                        "checkpoint.async_save=false",
                        "run.name=bench-sync",
                        f"run.max_steps={args.steps + args.every}",
                    ],
                )
            ).fit()
        )
        restores = {}
        for tier, extra in (
            ("memory", ["checkpoint.memory=true"]),
            ("local", ["checkpoint.memory=false"]),
            ("s3", ["checkpoint.memory=false", "checkpoint.local=false"]),
        ):
            if tier in args.tiers:
                restores[tier] = [
                    restore_once(tier, workdir, common + extra) for _ in range(args.restores)
                ]
        reference_s = {
            "memory": object_store_get_s(restored_bytes(workdir), args.workers, args.restores)
        }
    finally:
        stop_memory_tier(memory)
        ray.shutdown()
    reference_s["local"] = [
        local_read_s(newest_step_dir(workdir), args.workers) for _ in range(args.restores)
    ]
    if "s3" in args.tiers:
        prefix = f"bench/{step_dir_name(restores['s3'][0]['step'])}/"
        reference_s["s3"] = [
            s3_download_s(endpoint, bucket, prefix, args.workers) for _ in range(args.restores)
        ]
    return saved, paused, restores, put_s, reference_s


def restore_once(tier, workdir, overrides):
    """One run that only restores (it starts at its last step): the restore record."""
    from raytrain_ext import Trainer

    # the same finished run is restored again and again: its summary would make the trainer
    # refuse it (run_dir.refuse_finished_run), and this run only measures the restore
    (workdir / "bench" / "summary.json").unlink(missing_ok=True)
    if tier == "local":  # a restore after a node's restart reads from the disk
        drop_from_page_cache(step_files(newest_step_dir(workdir)))
    restored = Trainer(load_config(None, overrides)).fit()["restored"]
    assert restored["tier"] == tier, restored
    return restored


def newest_step_dir(workdir):
    steps = sorted((workdir / "bench" / "checkpoints").glob("step-*"))
    return steps[-1]


def restored_bytes(workdir):
    return sum(p.stat().st_size for p in step_files(newest_step_dir(workdir)))


def ray_train_report_blocking(args, workdir):
    """Ray Train's TorchTrainer, same model: how long report(checkpoint=...) blocks."""
    import ray
    from ray.train import Checkpoint, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    overrides = model_overrides(args)

    def loop(config):
        import ray.train as train
        import torch.nn.functional as F

        cfg = load_config(None, config["overrides"])
        model = train.torch.prepare_model(build_model(cfg.model, 0))
        opt = torch.optim.AdamW(model.parameters())
        for step in range(1, config["steps"] + 1):
            start = time.perf_counter()
            x = torch.randint(0, 256, (2, cfg.model.seq_len))
            F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
            opt.step()
            opt.zero_grad()
            compute = time.perf_counter() - start
            if step % config["every"] == 0:
                with tempfile.TemporaryDirectory() as tmp:
                    torch.save(
                        {"model": model.state_dict(), "optim": opt.state_dict()},
                        os.path.join(tmp, "state.pt"),
                    )
                    train.report(
                        {
                            "step": step,
                            "compute_s": compute,
                            "blocked_s": time.perf_counter() - start - compute,
                        },
                        checkpoint=Checkpoint.from_directory(tmp),
                    )
            else:
                train.report(
                    {
                        "step": step,
                        "compute_s": compute,
                        "blocked_s": time.perf_counter() - start - compute,
                    }
                )

    ray.init(
        num_cpus=args.workers,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
    )
    try:
        trainer = TorchTrainer(
            loop,
            train_loop_config={"overrides": overrides, "steps": args.steps, "every": args.every},
            scaling_config=ScalingConfig(num_workers=args.workers),
            run_config=RunConfig(storage_path=str(workdir / "ray_train"), name="bench"),
        )
        result = trainer.fit()
        history = result.metrics_dataframe
    finally:
        ray.shutdown()
    saves = history[history["step"] % args.every == 0]
    return {
        "compute_s": float(history["compute_s"].median()),
        "report_with_ckpt_s": float(saves["blocked_s"].median()),
    }


# GB of state -> (d_model, layers) of the reference GPT with AdamW
SIZES = {0.3: (512, 8), 1.0: (1024, 7), 2.0: (1024, 13), 3.0: (1024, 20)}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=28)  # 7 saves: 3 reach the steady state
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--skip-ray-train", action="store_true")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every run (e.g. checkpoint.read_threads=2)",
    )
    parser.add_argument(
        "--tiers",
        default="memory,local,s3",
        help="the tiers to save to and restore from (local is always saved)",
    )
    parser.add_argument(
        "--skip-paused", action="store_true", help="no second run with training paused during saves"
    )
    parser.add_argument(
        "--restores",
        type=int,
        default=3,
        help="restores per tier, each in fresh workers (the reference is measured as often)",
    )
    parser.add_argument(
        "--sizes",
        default="",
        help="e.g. 0.3,1,3: one run per state size (GB, of %s), then a table of "
        "how stall, persist and restore grow" % sorted(SIZES),
    )
    args = parser.parse_args()
    args.tiers = args.tiers.split(",")
    if not args.sizes:
        result = run_size(args)
        report(args, *result)
        return
    rows = []
    for gb in [float(size) for size in args.sizes.split(",")]:
        args.d_model, args.layers = SIZES[gb]
        result = run_size(args)
        print(f"=== state of about {gb} GB: d_model {args.d_model}, {args.layers} layers ===")
        report(args, *result)
        rows.append(trend_row(*result))
    print_trend(rows)


def run_size(args):
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    endpoint = "http://%s:%d" % server.get_host_and_port()
    # moto's backends are process-wide: a server of an earlier size still holds its objects
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST"))
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
    workdir = Path(tempfile.mkdtemp(prefix="ckpt-bench-"))
    try:
        raw_dir = workdir / "bench" / "checkpoints" / "raw-reference"
        ref = references(args, endpoint, "bench", raw_dir)
        saved, paused, restores, ref["put_s"], ref["restore_s"] = run_framework(
            args, endpoint, "bench", workdir, ref["bytes"]
        )
        # the same number of bytes again (not kept through the runs: at 2 GB of state that
        # memory pressure slowed the runs themselves)
        blob = np.random.default_rng(0).bytes(ref["bytes"])
        ref["disk_writes_s"] += raw_disk_writes_s(blob, 2, raw_dir)
        peer = None if args.skip_ray_train else ray_train_report_blocking(args, workdir)
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)  # several GB of checkpoints
    return ref, saved, paused, restores, peer


def restore_seconds(restored):
    """The whole restore on rank 0: planning, every candidate tried, loading, installing."""
    return restored["total_s"]


def trend_row(ref, saved, paused, restores, peer):
    timings = saved["checkpoint"]["timings"]
    row = {
        "GB": statistics.median(t["bytes"] for t in timings) / 1e9,
        "stall s": statistics.median(saved["checkpoint"]["stalls_s"]),
    }
    for tier in timings[0]["tiers_s"]:
        row[f"persist {tier} s"] = statistics.median(t["tiers_s"][tier] for t in timings)
    for tier, runs in restores.items():
        row[f"restore {tier} s"] = statistics.median(restore_seconds(r) for r in runs)
    return row


def print_trend(rows):
    """Each figure per GB of state, so a linear growth reads as a flat column."""
    keys = list(rows[0])
    print("how each cost grows with the state (seconds, and seconds per GB in brackets):")
    print("".join(f"{key:>22}" for key in keys))
    for row in rows:
        cells = [f"{row['GB']:22.2f}"] + [
            f"{row[key]:10.3f} ({row[key] / row['GB']:6.3f}/GB)" if key in row else f"{'-':>22}"
            for key in keys[1:]
        ]
        print("".join(cells))


def bandwidth_rows(ref, timings):
    """(tier, our GB/s, reference GB/s); our figures are medians over the saves.

    Disk: ours is DCP's write of every rank's files (each fsynced, plus the
    fsynced ``.metadata``), then with their checksums and the local tier's commit
    (fsynced manifest, retention); the reference is one thread writing the same
    tensor bytes to one file with one fsync, best of two (no checksum).
    """
    gb = ref["bytes"] / 1e9
    saved_bytes = statistics.median(t["bytes"] for t in timings) / 1e9
    write_s = statistics.median(t["write_s"] for t in timings)
    disk_ref = gb / min(ref["disk_writes_s"])
    rows = [("local disk (DCP write)", saved_bytes / write_s, disk_ref)]
    if all("local" in t["tiers_s"] for t in timings):
        persist_s = statistics.median(
            t["write_s"] + t.get("checksum_s", 0.0) + t["tiers_s"]["local"] for t in timings
        )
        rows.append(("local disk (write+checksum+commit)", saved_bytes / persist_s, disk_ref))
    for label, tier, ref_s in (
        ("memory (persist) vs copy", "memory", ref["copy_s"] / ref["workers"]),
        ("memory (persist) vs ray.put", "memory", ref["put_s"]),
        ("s3 (persist)", "s3", ref["s3_upload_s"]),
    ):
        if tier not in timings[0]["tiers_s"]:
            continue
        tier_s = statistics.median(t["tiers_s"][tier] for t in timings)
        rows.append((label, saved_bytes / tier_s, gb / ref_s))
    return rows


def persist_phases_ms(timings):
    """Where a save's persist time goes: DCP write, checksums, then each tier's upload+commit."""
    phases = [
        ("dcp write", [t["write_s"] for t in timings]),
        ("checksum", [t.get("checksum_s", 0.0) for t in timings]),
    ]
    phases += [
        (tier, [t["tiers_s"].get(tier, 0.0) for t in timings]) for tier in timings[0]["tiers_s"]
    ]
    return [(name, statistics.median(values) * 1e3) for name, values in phases]


def per_save_line(timings, ref):
    """Each save's DCP write bandwidth; from save KEEP_LAST + 2 on, retention has deleted a
    step and the writer overwrites its recycled files, the run's steady state."""
    per_save = [t["bytes"] / 1e9 / t["write_s"] for t in timings]
    line = f"DCP write per save (GB/s): {[round(b, 2) for b in per_save]}"
    steady = per_save[KEEP_LAST + 1 :]
    if steady:
        best_raw = ref["bytes"] / 1e9 / min(ref["disk_writes_s"])
        median = statistics.median(steady)
        line += (
            f"; from save {KEEP_LAST + 2} on (recycled files) median {median:.2f} = "
            f"{median / best_raw:.2f} x the best raw write"
        )
    return line


def report(args, ref, saved, paused, restores, peer):
    timings = saved["checkpoint"]["timings"]
    print(f"state: {ref['bytes'] / MB:.0f} MB (model + AdamW moments), {args.workers} workers")
    step_s = statistics.median(saved["step_times"])
    stalls = saved["checkpoint"]["stalls_s"]
    print(f"stalls per save (ms): {[round(s * 1e3, 1) for s in stalls]}")
    stall_s = statistics.median(stalls)
    print(
        f"median stall        {stall_s * 1e3:8.1f} ms  = {stall_s / step_s:.3f} x step time "
        f"({step_s * 1e3:.0f} ms); plain copy {ref['copy_s'] * 1e3:.1f} ms -> ratio "
        f"{stall_s / ref['copy_s']:.2f}"
    )
    for label, run in (("async, during training", saved), ("training paused", paused)):
        if run is None:
            continue
        print(f"{'save bandwidth, ' + label:38}{'raytrain-ext':>14}{'reference':>12}{'ratio':>8}")
        for name, ours, theirs in bandwidth_rows(ref, run["checkpoint"]["timings"]):
            print(f"  {name:36}{ours:11.2f} GB/s{theirs:9.2f} GB/s{ours / theirs:8.2f}")
        print("  " + per_save_line(run["checkpoint"]["timings"], ref))
        print(
            "  phases, median ms: "
            + ", ".join(
                f"{phase} {ms:.0f}" for phase, ms in persist_phases_ms(run["checkpoint"]["timings"])
            )
        )
    writes = [ref["bytes"] / 1e9 / w for w in ref["disk_writes_s"]]
    line = f"raw disk writes before and after the runs (GB/s): {[round(w, 2) for w in writes]}"
    if paused is not None:
        paused_write = statistics.median(
            t["bytes"] / 1e9 / t["write_s"] for t in paused["checkpoint"]["timings"]
        )
        line += (
            f"; DCP write with training paused / median raw write = "
            f"{paused_write / statistics.median(writes):.2f}"
        )
    print(line)
    saved_bytes = statistics.median(t["bytes"] for t in timings) / 1e9
    print(
        f"restores ({args.workers} workers, each loading the whole replicated state; the "
        "reference gets the same bytes into each worker from the same medium, "
        "see restore_reference.py):"
    )
    for tier, runs in restores.items():
        print_restores(tier, runs, ref["restore_s"][tier], saved_bytes)
    if peer:
        print(
            f"Ray Train report(checkpoint) blocks {peer['report_with_ckpt_s']:.2f} s per save "
            f"({peer['report_with_ckpt_s'] / peer['compute_s']:.1f} x its step compute "
            f"{peer['compute_s'] * 1e3:.0f} ms); "
            f"raytrain-ext stall {stall_s:.3f} s -> "
            f"{peer['report_with_ckpt_s'] / stall_s:.0f}x less blocking"
        )


def print_restores(tier, runs, reference_runs, saved_gb):
    """The required line (medians), the ranges over the runs, then the median run's phases."""
    seconds = [restore_seconds(r) for r in runs]
    references = reference_runs["fresh"] if tier == "memory" else reference_runs
    ours, theirs = statistics.median(seconds), statistics.median(references)
    print(
        f"restore from {tier}: {ours:.2f} s, {saved_gb / ours:.2f} GB/s, "
        f"reference {saved_gb / theirs:.2f} GB/s, ratio {theirs / ours:.2f}"
    )
    print(
        f"  {len(runs)} restores {min(seconds):.3f}-{max(seconds):.3f} s; reference "
        f"{min(references):.3f}-{max(references):.3f} s"
    )
    if tier == "memory":
        warm, numpy = reference_runs["warm"], statistics.median(reference_runs["numpy"])
        print(
            f"  reference with the store already mapped in the getter (a second get): "
            f"{warm:.3f} s, {saved_gb / warm:.2f} GB/s, ratio {warm / ours:.2f}"
        )
        print(
            f"  reference into numpy buffers (2 MiB pages when the kernel has them free): "
            f"median {numpy:.3f} s ({min(reference_runs['numpy']):.3f}-"
            f"{max(reference_runs['numpy']):.3f}), {saved_gb / numpy:.2f} GB/s, "
            f"ratio {numpy / ours:.2f}"
        )
    median_run = sorted(runs, key=restore_seconds)[len(runs) // 2]
    print(
        "  phases (s): "
        + ", ".join(
            f"{name[:-2]} {value:.3f}"
            for name, value in median_run["phases"].items()
            if value >= 0.0005
        )
    )
    memory = median_run["memory"]
    if memory:
        print(
            f"  peak private memory: this rank's state {memory['state_mb']:.0f} MB + "
            f"{memory['transient_peak_mb']:.0f} MB held by the restore at its peak = "
            f"{memory['peak_over_state']:.2f} x the state"
        )


if __name__ == "__main__":
    main()
