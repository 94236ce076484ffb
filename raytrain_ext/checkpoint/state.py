"""What goes into a checkpoint, as one DCP state dict.

- ``model`` and ``optim``: from ``get_state_dict`` (FQN-keyed, sharding-aware),
  so DCP saves each rank's shards and loads them onto any layout.
- ``train``: the small replicated items (step, sampler, scheduler, ledger,
  world size, config digest) as JSON bytes; identical on every rank, so DCP
  keeps one copy.
- ``rng/rank<r>``: each rank's Python, NumPy, torch CPU and CUDA RNG states.
- ``reference`` (DPO only): the reference log-probs table, replicated like ``train``.
- ``train``'s ``rollout_carried`` (GRPO, regular saves): the results of the generations
  made with weights older than the checkpoint's (``rollout.schedule``), as plain values.

``snapshot`` copies the tensors to host memory (pinned on GPU) so training can
continue while the copy is serialised in the background.  A sharded (FSDP/TP)
``DTensor`` is copied shard by shard and stays a ``DTensor`` with the same mesh
and placements, so DCP still writes each rank's shard at its global offset.
The memory tier holds the files DCP wrote, so it needs nothing layout-specific.
"""

from __future__ import annotations

import enum
import io
import json
import pickle
import random
from typing import Any, Dict, List

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import _get_scalar_dtype

from raytrain_ext.checkpoint.phases import RestorePhases
from raytrain_ext.checkpoint.train_state import TrainState
from raytrain_ext.parallel.stage_state import whole_model_keys

TRAIN_KEY = "train"
REFERENCE_KEY = "reference"
ROLLOUT_ITEM = "rollout_carried"  # in ``train``: GRPO's results made with older weights


def rng_key(rank: int) -> str:
    return f"rng/rank{rank}"


def capture_rng() -> bytes:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state().numpy().tobytes(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.numpy().tobytes() for s in torch.cuda.get_rng_state_all()]
    return pickle.dumps(state)


def restore_rng(blob: bytes) -> None:
    state = pickle.loads(blob)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(
            [torch.frombuffer(bytearray(s), dtype=torch.uint8) for s in state["cuda"]]
        )


def train_items(state: TrainState) -> Dict[str, Any]:
    return {
        "step": state.progress.step,
        "world_size": state.ctx.world_size,
        "sampler": state.sampler.state_dict(),
        "scheduler": state.scheduler.state_dict(),
        "ledger": state.ledger.state_dict(),
        "config_digest": state.config_digest,
        "skip_steps": sorted(state.progress.skip_steps),
        "nonfinite_steps": state.progress.nonfinite_steps,
    }


def model_and_optim(state: TrainState):
    """(model, optimizer) state dicts, FQN-keyed, in ``get_state_dict``'s format (ZeRO
    assembles its partitions into the same format)."""
    return state.strategy.state_dicts(state.model, state.optimizer)


class Carry(enum.Enum):
    """What a save carries of GRPO's generations made with older weights
    (``TrainState.rollout``): none (a per-step snapshot: the engines outlive the
    trainers it serves), the one the next step trains on (a save under a preemption
    deadline), or all of them."""

    NONE = "none"
    NEXT = "next"
    ALL = "all"


def capture(state: TrainState, carry: Carry = Carry.NONE) -> Dict[str, Any]:
    """The live state dict (tensors are references to the training tensors)."""
    model_sd, optim_sd = model_and_optim(state)
    items = train_items(state)
    if state.rollout is not None and carry is not Carry.NONE:
        items[ROLLOUT_ITEM] = state.rollout.carried(state.progress.step, carry is Carry.NEXT)
    captured = {
        "model": model_sd,
        "optim": optim_sd,
        TRAIN_KEY: io.BytesIO(json.dumps(items).encode()),
        rng_key(state.ctx.rank): io.BytesIO(capture_rng()),
    }
    if state.reference is not None:
        captured[REFERENCE_KEY] = io.BytesIO(state.reference.to_bytes())
    return captured


def snapshot(state: Any, reuse: Any = None) -> Any:
    """Deep copy to host memory (pinned for GPU tensors, copied without blocking).

    ``reuse`` is the previous snapshot, whose persistence has finished: its host
    buffers are overwritten in place when shapes match, so a save costs one
    memory copy and no fresh allocation or page faults.
    """
    if isinstance(state, DTensor):
        return _snapshot_dtensor(state, reuse)
    if isinstance(state, torch.Tensor):
        host = (
            reuse
            if _same_layout(reuse, state)
            else torch.empty(state.shape, dtype=state.dtype, pin_memory=state.device.type == "cuda")
        )
        return host.copy_(state.detach(), non_blocking=state.device.type == "cuda")
    if isinstance(state, dict):
        old_items = reuse if isinstance(reuse, dict) else {}
        return {k: snapshot(v, old_items.get(k)) for k, v in state.items()}
    if isinstance(state, list):
        same = isinstance(reuse, list) and len(reuse) == len(state)
        old = reuse if same else [None] * len(state)
        return [snapshot(v, o) for v, o in zip(state, old, strict=True)]
    if isinstance(state, io.BytesIO):
        return io.BytesIO(state.getvalue())
    return state


