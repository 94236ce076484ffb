"""A Ray Train loop under Ray Train's ``TorchTrainer`` and under ``raytrain_ext.train``'s, in
one run: the same loop function, only the API module differs.

The loop: an MLP (256 -> 2048 -> 256) under DDP (``prepare_model``), BATCHES random batches
an epoch, ``report`` once an epoch (every rank), rank 0 passing a checkpoint every
``every`` epochs (model, optimizer, and a ``--state-mb`` blob standing for a large model's
state), resumed from ``get_checkpoint()``.  Each rank appends what it did to a log the
driver reads (Ray Train's reports reach its driver only at the end).

Scenarios (``--scenario``, default all):
- ``steady``: 2 workers, no fault.  Median epoch (report to report) without checkpoints,
  the time rank 0 is blocked in ``report(checkpoint=...)`` with a ``--state-mb`` state
  every 5 epochs, and the wall time of that run.
- ``kill``: 2 workers on one node, SIGKILL rank 1's process at epoch ``--fault-at``
  (FAULT_AT, about 2 s into training, by default): fault -> first report after, epochs
  redone, whether rank 0 kept its process.  A later fault (``--fault-at 100``, about 15 s)
  finds the node's prestarted process warm, as a fault in a long run does.
- ``data``: 2 workers, no fault, a loop fed by ``get_dataset_shard`` alone
  (``range_tensor`` rows of 256 floats, batches of DATA_BATCH, the same MLP step per
  batch, a report per epoch): the median epoch after the first, rows per second, and
  the first epoch (the dataset's first execution); Ray Train's ``streaming_split``
  against our reader actor.
- ``kill-torchft``: ``kill`` against Ray Train with torchft (``torchft_peer.py``: each
  worker its own replica group, the survivor going on alone), instead of plain Ray Train;
  ``replaced_s``: fault -> the first epoch the replacement process ends.
- ``kill-slow-storage``: ``kill``'s run with storage that takes ``--upload-s`` to take
  each checkpoint (a large model going to a remote store: an fsspec filesystem passed as
  ``storage_filesystem``), SIGKILLing rank 0, the rank that saves, ``--fault-delay-s``
  (0.5) after it reported the checkpoint of epoch FAULT_AT - 1 (``0`` : as soon as it
  did): Ray Train's report waited for the upload, ours holds it in memory and goes on, so
  its upload is still in flight when the fault comes.
- ``node-loss``: a 3-node cluster (1 CPU each), ``num_workers=(2, 3)``, rank 2's node
  SIGKILLed at epoch FAULT_AT and a fresh node added 3 s later: fault -> first report
  after, epochs redone, and the grow-back (the last report at 2 workers -> the first at 3).

``--register``: our side's loop also hands its model, optimizer and epoch to
``raytrain_ext.train.register`` (Ray Train has no such call), so a re-formed group goes on
from the newest report a live process holds instead of the newest checkpoint.

Usage: ``python jobs/bench/ray_train_loop.py [--scenario steady|kill|kill-torchft|kill-slow-storage|data|node-loss|all]
[--repeats 1] [--state-mb 300] [--register]``.  Nothing else should run on the machine.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent))

from recovery_node_loss import _read_jsonl, lose_a_node  # noqa: E402 (sets Ray's env first)
from recovery_scaling import Background, ray_cluster, wait_for  # noqa: E402

APIS = {"Ray Train": "ray.train", "raytrain_ext": "raytrain_ext.train"}
BATCHES, FAULT_AT, EPOCHS = 12, 10, 40
DATA_ROWS, DATA_BATCH, DATA_EPOCHS = 16384, 64, 6


def bench_loop(config: dict) -> None:
    """The loop both trainers run (module doc)."""
    import torch
    from torch import nn

    train = importlib.import_module(config["api"])
    train_torch = importlib.import_module(config["api"] + ".torch")
    context = train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    torch.manual_seed(0)
    model = train_torch.prepare_model(
        nn.Sequential(nn.Linear(256, 2048), nn.ReLU(), nn.Linear(2048, 256))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    blob = torch.ones(config["state_mb"] * 2**18)  # float32: state_mb MiB
    start = _restore(train.get_checkpoint(), model, optimizer)
    if config.get("register"):  # one report an epoch: the reports made are the epochs done
        start = train.register(model=model, optimizer=optimizer)
    every = config["every"]
    for epoch in range(start, config["epochs"]):
        begun = time.time()
        for _ in range(BATCHES):
            x = torch.randn(64, 256)
            loss = ((model(x) - x) ** 2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        with tempfile.TemporaryDirectory() as directory:
            saved = None
            if rank == 0 and every and (epoch + 1) % every == 0:
                module = model.module if world > 1 else model
                state = {"model": module.state_dict(), "optim": optimizer.state_dict()}
                torch.save({**state, "blob": blob, "epoch": epoch}, f"{directory}/state.pt")
                saved = train.Checkpoint.from_directory(directory)
            reported = time.perf_counter()
            train.report({"epoch": epoch, "loss": loss.item()}, checkpoint=saved)
            blocked = time.perf_counter() - reported
        _note(config["log_dir"], rank, world, epoch, start, begun, blocked if saved else None)


def data_loop(config: dict) -> None:
    """The ``data`` scenario's loop: every batch of the rank's shard through one MLP step."""
    import torch
    from torch import nn

    train = importlib.import_module(config["api"])
    train_torch = importlib.import_module(config["api"] + ".torch")
    context = train.get_context()
    torch.manual_seed(0)
    model = train_torch.prepare_model(
        nn.Sequential(nn.Linear(256, 2048), nn.ReLU(), nn.Linear(2048, 256))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    shard = train.get_dataset_shard("train")
    for epoch in range(DATA_EPOCHS):
        begun, taken = time.time(), 0
        for batch in shard.iter_torch_batches(batch_size=DATA_BATCH):
            x = batch["data"].float() / DATA_ROWS
            loss = ((model(x) - x) ** 2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            taken += len(x)
        train.report({"epoch": epoch, "rows": taken})
        rank, world = context.get_world_rank(), context.get_world_size()
        _note(config["log_dir"], rank, world, epoch, 0, begun, None, rows=taken)


def data(api: str, work: Path, args) -> Dict[str, float]:
    """No fault, a loop fed by get_dataset_shard (module doc)."""
    import ray

    log_dir = work / "data"
    log_dir.mkdir(parents=True)
    train = importlib.import_module(api)
    run = importlib.import_module(api + ".torch").TorchTrainer(
        data_loop,
        train_loop_config={"api": api, "log_dir": str(log_dir)},
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(name="data", storage_path=str(work / "storage")),
        datasets={"train": ray.data.range_tensor(DATA_ROWS, shape=(256,))},
    )
    run.fit()
    rank0 = [r for r in rows(log_dir) if r["rank"] == 0]
    later = statistics.median(r["epoch_s"] for r in rank0[1:])
    return {
        "first_epoch_s": rank0[0]["epoch_s"],
        "epoch_s": later,
        "rows_per_s": 2 * rank0[1]["rows"] / later,
    }


def _restore(checkpoint, model, optimizer) -> int:
    import torch

    if checkpoint is None:
        return 0
    with checkpoint.as_directory() as directory:
        state = torch.load(f"{directory}/state.pt", weights_only=False)
    module = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])
    return state["epoch"] + 1


def _note(log_dir, rank, world, epoch, start, begun, blocked, **extra) -> None:
    import ray

    row = {
        **extra,
        "rank": rank,
        "world": world,
        "epoch": epoch,
        "resumed_from": start,
        "time": time.time(),
        "epoch_s": time.time() - begun,
        "blocked_s": blocked,
        "pid": os.getpid(),
        "node": ray.get_runtime_context().get_node_id(),
    }
    with open(os.path.join(log_dir, f"rank-{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")


def rows(log_dir: Path) -> List[dict]:
    found = [r for p in log_dir.glob("rank-*.jsonl") for r in _read_jsonl(p)]
    return sorted(found, key=lambda r: r["time"])


def trainer(
    api: str,
    work: Path,
    name: str,
    *,
    workers,
    every,
    state_mb,
    failures=0,
    epochs=EPOCHS,
    register=False,
    storage=None,
    **scale,
):
    """The same TorchTrainer call through either API (``register``: ours only;
    ``storage``: a pyarrow filesystem for ``storage_path``)."""
    train = importlib.import_module(api)
    log_dir = work / name
    log_dir.mkdir(parents=True)
    config = {
        "api": api,
        "epochs": epochs,
        "every": every,
        "state_mb": state_mb,
        "log_dir": str(log_dir),
        "register": register and api == APIS["raytrain_ext"],
    }
    return log_dir, importlib.import_module(api + ".torch").TorchTrainer(
        bench_loop,
        train_loop_config=config,
        scaling_config=train.ScalingConfig(num_workers=workers, **scale),
        run_config=train.RunConfig(
            name=name,
            storage_path=str(work / "storage"),
            storage_filesystem=storage,
            failure_config=train.FailureConfig(max_failures=failures),
            checkpoint_config=train.CheckpointConfig(num_to_keep=2),
        ),
    )


def steady(api: str, work: Path, args) -> Dict[str, float]:
    """No fault: the median epoch without checkpoints; blocked time and wall time with."""
    reg = args.register
    log_dir, plain = trainer(api, work, "plain", workers=2, every=0, state_mb=0, register=reg)
    plain.fit()
    epochs = [r["time"] for r in rows(log_dir) if r["rank"] == 0]
    log_dir, saving = trainer(
        api, work, "saving", workers=2, every=5, state_mb=args.state_mb, register=reg
    )
    started = time.time()
    saving.fit()
    wall = time.time() - started
    blocked = [r["blocked_s"] for r in rows(log_dir) if r["blocked_s"] is not None]
    return {
        "epoch_s": statistics.median(b - a for a, b in zip(epochs, epochs[1:], strict=False)),
        "blocked_s": statistics.median(blocked),
        "wall_s": wall,
    }


def after_fault(log: List[dict], fault: float) -> Dict[str, float]:
    """Fault -> the first report after it, epochs redone, and whether rank 0 kept its
    process (the same pid before and after)."""
    before = [r for r in log if r["time"] <= fault]
    after = [r for r in log if r["time"] > fault]
    last = max(r["epoch"] for r in before)
    rank0 = {r["pid"] for r in log if r["rank"] == 0}
    return {
        "first_report_after_s": after[0]["time"] - fault,
        "redone": last + 1 - min(r["resumed_from"] for r in after),
        "rank0_kept": float(len(rank0) == 1),
    }


def kill(api: str, work: Path, args) -> Dict[str, float]:
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        log_dir, run = trainer(
            api,
            work,
            "kill",
            workers=2,
            every=5,
            state_mb=8,
            failures=1,
            epochs=max(EPOCHS, args.fault_at + 30),
            register=args.register,
        )
        fit = Background(run.fit)
        at_fault = wait_for(lambda: _epoch_rows(log_dir, args.fault_at), fit, "the fault epoch")
        victim = next(r["pid"] for r in reversed(at_fault) if r["rank"] == 1)
        fault = time.time()
        os.kill(victim, signal.SIGKILL)
        result = fit.result()
    finally:
        ray.shutdown()
    return {**after_fault(rows(log_dir), fault), **our_phases(result), "wall_s": fit.wall_s}


def kill_slow_storage(api: str, work: Path, args) -> Dict[str, float]:
    import ray
    from slow_storage import slow_storage

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        storage = slow_storage(args.upload_s)
        log_dir, run = trainer(
            api, work, "slow", workers=2, every=5, state_mb=8, failures=1, storage=storage
        )
        fit = Background(run.fit)
        saved = wait_for(lambda: _epoch_rows(log_dir, FAULT_AT - 1), fit, "the saving epoch")
        victim = next(r["pid"] for r in reversed(saved) if r["rank"] == 0)
        time.sleep(args.fault_delay_s)
        fault = time.time()
        os.kill(victim, signal.SIGKILL)
        result = fit.result()
    finally:
        ray.shutdown()
    log = rows(log_dir)
    blocked = [r["blocked_s"] for r in log if r["blocked_s"] is not None]
    figures = after_fault(log, fault)
    figures.pop("rank0_kept")  # rank 0 is the one killed here
    return {
        **figures,
        **our_phases(result),
        "blocked_s": statistics.median(blocked),
        "wall_s": fit.wall_s,
    }


def node_loss(api: str, work: Path, args) -> Dict[str, float]:
    with ray_cluster(3) as cluster:
        log_dir, run = trainer(
            api,
            work,
            "node",
            workers=(2, 3),
            every=5,
            state_mb=8,
            failures=1,
            epochs=3 * EPOCHS,  # long enough for the grow-back
            placement_strategy="SPREAD",
            elastic_resize_monitor_interval_s=2.0,
            register=args.register,
        )
        fit = Background(run.fit)
        at_fault = wait_for(lambda: _epoch_rows(log_dir, FAULT_AT), fit, "the fault epoch")
        victim = next(r["node"] for r in reversed(at_fault) if r["rank"] == 2)
        fault = lose_a_node(cluster, victim, rejoin_after_s=3.0)
        result = fit.result()
    log = rows(log_dir)
    figures = after_fault(log, fault)
    rank0 = [r for r in log if r["rank"] == 0 and r["time"] > fault]
    grown = next((i for i, r in enumerate(rank0) if r["world"] == 3), None)
    if grown:
        figures["grow_pause_s"] = rank0[grown]["time"] - rank0[grown - 1]["time"]
        # the report that stops a group to grow raises out of the loop before its note:
        # the last noted epoch may be one before the checkpoint resumed from
        last = rank0[grown - 1]["epoch"] + 1
        figures["grow_redone"] = max(0, last - rank0[grown]["resumed_from"])
    return {**figures, **our_phases(result), "wall_s": fit.wall_s}


def our_phases(result) -> Dict[str, float]:
    """Where our recovery's time went (detection to decision, the re-form), from the
    summary; Ray Train's result has none."""
    summary = getattr(result, "summary", None)  # only raytrain_ext's Result has one
    if not summary or not summary["recoveries"]:
        return {}
    recovery = summary["recoveries"][0]
    return {"decided_s": recovery["decided_s"], "reform_s": recovery.get("reform_s")}


