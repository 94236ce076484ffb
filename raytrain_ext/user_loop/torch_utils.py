"""``prepare_model``, ``prepare_data_loader``, ``get_device``: Ray Train's helpers, over the
process group this rank's worker formed (NCCL on GPU, gloo on CPU)."""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler


def get_device() -> torch.device:
    """This rank's device: its GPU (the worker set it current), else the CPU."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def prepare_model(
    model: torch.nn.Module,
    move_to_device: bool = True,
    parallel_strategy: Optional[str] = "ddp",
    parallel_strategy_kwargs: Optional[Dict[str, Any]] = None,
) -> torch.nn.Module:
    """The model on this rank's device, wrapped in DDP when the group has more than one
    rank (``parallel_strategy=None`` leaves it unwrapped; FSDP goes through
    ``torch.distributed.fsdp.fully_shard`` in the loop itself)."""
    if parallel_strategy not in ("ddp", None):
        raise ValueError(
            f"prepare_model(parallel_strategy={parallel_strategy!r}): 'ddp' or None; shard "
            "with torch.distributed.fsdp.fully_shard inside the loop"
        )
    device = get_device()
    if move_to_device:
        model = model.to(device)
    if parallel_strategy is None or dist.get_world_size() == 1:
        return model
    kwargs = dict(parallel_strategy_kwargs or {})
    if device.type == "cuda":
        kwargs.setdefault("device_ids", [device.index])
    return DistributedDataParallel(model, **kwargs)


def prepare_data_loader(
    data_loader: DataLoader,
    add_dist_sampler: bool = True,
    move_to_device: bool = True,
    auto_transfer: bool = True,
) -> DataLoader:
    """The loader with a ``DistributedSampler`` (this rank's share, the loader's shuffle
    kept), yielding batches on this rank's device, as Ray Train's does."""
    loader = data_loader
    if add_dist_sampler and dist.get_world_size() > 1:
        shuffle = not isinstance(data_loader.sampler, torch.utils.data.SequentialSampler)
        loader = DataLoader(
            data_loader.dataset,
            batch_size=data_loader.batch_size,
            shuffle=False,
            sampler=DistributedSampler(data_loader.dataset, shuffle=shuffle),
            num_workers=data_loader.num_workers,
            collate_fn=data_loader.collate_fn,
            pin_memory=data_loader.pin_memory,
            drop_last=data_loader.drop_last,
            timeout=data_loader.timeout,
            worker_init_fn=data_loader.worker_init_fn,
        )
    if not move_to_device:
        return loader
    return DeviceLoader(loader, get_device())


class DeviceLoader:
    """A loader whose batches (tensors, or lists/tuples/dicts of them) are on ``device``;
    ``sampler`` (call its ``set_epoch``) and ``dataset`` are the wrapped loader's."""

    def __init__(self, loader: DataLoader, device: torch.device):
        self.loader, self.device = loader, device
        self.sampler = loader.sampler
        self.dataset = loader.dataset

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            yield _to(batch, self.device)


def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    return batch
