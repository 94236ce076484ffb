"""What ``train.register`` costs a report under FSDP: the copy, the copy sent to a peer, and
the registered state's DCP files in a report that carries a checkpoint.

Two gloo ranks (no Ray) shard an MLP with FSDP2 and AdamW (one step taken, so the optimizer
holds its moments), register it, and make reports.  Timed per report, median of
``--reports``: (a) ``register`` without ``copy_to_peer`` (this rank's host copy), against a
plain ``torch`` copy of the same bytes into a kept buffer; (b) with ``copy_to_peer=True`` (the copy, then
``exchange_tree`` to the peer), against a raw ``isend``/``irecv`` of one flat buffer of the
same bytes plus the plain copy: the physical floor of what (b) does; (c) a report with a
checkpoint, whose registered state every rank writes as DCP files into its staged report
(``registered_files``, to the temporary directory), against a plain ``torch.save`` of this
rank's local shards to a file there (what a loop would write itself).

Usage: python jobs/bench/registered_copies.py [--hidden 2048] [--layers 8] [--reports 7]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from raytrain_ext.parallel.tree_broadcast import map_leaves  # noqa: E402
from raytrain_ext.user_loop.registered import (  # noqa: E402
    Registration,
    SnapshotKeeper,
    peer_exchange,
    peer_ranks,
)
from raytrain_ext.user_loop.registered_files import RegisteredFiles  # noqa: E402
from tests.helpers.dist import distinct_free_ports, init_local_rank, spawn_ranks  # noqa: E402


def _model(hidden: int, layers: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(hidden, hidden) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, hidden)).sum().backward()
    optimizer.step()
    return {"model": model, "optimizer": optimizer, "progress": {"epoch": 1}}


def _timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])  # the first allocates every buffer


def _report(registration: Registration, reports) -> None:
    registration.at_report(next(reports), {})


def _write_files(objects) -> None:
    """The registered state's DCP files of one report (every rank), then gone again."""
    staged = RegisteredFiles().add_to(None, objects, "bench")
    shutil.rmtree(staged.directory)


def _torch_save(local) -> None:
    directory = tempfile.mkdtemp(prefix="bench-torch-save-")
    torch.save(local, os.path.join(directory, "state.pt"))
    shutil.rmtree(directory)


def _rank(rank: int, port: int, args: dict, out: str) -> None:
    init_local_rank(rank, 2, port)
    torch.set_num_threads(1)
    objects = _model(args["hidden"], args["layers"], 2)
    dst, src = peer_ranks([0, 1], rank)
    exchange = peer_exchange([0, 1], rank)
    figures = {}
    for peer in (False, True):
        registration = Registration("bench", 0, None, SnapshotKeeper(), None, 2, exchange)
        registration.register(objects, copy_to_peer=peer)
        reports = iter(range(1, 1000))
        figures[peer] = _timed(functools.partial(_report, registration, reports), args["reports"])
    local = registration.keeper.latest.state  # this rank's part, as copied
    found: list = []
    map_leaves(local, lambda v: found.append(v) if isinstance(v, torch.Tensor) else None)
    flat = torch.cat([t.reshape(-1).float() for t in found if t.numel() > 1])
    into = torch.empty_like(flat)  # as register's copy, into buffers it keeps
    copy_s = _timed(lambda: into.copy_(flat), args["reports"])
    incoming = torch.empty_like(flat)

    def raw_exchange() -> None:
        ops = [dist.P2POp(dist.isend, flat, dst), dist.P2POp(dist.irecv, incoming, src)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    send_s = _timed(raw_exchange, args["reports"])
    files_s = _timed(functools.partial(_write_files, objects), args["reports"])
    save_s = _timed(functools.partial(_torch_save, local), args["reports"])
    if rank == 0:
        Path(out).write_text(
            json.dumps(
                {
                    "bytes": flat.numel() * 4,
                    "register_s": figures[False],
                    "copy_s": copy_s,
                    "register_peer_s": figures[True],
                    "floor_peer_s": copy_s + send_s,
                    "files_s": files_s,
                    "torch_save_s": save_s,
                }
            )
        )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--reports", type=int, default=7)
    args = vars(parser.parse_args())
    out = tempfile.mktemp(suffix=".json")
    spawn_ranks(_rank, (distinct_free_ports(1)[0], args, out), nprocs=2, deadline_s=600)
    f = json.loads(Path(out).read_text())
    mib = f["bytes"] / 2**20
    print(f"FSDP2 over 2 gloo ranks, {args['layers']} x Linear({args['hidden']}), AdamW: ")
    print(f"  each rank's part: {mib:.1f} MiB (parameters and both moments)")
    print(
        f"  register, per report: {1e3 * f['register_s']:.1f} ms; a plain copy of the same "
        f"bytes {1e3 * f['copy_s']:.1f} ms ({f['register_s'] / f['copy_s']:.2f}x)"
    )
    print(
        f"  register(copy_to_peer=True), per report: {1e3 * f['register_peer_s']:.1f} ms; the "
        f"plain copy plus a raw isend/irecv of the same bytes {1e3 * f['floor_peer_s']:.1f} ms "
        f"({f['register_peer_s'] / f['floor_peer_s']:.2f}x)"
    )
    print(
        f"  a report with a checkpoint, the registered state's DCP files: "
        f"{1e3 * f['files_s']:.1f} ms; torch.save of the rank's shards "
        f"{1e3 * f['torch_save_s']:.1f} ms ({f['files_s'] / f['torch_save_s']:.2f}x)"
    )


if __name__ == "__main__":
    main()