def _epoch_rows(log_dir: Path, epoch: int):
    found = rows(log_dir)
    return found if any(r["epoch"] >= epoch for r in found) else None


def kill_vs_torchft(api: str, work: Path, args) -> Dict[str, float]:
    """``kill`` for ours; for the peer, Ray Train with torchft (``torchft_peer``)."""
    if api == APIS["Ray Train"]:
        from torchft_peer import kill_torchft

        return kill_torchft(work)
    figures = kill(api, work, args)
    return {**figures, "replaced_s": figures["first_report_after_s"]}


SCENARIOS: Dict[str, Callable] = {
    "steady": steady,
    "kill": kill,
    "kill-torchft": kill_vs_torchft,
    "data": data,
    "kill-slow-storage": kill_slow_storage,
    "node-loss": node_loss,
}


def report(name: str, results: Dict[str, List[Dict[str, float]]]) -> None:
    theirs, ours = results["Ray Train"], results["raytrain_ext"]
    print(f"\n== {name}: min-max over {len(ours)} run(s); ratio = Ray Train / raytrain_ext")
    for key in ours[0]:
        a = [r.get(key) for r in theirs]
        b = [r.get(key) for r in ours]
        line = f"  {key:24s} Ray Train {_span(a)}   raytrain_ext {_span(b)}"
        if all(x is not None and y for x, y in zip(a, b, strict=True)):
            ratios = [x / y for x, y in zip(a, b, strict=True)]
            line += f"   ratio {min(ratios):.2f}-{max(ratios):.2f}x"
        print(line, flush=True)


