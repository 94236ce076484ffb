"""DPO's frozen reference, as sequence log-probs computed once.

Why a first pass instead of a second model: the reference is the starting weights,
and its only use is ``log p_ref`` of each sample's chosen and rejected responses.
Computing those for every sample before step 1 (each data-parallel rank its share,
then one all-reduce) costs one forward epoch, needs no second copy of the model in
memory, works under every layout whose forward works, and makes resizes trivial:
every rank holds the whole table, and checkpoints carry it (``reference`` key), so a
restore on any world size reads the same values instead of recomputing them from
weights that no longer exist.

Invariants: ``train[i] = (log p_ref(chosen_i), log p_ref(rejected_i))`` for training
sample ``i``; ``held_out`` likewise for the evaluation samples, in evaluation order.
"""

from __future__ import annotations

import io
from typing import Callable, ContextManager, Optional

import numpy as np
import torch
import torch.distributed as dist

from raytrain_ext.models.spec import batch_logits
from raytrain_ext.objectives import sequence_logps
from raytrain_ext.train.forward_only import inference, lockstep_chunks


class ReferenceLogps:
    """A ``Stateful`` table of reference log-probs (see the module docstring)."""

    def __init__(self) -> None:
        self.train: Optional[np.ndarray] = None
        self.held_out: Optional[np.ndarray] = None

    @property
    def ready(self) -> bool:
        return self.train is not None

    def for_batch(
        self, indices: Optional[np.ndarray], device: torch.device, held_out: bool = False
    ) -> torch.Tensor:
        """``[2 * pairs]`` reference log-probs in a preference batch's row order (the batch
        names its samples: ``Batch.indices``)."""
        table = self.held_out if held_out else self.train
        if table is None or indices is None:
            raise RuntimeError(
                "reference log-probs asked before they were computed, or for a batch without sample indices"
            )
        rows = table[np.asarray(indices, dtype=np.int64)]
        return torch.from_numpy(np.concatenate([rows[:, 0], rows[:, 1]])).to(device)

    def to_bytes(self) -> bytes:
        buffer = io.BytesIO()
        empty = np.zeros((0, 2))
        held_out = empty if self.held_out is None else self.held_out
        np.savez(buffer, train=self.train, held_out=held_out)
        return buffer.getvalue()

    def load_bytes(self, blob: bytes) -> None:
        with np.load(io.BytesIO(blob)) as arrays:
            self.train = arrays["train"]
            self.held_out = arrays["held_out"]


def compute_logps(
    model: torch.nn.Module,
    spec,
    dataset,
    indices: np.ndarray,
    ctx,
    micro_batch: int,
    autocast: Callable[[], ContextManager],
) -> np.ndarray:
    """``[len(indices), 2]`` (chosen, rejected) log-probs of ``dataset`` samples under
    ``model``; every rank returns the whole table."""
    table = torch.zeros((len(indices), 2), dtype=torch.float64)
    with inference(model):
        for chunk, real in lockstep_chunks(len(indices), ctx, micro_batch):
            batch = dataset.batch(indices[chunk]).to(ctx.device)
            with autocast():
                out = batch_logits(spec, model, batch)
            if not (real and ctx.counts_loss):
                continue
            logps = sequence_logps(out, batch).to(torch.float64).cpu()
            table[torch.from_numpy(chunk), 0] = logps[: batch.pairs]
            table[torch.from_numpy(chunk), 1] = logps[batch.pairs :]
    table = table.to(ctx.device)
    if ctx.world_size > 1:
        dist.all_reduce(table)
    return table.cpu().numpy()
