"""Ray Train's documented loop patterns, written once against an API module named in the
loop's config (``"ray.train"`` or ``"raytrain_ext.train"``), so the same loop runs under
Ray Train and under raytrain_ext.train and their results can be compared."""

from __future__ import annotations

import importlib
import os
import tempfile
import time

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
    start = 0
    checkpoint = train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            state = torch.load(os.path.join(directory, "state.pt"))
        _unwrapped(model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["epoch"] + 1
    context = train.get_context()
    for epoch in range(start, config["epochs"]):
        if context.get_world_size() > 1:
            loader.sampler.set_epoch(epoch)
        total = 0.0
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item()
            time.sleep(config.get("step_sleep_s", 0.0))
        metrics = {"epoch": epoch, "loss": total / len(loader), "pid": os.getpid()}
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


def _unwrapped(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