def _span(values) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return f"{min(values):.3f}-{max(values):.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="all")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--state-mb", type=int, default=300)
    parser.add_argument("--register", action="store_true", help="ours: train.register(...)")
    parser.add_argument("--fault-at", type=int, default=FAULT_AT, help="kill: the fault's epoch")
    parser.add_argument(
        "--upload-s", type=float, default=3.0, help="kill-slow-storage: seconds per checkpoint"
    )
    parser.add_argument(
        "--fault-delay-s",
        type=float,
        default=0.5,
        help="kill-slow-storage: from the checkpointed report to the fault",
    )
    args = parser.parse_args()
    every = [name for name in SCENARIOS if name != "kill-torchft"]  # torchft: installed by hand
    chosen = every if args.scenario == "all" else [args.scenario]
    for name in chosen:
        results: Dict[str, List[Dict[str, float]]] = {label: [] for label in APIS}
        for repeat in range(args.repeats):
            for label, api in APIS.items():  # alternating, Ray Train first
                with tempfile.TemporaryDirectory(prefix="ray-train-loop-") as tmp:
                    if name in ("steady", "data"):
                        import ray

                        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
                    try:
                        figures = SCENARIOS[name](api, Path(tmp), args)
                    finally:
                        if name in ("steady", "data"):
                            ray.shutdown()
                    results[label].append(figures)
                    print(f"{name} run {repeat} {label}: {figures}", flush=True)
        report(name, results)


if __name__ == "__main__":
    main()