def _snapshot_dtensor(state: DTensor, reuse: Any) -> DTensor:
    """Host copy of this rank's shard, wrapped with the original spec.

    Built with the ``DTensor`` constructor rather than ``from_local``, which
    would move the shard back to the mesh's device (GPU); torch's own async
    checkpoint staging swaps in a host shard the same way.
    """
    old_local = reuse.to_local() if isinstance(reuse, DTensor) else None
    local = snapshot(state.to_local(), old_local)
    return DTensor(local, state._spec, requires_grad=False)


def _same_layout(host: Any, tensor: torch.Tensor) -> bool:
    return (
        isinstance(host, torch.Tensor)
        and host.shape == tensor.shape
        and host.dtype == tensor.dtype
        and host.device.type == "cpu"
    )


def load_targets(state: TrainState, saved_world_size: int) -> Dict[str, Any]:
    """The state dict DCP loads into: live model/optimizer tensors plus byte buffers."""
    if not state.strategy.owns_optimizer_state:
        preallocate_adam_state(state.optimizer)
    model_sd, optim_sd = model_and_optim(state)
    targets: Dict[str, Any] = {"model": model_sd, "optim": optim_sd, TRAIN_KEY: io.BytesIO()}
    if state.ctx.rank < saved_world_size:
        targets[rng_key(state.ctx.rank)] = io.BytesIO()
    if state.reference is not None:
        targets[REFERENCE_KEY] = io.BytesIO()
    return targets


def preallocate_adam_state(optimizer) -> None:
    """Give a fresh Adam/AdamW its state tensors, allocated but not filled.

    Why: ``get_state_dict`` initialises an empty optimizer with a zero-gradient ``step()``
    (zero gradients, a full AdamW update, first-touch page faults on three fresh copies
    of the parameters): 0.36-0.39 s of a 0.72-0.77 s restore of 307 MB here.  The restore
    overwrites every value it allocates, and a restore that finds no usable checkpoint
    raises, so the unfilled values are never used.  Only torch's Adam and AdamW, whose
    state layout is known; other optimizers keep ``get_state_dict``'s own path.
    """
    if optimizer.state or type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return
    scalar = _get_scalar_dtype()
    for group in optimizer.param_groups:
        on_device = group["capturable"] or group["fused"]
        for param in group["params"]:
            if not param.requires_grad:
                continue
            state = optimizer.state[param]
            state["step"] = (
                torch.zeros((), dtype=scalar, device=param.device)
                if on_device
                else torch.tensor(0.0, dtype=scalar)
            )
            state["exp_avg"] = torch.empty_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.empty_like(param, memory_format=torch.preserve_format)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.empty_like(
                    param, memory_format=torch.preserve_format
                )


def tensor_bytes(state: Any) -> int:
    """Bytes of this rank's tensors in a nested state dict (a DTensor counts its shard)."""
    if isinstance(state, DTensor):
        return tensor_bytes(state.to_local())
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(tensor_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(tensor_bytes(value) for value in state)
    return 0


def without_model(targets: Dict[str, Any]) -> Dict[str, Any]:
    """The targets a native load still needs from DCP: train items and RNG."""
    return {key: value for key, value in targets.items() if key not in ("model", "optim")}


def apply_model_and_optim(state: TrainState, loaded: Dict[str, Any], phases: RestorePhases) -> None:
    """Install the model, then the optimizer, timing each (ZeRO installs both at once,
    timed as ``model``)."""
    state.strategy.load_state_dicts(
        state.model, state.optimizer, loaded["model"], loaded["optim"], phases.time
    )


def apply_train(state: TrainState, loaded: Dict[str, Any]) -> Dict[str, Any]:
    """Install the ``train`` items and this rank's RNG; returns the items."""
    items = json.loads(loaded[TRAIN_KEY].getvalue())
    state.progress.step = items["step"]
    state.sampler.load_state_dict(items["sampler"])
    state.scheduler.load_state_dict(items["scheduler"])
    state.ledger.load_state_dict(items["ledger"])
    state.progress.skip_steps |= set(
        items.get("skip_steps", [])
    )  # a rollback's skips outlive the restore
    state.progress.nonfinite_steps = max(
        state.progress.nonfinite_steps, items.get("nonfinite_steps", 0)
    )
    key = rng_key(state.ctx.rank)
    if key in loaded:
        restore_rng(loaded[key].getvalue())
    if state.reference is not None:
        state.reference.load_bytes(loaded[REFERENCE_KEY].getvalue())
    if state.rollout is not None:
        state.rollout.load_carried(items.get(ROLLOUT_ITEM, {}))
    return items


def shape_mismatches(metadata, targets: Dict[str, Any]) -> List[str]:
    """Model keys whose shapes differ from (or are absent in) the checkpoint's metadata."""
    problems = []
    for name, tensor in targets["model"].items():
        key = f"model.{name}"
        entry = metadata.state_dict_metadata.get(key)
        if entry is None:
            problems.append(f"{key}: not in the checkpoint")
        elif hasattr(entry, "size") and tuple(entry.size) != tuple(tensor.shape):
            problems.append(f"{key}: checkpoint {list(entry.size)} vs model {list(tensor.shape)}")
    saved = {k for k in metadata.state_dict_metadata if k.startswith("model.")}
    # a pipeline stage holds part of the model; the other stages' keys are not extra
    known = whole_model_keys(targets["model"])
    problems += [
        f"{k}: in the checkpoint but not in the model"
        for k in sorted(saved - {f"model.{n}" for n in known})
    ]
    return problems
