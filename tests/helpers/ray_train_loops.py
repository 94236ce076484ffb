"""Ray Train's documented loop patterns, written once against an API module named in the
loop's config (``"ray.train"`` or ``"raytrain_ext.train"``), so the same loop runs under
Ray Train and under raytrain_ext.train and their results can be compared."""

from __future__ import annotations

import importlib
import os
import tempfile
import time
from typing import Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

RAY_TRAIN = "ray.train"
OURS = "raytrain_ext.train"


def api(config):
    """(train, train.torch, Checkpoint) of the API the config names."""
    train = importlib.import_module(config["api"])
    return train, importlib.import_module(config["api"] + ".torch"), train.Checkpoint


def synthetic_data(n: int = 256, features: int = 8) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, 1, generator=g)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(n, 1, generator=g))


def quickstart_loop(config):
    """The TorchTrainer quick start: a model, an optimizer, prepare_model,
    prepare_data_loader over a synthetic dataset, report with metrics every epoch; with
    ``checkpoint_every``, rank 0 saves a directory and the loop resumes from
    get_checkpoint; ``step_sleep_s`` slows each batch (fault tests); with ``rows``, each
    epoch also iterates ``get_dataset_shard("train")`` (Ray Data) and reports the rows it
    saw."""
    train, train_torch, Checkpoint = api(config)
    torch.manual_seed(0)
    model = train_torch.prepare_model(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = train_torch.prepare_data_loader(
        DataLoader(synthetic_data(), batch_size=config.get("batch_size", 16), shuffle=True)
    )
    state = _restored(train, model, optimizer)
    start = 0 if state is None else state["epoch"] + 1
    context = train.get_context()
    for epoch in range(start, config["epochs"]):
        if context.get_world_size() > 1:
            loader.sampler.set_epoch(epoch)
        metrics = {"epoch": epoch, "loss": _epoch(model, optimizer, loader, config)}
        metrics["pid"] = os.getpid()
        if config.get("rows"):
            shard = train.get_dataset_shard("train")
            metrics["rows"] = sum(len(b["id"]) for b in shard.iter_torch_batches(batch_size=8))
        every = config.get("checkpoint_every")
        if not every or (epoch + 1) % every:
            train.report(metrics)
            continue
        with tempfile.TemporaryDirectory() as directory:
            saved = None
            if context.get_world_rank() == 0:
                state = {
                    "model": _unwrapped(model).state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "epoch": epoch,
                }
                torch.save(state, os.path.join(directory, "state.pt"))
                saved = Checkpoint.from_directory(directory)
            train.report(metrics, checkpoint=saved)


def registered_loop(config):
    """The quick start handing its state to ``raytrain_ext.train.register`` (SGD with
    momentum, so the optimizer has state; the epoch in a progress dict) and reporting every
    epoch with no checkpoint at all: a re-formed group goes on from the newest report a
    live process holds.  ``config["fsdp"]``: the model sharded by FSDP2 over every rank
    instead of DDP, each rank's copy also sent to a peer (``copy_to_peer``, unless the
    config says False).  ``checkpoint_every``: rank 0 reports an empty directory as a
    checkpoint every that many epochs (the registered state is all it holds);
    ``stop_after``: return after that many epochs; ``digest``: each report carries
    ``state_digest`` of the whole registered state, and the first ``restored_digest``, of
    what ``register`` loaded."""
    train, train_torch, Checkpoint = api(config)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    fsdp = bool(config.get("fsdp"))
    model = _fully_sharded(model, train) if fsdp else train_torch.prepare_model(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    loader = train_torch.prepare_data_loader(
        DataLoader(synthetic_data(), batch_size=16, shuffle=True)
    )
    progress = {"epoch": 0}
    copy_to_peer = config.get("copy_to_peer", fsdp)
    train.register(model=model, optimizer=optimizer, progress=progress, copy_to_peer=copy_to_peer)
    digest = bool(config.get("digest"))
    extra = {"restored_digest": _digest(model, optimizer, progress)} if digest else {}
    every = config.get("checkpoint_every", 0)
    while progress["epoch"] < config["epochs"]:
        epoch = progress["epoch"]
        loader.sampler.set_epoch(epoch)
        loss = _epoch(model, optimizer, loader, config)
        progress["epoch"] = epoch + 1
        if digest:
            extra["state_digest"] = _digest(model, optimizer, progress)
        metrics = {"epoch": epoch, "loss": loss, "pid": os.getpid(), **extra}
        extra = {}
        with tempfile.TemporaryDirectory() as directory:
            saved = every and progress["epoch"] % every == 0
            rank_0 = train.get_context().get_world_rank() == 0
            train.report(
                metrics, Checkpoint.from_directory(directory) if saved and rank_0 else None
            )
        if progress["epoch"] == config.get("stop_after"):
            return


def _digest(model: nn.Module, optimizer, progress: dict) -> str:
    """sha256 of the whole parameters, momentum buffers and progress (FSDP's shards
    gathered: a collective, on every rank)."""
    import hashlib

    from torch.distributed.tensor import DTensor

    def whole(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if isinstance(t, DTensor) else t

    h = hashlib.sha256(repr(sorted(progress.items())).encode())
    for p in model.parameters():
        h.update(whole(p).detach().numpy().tobytes())
        buffer = optimizer.state.get(p, {}).get("momentum_buffer")
        h.update(b"-" if buffer is None else whole(buffer).numpy().tobytes())
    return h.hexdigest()


def _fully_sharded(model: nn.Module, train) -> nn.Module:
    """``model`` under FSDP2 over every rank of the group (each layer, then the whole)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (train.get_context().get_world_size(),))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _epoch(model: nn.Module, optimizer, loader, config) -> float:
    """One pass over the loader; the mean of its batches' losses."""
    total = 0.0
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total += loss.item()
        time.sleep(config.get("step_sleep_s", 0.0))
    return total / len(loader)


def line_rows(n: int):
    """``n`` rows ``{"id", "x", "y"}`` on the line y = 3x + 1, for ``ray.data.from_items``."""
    return [{"id": i, "x": (i % 17) / 17.0, "y": 3.0 * (i % 17) / 17.0 + 1.0} for i in range(n)]


def dataset_loop(config):
    """A loop fed by ``get_dataset_shard("train")`` alone: one report per batch, carrying
    the ids every rank trained on (gathered), its epoch and the loop's report count; rank 0
    checkpoints the model, optimizer, epoch and count every ``checkpoint_every`` reports
    and at the end, and the loop resumes from ``get_checkpoint`` mid-epoch (the shard
    resumes there by itself).  ``stop_after``: return after that many reports;
    ``shrunk_step_sleep_s`` replaces ``step_sleep_s`` while the group is smaller than
    ``full_world`` (a grow-back test keeps the run going until the new node's process is
    warm, however slowly it imports on a loaded machine)."""
    import torch.distributed as dist

    train, train_torch, Checkpoint = api(config)
    torch.manual_seed(0)
    model = train_torch.prepare_model(nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = _restored(train, model, optimizer)
    epoch, count = (0, 0) if state is None else (state["epoch"], state["count"])
    shard = train.get_dataset_shard("train")
    dtypes = {"id": torch.int64, "x": torch.float32, "y": torch.float32}

    def report(metrics, save):
        saved = None
        with tempfile.TemporaryDirectory() as directory:
            if save and train.get_context().get_world_rank() == 0:
                state = {
                    "model": _unwrapped(model).state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "epoch": epoch,
                    "count": count,
                }
                torch.save(state, os.path.join(directory, "state.pt"))
                saved = Checkpoint.from_directory(directory)
            train.report({**metrics, "pid": os.getpid(), "count": count}, checkpoint=saved)

    loss = torch.zeros(())
    while epoch < config["epochs"]:
        for batch in shard.iter_torch_batches(batch_size=config["batch_size"], dtypes=dtypes):
            loss = nn.functional.mse_loss(model(batch["x"][:, None]), batch["y"][:, None])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ids = [None] * dist.get_world_size()
            dist.all_gather_object(ids, batch["id"].tolist())
            count += 1
            report({"epoch": epoch, "loss": loss.item(), "ids": ids}, count % config["every"] == 0)
            if count == config.get("stop_after"):
                return
            shrunk = dist.get_world_size() < config.get("full_world", 0)
            time.sleep(config["shrunk_step_sleep_s"] if shrunk else config.get("step_sleep_s", 0.0))
        epoch += 1
    count += 1
    report({"epoch": epoch, "loss": loss.item(), "done": True}, True)


def standing_ids(history):
    """{epoch: [ids]} of the reports that stand: a report whose count was reported before
    (the loop resumed from an earlier checkpoint) replaces that one and every later one.
    One redone by a group of the same size must have trained on the same rows."""
    standing: dict = {}
    for m in history:
        if "ids" not in m:
            continue
        for count in [c for c in standing if c >= m["count"]]:
            old = standing.pop(count)
            if count == m["count"] and len(old["ids"]) == len(m["ids"]):
                assert old["ids"] == m["ids"], f"report {count} redone on other rows"
        standing[m["count"]] = m
    ids: dict = {}
    for m in standing.values():
        ids.setdefault(m["epoch"], []).extend(i for rank in m["ids"] for i in rank)
    return ids


def _restored(train, model: nn.Module, optimizer) -> Optional[dict]:
    """``get_checkpoint``'s ``state.pt`` loaded into the model and the optimizer, and
    returned (None: no checkpoint yet)."""
    checkpoint = train.get_checkpoint()
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as directory:
        state = torch.load(os.path.join(directory, "state.pt"))
    _unwrapped(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state


def _unwrapped(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def environment_loop(config):
    """Reports what each rank's process was started with that the test asks about."""
    train, _, _ = api(config)
    train.report({"malloc_arena_max": int(os.environ.get("MALLOC_ARENA_MAX", "0"))})
