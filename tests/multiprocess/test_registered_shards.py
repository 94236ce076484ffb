"""``register``'s copies of sharded state (``user_loop.registered``), over gloo without Ray.

Four ranks train an MLP under HSDP (``fully_shard`` on a 2 x 2 mesh: two replicas of two
shards), copy their registered state at a report, and train on.  Then rank 1's process is
taken as new (its copy gone) and every rank builds the model and optimizer again from
another seed: the group finds each shard held live (shard 1 on rank 3, rank 1's replica),
each holder broadcasts its shard, and every rank's model and optimizer are the state of
the report again, whole tensors equal to the bit.

Then the copies restore groups of other sizes: the node of ranks 0 and 1 is lost and
ranks 2 and 3 go on as FSDP over 2 ranks (each shard held by one survivor), and a fresh
process joins them as FSDP over 3 ranks, whose chunks (16 rows as 6, 6 and 4; 4 rows as
2, 2 and none) are cut from the joined whole.
"""

import copy
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from raytrain_ext.user_loop.registered import (
    Registration,
    SnapshotKeeper,
    live_start,
    peer_exchange,
)
from raytrain_ext.user_loop.registered_state import layout_of, state_of
from raytrain_ext.worker.dist_env import destroy_distributed
from raytrain_ext.worker.rendezvous import free_port
from tests.helpers.dist import distinct_free_ports, init_local_rank, spawn_ranks
from tests.helpers.registered_mlp import mlp_objects, train_steps, whole_state


def _hsdp_objects(mesh, seed: int) -> dict:
    return mlp_objects(mesh, seed)


def _hsdp_at_report_2(rank: int, port: int):
    """Join the 4 ranks' group, train HSDP (2 replicas x 2 shards) 2 steps and copy the
    state at report 2: the mesh, the objects, the keeper and the whole state there."""
    from torch.distributed.device_mesh import init_device_mesh

    init_local_rank(rank, 4, port)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    objects = _hsdp_objects(mesh, seed=0)
    train_steps(objects, 2)
    keeper = SnapshotKeeper()
    keeper.take("run", 2, {"train": (0, 16)}, objects, layout_of(state_of(objects), 4))
    return mesh, objects, keeper, whole_state(objects)


def _resume_after_a_lost_replica(rank: int, port: int, out_dir: str) -> None:
    try:
        mesh, objects, keeper, expected = _hsdp_at_report_2(rank, port)
        train_steps(objects, 1)  # the live objects move on; the copy stays at report 2
        if rank == 1:
            keeper = SnapshotKeeper()  # a new process: it holds nothing
        offers: list = [None] * 4
        dist.all_gather_object(offers, keeper.offers("run"))
        start = live_start(offers, committed=0, world=4)
        fresh = _hsdp_objects(mesh, seed=1)
        layout = layout_of(state_of(fresh), 4)
        record = keeper.resume("run", start, fresh, layout, group=None)
        got = whole_state(fresh)
        result = {
            "sources": list(start.sources),
            "layout": list(offers[rank][0][2].__dict__.values()) if offers[rank] else None,
            "equal": all(torch.equal(expected[k], got[k]) for k in expected),
            "progress": fresh["progress"],
            "source_rank": record["source_rank"],
            "kept": keeper.offers("run")[0][0],
        }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        destroy_distributed()


def test_hsdp_shards_come_back_from_their_live_replicas(tmp_path):
    spawn_ranks(_resume_after_a_lost_replica, (free_port("127.0.0.1"), str(tmp_path)), nprocs=4)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert [r["layout"] for r in results] == [
        [4, 2, 0, True, 0],  # world, parts, part, sharded, the tensor dimension cut
        None,
        [4, 2, 0, True, 0],
        [4, 2, 1, True, 0],
    ]
    assert all(r["sources"] == [0, 3] for r in results)  # shard 1 from rank 1's replica
    assert [r["source_rank"] for r in results] == [0, 3, 0, 3]
    assert all(r["equal"] for r in results)
    assert all(r["progress"] == {"epoch": 2} and r["kept"] == 2 for r in results)


