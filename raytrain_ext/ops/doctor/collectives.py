"""Collective bandwidth: nccl-tests' size and bandwidth definitions, and the timed sweep.

Numbers are comparable with ``all_reduce_perf`` and friends because the
definitions are theirs (nccl-tests doc/PERFORMANCE.md):

* ``S`` is the total array size in bytes: the buffer for all_reduce and
  broadcast; for all_gather the gathered output (each rank sends ``S/n``);
  for reduce_scatter the input (each rank receives ``S/n``).
* ``algbw = S / t`` and ``busbw = algbw * factor`` with factor ``2(n-1)/n``
  for all_reduce, ``(n-1)/n`` for all_gather and reduce_scatter, ``1`` for
  broadcast.  GB/s means 1e9 bytes per second.
* ``t`` is the mean time of one operation over ``iters`` back-to-back calls
  after ``warmup`` calls; the slowest rank's mean is reported, since a
  collective finishes when its last rank does.

Elements are float32.  A size that does not split into whole elements per
rank is rounded down (at least one element per rank); the row reports the
size actually moved.
"""

from __future__ import annotations

import re
import time
from typing import Dict, List, Sequence, Tuple

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
ELEMENT_BYTES = 4  # float32
_UNITS = {
    "": 1,
    "B": 1,
    "K": 1024,
    "KB": 1024,
    "M": 1024**2,
    "MB": 1024**2,
    "G": 1024**3,
    "GB": 1024**3,
}


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw for ``op`` on ``n`` ranks."""
    if n < 1:
        raise ValueError(f"world size must be >= 1, got {n}")
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    if op == "broadcast":
        return 1.0
    raise ValueError(f"unknown collective {op!r}; expected one of {', '.join(OPS)}")


def algbw_gbps(size_bytes: int, seconds: float) -> float:
    return size_bytes / seconds / 1e9


def busbw_gbps(op: str, size_bytes: int, seconds: float, n: int) -> float:
    return algbw_gbps(size_bytes, seconds) * bus_factor(op, n)


def parse_size(text: str) -> int:
    """``'1K'`` -> 1024, ``'64M'`` -> 67108864, ``'1G'`` -> 1073741824 (binary units, as nccl-tests)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?B?)\s*", str(text).upper())
    if not m:
        raise ValueError(f"size {text!r} is not a byte count like 1024, 1K, 64M or 1G")
    return int(m.group(1)) * _UNITS[m.group(2)]


def size_range(min_bytes: int, max_bytes: int, factor: int) -> List[int]:
    """``min, min*factor, ...`` up to ``max`` inclusive (nccl-tests' -b/-e/-f)."""
    if min_bytes < 1 or max_bytes < min_bytes:
        raise ValueError(f"size range {min_bytes}..{max_bytes}: need 1 <= --min-size <= --max-size")
    if factor < 2:
        raise ValueError(f"--step-factor must be >= 2, got {factor}")
    sizes, s = [], min_bytes
    while s <= max_bytes:
        sizes.append(s)
        s *= factor
    return sizes


def elements(op: str, size_bytes: int, n: int) -> Tuple[int, int]:
    """(elements per rank buffer, total bytes actually moved) for a requested size.

    For all_gather/reduce_scatter the per-rank count is the shard: ``S/n``.
    """
    if op in ("all_gather", "reduce_scatter"):
        per_rank = max(1, size_bytes // (ELEMENT_BYTES * n))
        return per_rank, per_rank * ELEMENT_BYTES * n
    count = max(1, size_bytes // ELEMENT_BYTES)
    return count, count * ELEMENT_BYTES


def run_sweep(
    ops: Sequence[str], sizes: Sequence[int], iters: int, warmup: int, device
) -> List[Dict]:
    """Time every (op, size) on the initialized default process group; call on every rank.

    Every rank walks the same list in the same order (a collective per step),
    so ranks stay in lock step.  Returns rows with the slowest rank's time.
    """
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    rows = []
    for op in ops:
        for size in sizes:
            count, moved = elements(op, size, n)
            inp, out = _buffers(op, count, n, device)
            for _ in range(warmup):
                _collective(op, inp, out)
            mean_s = _timed(op, inp, out, iters, device)
            slowest = torch.tensor([mean_s], dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            t = float(slowest.item())
            rows.append(
                {
                    "op": op,
                    "size_bytes": moved,
                    "count": count,
                    "ranks": n,
                    "time_us": t * 1e6,
                    "algbw_gbps": algbw_gbps(moved, t),
                    "busbw_gbps": busbw_gbps(op, moved, t, n),
                    "correct": _check(op, count, n, rank, device),
                }
            )
    return rows


def _buffers(op: str, count: int, n: int, device):
    import torch

    if op == "all_gather":
        return torch.ones(count, device=device), torch.empty(count * n, device=device)
    if op == "reduce_scatter":
        return torch.ones(count * n, device=device), torch.empty(count, device=device)
    return torch.ones(count, device=device), None


def _collective(op: str, inp, out) -> None:
    import torch.distributed as dist

    if op == "all_reduce":
        dist.all_reduce(inp)
    elif op == "all_gather":
        # torch 2.13 renamed the flat-tensor forms; older releases only have the old names.
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, inp)
    elif op == "reduce_scatter":
        (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, inp)
    else:
        dist.broadcast(inp, src=0)


def _timed(op: str, inp, out, iters: int, device) -> float:
    import torch
    import torch.distributed as dist

    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        _collective(op, inp, out)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / iters


def _check(op: str, count: int, n: int, rank: int, device) -> bool:
    """One more call on known data (rank r contributes r+1); every rank must agree it is right."""
    import torch
    import torch.distributed as dist

    inp, out = _buffers(op, count, n, device)
    inp.fill_(rank + 1)
    _collective(op, inp, out)
    if op == "all_reduce":
        ok = bool(torch.all(inp == n * (n + 1) / 2))
    elif op == "all_gather":
        expected = torch.arange(1, n + 1, device=device, dtype=out.dtype).repeat_interleave(count)
        ok = bool(torch.equal(out, expected))
    elif op == "reduce_scatter":
        ok = bool(torch.all(out == n * (n + 1) / 2))
    else:
        ok = bool(torch.all(inp == 1))
    flag = torch.tensor([0 if ok else 1], device=device)
    dist.all_reduce(flag)
    return int(flag.item()) == 0