def _fsdp_objects(world: int, seed: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    return mlp_objects(init_device_mesh("cpu", (world,)), seed)


def _regroup(keeper: SnapshotKeeper, rank: int, world: int, port: int) -> dict:
    """Join a group of ``world`` ranks as ``rank``, build FSDP over all of it from another
    seed and resume from the live copies; the whole state, the layout and the record."""
    init_local_rank(rank, world, port)
    offers: list = [None] * world
    dist.all_gather_object(offers, keeper.offers("run"))
    peers: list = [None] * world
    dist.all_gather_object(peers, keeper.peer_offers("run"))
    start = live_start(offers, committed=0, world=world, peers=peers)
    fresh = _fsdp_objects(world, seed=7)
    layout = layout_of(state_of(fresh), world)
    record = keeper.resume("run", start, fresh, layout, group=None)
    got = whole_state(fresh)
    local = {n: p.to_local().shape[0] for n, p in fresh["model"].named_parameters()}
    progress = dict(fresh["progress"])
    train_steps(fresh, 1)  # the restored objects train on
    destroy_distributed()
    return {"whole": got, "progress": progress, "record": record, "rows": local}


def _shrink_then_grow(rank: int, ports: list, out_dir: str) -> None:
    _, _, keeper, expected = _hsdp_at_report_2(rank, ports[0])
    destroy_distributed()
    results = {}
    if rank >= 2:  # the node of ranks 0 and 1 is lost: 2 and 3 go on as ranks 0 and 1
        results["shrunk"] = _regroup(keeper, rank - 2, 2, ports[1])
    if rank != 1:  # rank 0's process comes back new, holding nothing, as rank 2
        joining = SnapshotKeeper() if rank == 0 else keeper
        results["grown"] = _regroup(joining, {0: 2, 2: 0, 3: 1}[rank], 3, ports[2])
    summary = {
        phase: {
            "equal": all(torch.equal(expected[k], r["whole"][k]) for k in expected),
            "progress": r["progress"],
            "resharded": r["record"]["resharded"],
            "sources": r["record"]["sources"],
            "rows": r["rows"],
        }
        for phase, r in results.items()
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(summary))


def test_fsdp_and_hsdp_copies_restore_a_shrunk_and_a_grown_group(tmp_path):
    spawn_ranks(_shrink_then_grow, (distinct_free_ports(3), str(tmp_path)), nprocs=4)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert results[1] == {}  # its node was lost and never came back
    shrunk = [results[2]["shrunk"], results[3]["shrunk"]]
    grown = [results[2]["grown"], results[3]["grown"], results[0]["grown"]]  # ranks 0, 1, 2
    for phase in shrunk + grown:
        assert phase["equal"] and phase["resharded"]
        assert phase["progress"] == {"epoch": 2}
    assert all(p["sources"] == [0, 1] for p in shrunk)  # shard 0 from old rank 2, 1 from 3
    assert all(p["sources"] == [0, 1] for p in grown)  # the survivors' halves
    assert [p["rows"]["0.weight"] for p in shrunk] == [8, 8]
    assert [p["rows"]["0.weight"] for p in grown] == [6, 6, 4]
    assert [p["rows"]["2.weight"] for p in grown] == [2, 2, 0]  # the third rank's chunk is empty


def _pure_fsdp_with_peer_copies(rank: int, ports: list, out_dir: str) -> None:
    init_local_rank(rank, 3, ports[0])
    objects = _fsdp_objects(3, seed=0)
    train_steps(objects, 2)
    keeper = SnapshotKeeper()
    exchange = peer_exchange([0, 0, 0], rank)  # one node: each rank's copy to the next
    registration = Registration("run", 0, None, keeper, resume=None, world=3, exchange=exchange)
    registration.register(objects, copy_to_peer=True)
    registration.at_report(2, {"train": [0, 16]})
    expected = whole_state(objects)
    destroy_distributed()
    before_replacing = copy.deepcopy(keeper)
    [(report, layout)] = keeper.peer_offers("run")
    results = {"peer": [report, layout.index]}
    fresh = SnapshotKeeper() if rank == 1 else keeper  # rank 1's process is replaced
    results["replaced"] = _regroup(fresh, rank, 3, ports[1])
    if rank != 1:  # or its node is lost: ranks 0 and 2 go on as ranks 0 and 1
        results["shrunk"] = _regroup(before_replacing, {0: 0, 2: 1}[rank], 2, ports[2])
    summary = {
        phase: r
        if phase == "peer"
        else {
            "equal": all(torch.equal(expected[k], r["whole"][k]) for k in expected),
            "resharded": r["record"]["resharded"],
            "sources": r["record"]["sources"],
        }
        for phase, r in results.items()
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(summary))


def test_pure_fsdp_parts_outlive_their_rank_with_copies_on_peers(tmp_path):
    """FSDP over 3 ranks, ``register(copy_to_peer=True)``: each rank also holds the next
    one's part (rank 0 holds part 2, rank 2 part 1).  Rank 1 lost: its part comes from rank
    2's peer copy, to a replacement process in place (same cut) and to a group of the two
    survivors (joined into halves); every tensor equal to the report's."""
    spawn_ranks(_pure_fsdp_with_peer_copies, (distinct_free_ports(3), str(tmp_path)), nprocs=3)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert [r["peer"] for r in results] == [[2, 2], [2, 0], [2, 1]]  # (report, part held)
    for r in results:
        assert r["replaced"] == {"equal": True, "resharded": False, "sources": [0, 2, 2]}
    for r in (results[0], results[2]):
        assert r["shrunk"] == {"equal": True, "resharded": True, "sources": [0, 1, 1]}


def _a_rank_lost_while_copies_are_exchanged(rank: int, ports: list, out_dir: str) -> None:
    init_local_rank(rank, 3, ports[0])
    objects = _fsdp_objects(3, seed=0)
    keeper = SnapshotKeeper()
    exchange = peer_exchange([0, 0, 0], rank)  # rank r's part also on rank r + 1
    registration = Registration("run", 0, None, keeper, resume=None, world=3, exchange=exchange)
    registration.register(objects, copy_to_peer=True)
    train_steps(objects, 1)
    registration.at_report(1, {"train": [0, 8]})
    train_steps(objects, 1)
    registration.at_report(2, {"train": [0, 16]})
    expected = whole_state(objects)
    train_steps(objects, 1)
    if rank == 2:
        os._exit(0)  # lost as report 3 is copied: its part of report 3 reaches no peer
    try:
        registration.at_report(3, {"train": [0, 24]})
    except RuntimeError as e:  # gloo: the lost peer's connection closed
        error = str(e)
    else:
        error = "none"
    destroy_distributed()
    held = {"own": [i for i, _, _ in keeper.offers("run")]}
    held["peer"] = [[i, layout.index] for i, layout in keeper.peer_offers("run")]
    shrunk = _regroup(keeper, rank, 2, ports[1])
    summary = {
        "error": error,
        **held,
        "equal": all(torch.equal(expected[k], shrunk["whole"][k]) for k in expected),
        "record": {k: shrunk["record"][k] for k in ("step", "sources", "resharded")},
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(summary))


def test_a_node_lost_while_peer_copies_are_exchanged_costs_one_report_not_the_checkpoint(
    tmp_path,
):
    """FSDP over 3 ranks with peer copies; rank 2's process ends as report 3 is copied, so
    no peer holds its part of report 3.  The survivors kept report 2's own and peer copies
    (``SnapshotKeeper.take_with_peer``): their group of 2 starts at report 2 from them,
    part 2 from rank 0's peer copy, every tensor equal to report 2's.  With one report's
    copies (before) rank 0 had overwritten report 2 and the group started from the
    checkpoint."""
    spawn_ranks(
        _a_rank_lost_while_copies_are_exchanged, (distinct_free_ports(2), str(tmp_path)), nprocs=3
    )
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["error"] != "none" for r in results)
    assert [r["own"] for r in results] == [[3, 2], [3, 2]]  # report 3's own copies, and 2's
    assert [r["peer"] for r in results] == [[[2, 2]], [[2, 0]]]  # report 2's peer copies
    for r in results:
        assert r["record"] == {"step": 2, "sources": [0, 1, 0], "resharded": True}
        assert r["equal"]
