"""``register``'s pieces without Ray or a process group: the copy a rank keeps at each
report, its restore into freshly built objects, where a re-formed group starts, and the
refusals (user_loop/registered.py)."""

import pytest
import torch
from torch import nn

from raytrain_ext.user_loop.registered import (
    LiveResume,
    Registration,
    SnapshotKeeper,
    live_start,
    peer_ranks,
)
from raytrain_ext.user_loop.registered_state import Layout, install, layout_of, state_of
from raytrain_ext.user_loop.reshard import PartJoiner


def built(seed: int = 0):
    """A model, an Adam optimizer, a schedule and a progress dict, as a loop builds them."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return {"model": model, "optimizer": optimizer, "lr_scheduler": schedule, "progress": {}}


def take(keeper: SnapshotKeeper, index: int, positions, objects, world: int) -> None:
    """A report's copy, as ``Registration.at_report`` takes it (its layout computed once)."""
    keeper.take("run", index, positions, objects, layout_of(state_of(objects), world))


def train(objects, steps: int, start: int = 0) -> None:
    model, optimizer = objects["model"], objects["optimizer"]
    for step in range(start, start + steps):
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(step))
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        objects["lr_scheduler"].step()
        objects["progress"]["step"] = step + 1


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def test_a_copy_taken_at_a_report_restores_fresh_objects_to_that_report():
    """Train 3 steps, keep a copy, train 2 more (the copy must not move with the live
    objects), then load the copy into newly built objects and train those 2 steps again:
    the same parameters, optimizer moments and learning rate as the live run's."""
    live = built()
    train(live, 3)
    keeper = SnapshotKeeper()
    take(keeper, 3, {"train": (0, 24)}, live, world=2)
    kept = [t.clone() for t in keeper.latest.state["model"].values()]
    train(live, 2, start=3)
    assert all(
        torch.equal(a, b) for a, b in zip(kept, keeper.latest.state["model"].values(), strict=True)
    )
    fresh = built(seed=1)
    install(fresh, keeper.latest.state)
    assert fresh["progress"] == {"step": 3}
    train(fresh, 2, start=3)
    assert all(
        torch.equal(a, b)
        for a, b in zip(params(live["model"]), params(fresh["model"]), strict=True)
    )
    assert fresh["lr_scheduler"].get_last_lr() == live["lr_scheduler"].get_last_lr()
    moments = [s["exp_avg_sq"] for s in fresh["optimizer"].state.values()]
    assert all(
        torch.equal(a, s["exp_avg_sq"])
        for a, s in zip(moments, live["optimizer"].state.values(), strict=True)
    )
    assert keeper.offers("run") == ((3, {"train": (0, 24)}, Layout(2)),)
    assert keeper.offers("other") == ()


def test_the_copy_reuses_its_buffers_and_never_aliases_the_restored_objects():
    live = built()
    train(live, 1)
    keeper = SnapshotKeeper()
    take(keeper, 1, {}, live, world=2)
    buffers = [t.data_ptr() for t in keeper.latest.state["model"].values()]
    train(live, 1, start=1)
    take(keeper, 2, {}, live, world=2)
    assert [t.data_ptr() for t in keeper.latest.state["model"].values()] == buffers
    fresh = built()
    install(fresh, keeper.latest.state)
    kept = keeper.latest.state["optimizer"]["state"][0]["exp_avg"].clone()
    train(fresh, 1, start=2)  # the restored optimizer's moments move; the copy's must not
    assert torch.equal(keeper.latest.state["optimizer"]["state"][0]["exp_avg"], kept)


def test_a_ddp_module_is_kept_by_its_own_keys():
    """``prepare_model`` wraps in DDP only at world size > 1: the copy must load across."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        objects = built()
        objects["model"] = nn.parallel.DistributedDataParallel(objects["model"])
        keeper = SnapshotKeeper()
        take(keeper, 1, {}, objects, world=1)
        assert not any(k.startswith("module.") for k in keeper.latest.state["model"])
        plain = built(seed=3)
        install(plain, keeper.latest.state)
        assert all(
            torch.equal(a, b)
            for a, b in zip(params(objects["model"].module), params(plain["model"]), strict=True)
        )
        assert keeper.latest.layout == Layout(1) and keeper.latest.layout.loads_into(3)
        sharded = _fsdp_on_one_rank()
        registration = Registration("run", 0, None, SnapshotKeeper(), resume=None, world=1)
        registration.register(sharded)
        registration.at_report(1, {})
        layout = registration.keeper.latest.layout
        assert layout == Layout(1, 1, 0, sharded=True, join_dim=0) and not layout.loads_into(2)
        assert registration.resizable  # FSDP's parts join: a pause to grow needs no checkpoint
    finally:
        dist.destroy_process_group()


def _fsdp_on_one_rank() -> dict:
    """FSDP2 on a mesh of one rank: sharded (``Shard(0)``), though into one part."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), foreach=False)}


class _BreaksOnSecondCall:
    """A registered object whose state cannot be read the second time."""

    calls = 0

    def state_dict(self):
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError("state lost")
        return {"w": torch.ones(3)}

    def load_state_dict(self, state):
        pass


def test_a_copy_that_fails_part_way_is_not_offered():
    keeper, objects = SnapshotKeeper(), {"thing": _BreaksOnSecondCall()}
    keeper.take("run", 1, {}, objects, Layout(1))
    with pytest.raises(RuntimeError, match="state lost"):
        keeper.take("run", 2, {}, objects, Layout(1))
    assert keeper.offers("run") == ()


def test_a_group_starts_from_the_newest_live_copy_unless_a_checkpoint_is_newer():
    at, whole = {"train": (1, 8)}, Layout(world=4)
    offers = [(), ((7, at, whole),), ((7, at, whole),), ((5, {}, whole),)]
    assert live_start(offers, committed=6, world=3) == LiveResume(7, sources=(1,), positions=at)
    assert live_start(offers, committed=7, world=5) == LiveResume(7, sources=(1,), positions=at)
    assert live_start(offers, committed=8, world=4) is None  # a restarted run's newer checkpoint
    assert live_start([(), ()], committed=0, world=2) is None  # nobody registered
    assert live_start([((0, {}, whole),), ()], committed=0, world=2) is None
    resized = [((7, at, Layout(world=4)),), ((7, at, Layout(world=3)),)]  # a restore cut short
    assert live_start(resized, committed=0, world=3) == LiveResume(7, (0,), at)


def test_sharded_copies_restore_a_group_only_with_every_shard_held():
    """HSDP on 4 ranks (2 replicas x 2 shards): rank 1 lost, its shard comes from rank 3,
    into a group of any size when the shards join (``join_dim``), else only of its own;
    FSDP on 4 ranks (4 shards): rank 1's shard died with it, so the checkpoint has it."""
    for join_dim in (None, 0):
        hsdp = [Layout(4, 2, i % 2, sharded=True, join_dim=join_dim) for i in range(4)]
        offers = [((9, {}, layout),) for layout in hsdp]
        offers[1] = ()
        assert live_start(offers, committed=5, world=4).sources == (0, 3)
        other_size = live_start(offers, committed=5, world=3)
        if join_dim is None:
            assert other_size is None  # its shards would not load into another cut
        else:
            assert other_size == LiveResume(9, (0, 3), {}, cut=hsdp[0])
        fsdp = [((9, {}, Layout(4, 4, i, sharded=True, join_dim=join_dim)),) for i in range(4)]
        fsdp[1] = ()
        assert live_start(fsdp, committed=5, world=4) is None
        assert live_start(fsdp, committed=5, world=3) is None


def test_register_refuses_what_it_cannot_keep_and_a_group_that_forgot_it():
    fresh = Registration("run", 0, None, SnapshotKeeper(), resume=None, world=1)
    with pytest.raises(TypeError, match=r"register\(data=\.\.\.\): a int has no state_dict"):
        fresh.register({"model": nn.Linear(1, 1), "data": 3})
    with pytest.raises(ValueError, match="needs the objects to keep"):
        fresh.register({})
    assert fresh.register({"model": nn.Linear(1, 1)}) == 0
    with pytest.raises(RuntimeError, match="called twice"):
        fresh.register({"model": nn.Linear(1, 1)})
    resumed = Registration(
        "run", 7, LiveResume(7, (1,), {}), SnapshotKeeper(), lambda start, objects: {}, world=2
    )
    with pytest.raises(RuntimeError, match=r"report\(\) before register\(\): .* report 7"):
        resumed.check_registered("report()")
    with pytest.raises(ValueError, match=r"registered \['model'\], the state it resumes holds"):
        install({"model": nn.Linear(1, 1)}, {"model": {}, "optimizer": {}})


def test_parts_join_into_a_whole_tensor_row_by_row_whatever_their_count():
    """The parts of an FSDP copy (``torch.chunk``'s pieces, an empty one past the end)
    restore a group that holds whole tensors (one rank without FSDP): every row from the
    part that has it, in any part count; leaves that were not sharded from part 0."""
    torch.manual_seed(0)
    source = nn.Linear(3, 4)
    whole = {"model": {k: v.detach().clone() for k, v in source.state_dict().items()}}
    for count in (2, 3, 5):
        cut = Layout(count, count, 0, sharded=True, join_dim=0)
        joiner = PartJoiner(cut, {"model": nn.Linear(3, 4)})
        sharded = {"model": {"weight": True, "bias": True}}
        pieces = {k: list(torch.chunk(v, count)) for k, v in whole["model"].items()}
        for part in range(count):
            rows = {k: c[part] if part < len(c) else c[0][:0] for k, c in pieces.items()}
            joiner.add(part, {"model": rows}, sharded)
        assert all(torch.equal(joiner.local()["model"][k], v) for k, v in whole["model"].items())
    with pytest.raises(ValueError, match="not cut in parts that join"):
        PartJoiner(Layout(2, 2, 0, sharded=True), {})
    joiner = PartJoiner(Layout(2, 2, 0, sharded=True, join_dim=0), {"model": nn.Linear(3, 4)})
    with pytest.raises(ValueError, match="part 1 of the copies came after 0"):
        joiner.add(1, whole, {"model": {"weight": True, "bias": True}})
    joiner.add(0, whole, {"model": {"weight": True, "bias": True}})
    with pytest.raises(ValueError, match="1 of the copies' 2 parts came in"):
        joiner.local()
    with pytest.raises(ValueError, match="holds other tensors than part 0"):
        joiner.add(1, whole, {"model": {"weight": True, "bias": False}})


def test_peer_copies_go_to_another_node_and_fill_a_part_no_rank_holds_as_its_own():
    assert [peer_ranks([0, 0, 1, 1], r) for r in range(4)] == [(2, 2), (3, 3), (0, 0), (1, 1)]
    assert [peer_ranks([0, 0, 0], r) for r in range(3)] == [(1, 2), (2, 0), (0, 1)]
    assert [peer_ranks([0, 0, 1], r)[0] for r in range(3)] == [2, 0, 1]  # a permutation
    assert peer_ranks([0], 0) == (0, 0)
    part = [Layout(4, 4, i, sharded=True, join_dim=0) for i in range(4)]
    fsdp = [((9, {}, part[i]),) for i in range(4)]
    fsdp[1] = ()  # rank 1 lost; rank 2 holds its part (rank 1 sent it there)
    peers = [((9, part[3]),), (), ((9, part[1]),), ((9, part[2]),)]
    assert live_start(fsdp, committed=5, world=4, peers=peers).sources == (0, 2, 2, 3)
    assert live_start(fsdp, committed=5, world=3, peers=peers).cut == part[0]
    older = [((8, part[3]),), (), ((8, part[1]),), ((8, part[2]),)]  # an earlier report's
    assert live_start(fsdp, committed=5, world=4, peers=older) is None
    other_cut = [((9, Layout(3, 3, 1, sharded=True, join_dim=0)),)] * 4  # another group's part
    assert live_start(fsdp, committed=5, world=4, peers=other_cut) is None


def test_a_report_whose_exchange_a_lost_rank_cut_short_falls_back_to_the_one_before():
    """FSDP over 3 ranks with peer copies (rank r's part also on rank r+1).  Rank 2 dies
    while report 9's copies are exchanged: rank 1 had received part 0 of report 9, rank 0
    had not received part 2.  Report 9 lacks part 2; report 8 is whole on the survivors
    (their own copies of 8, rank 0's peer copy of part 2 at 8), so the group starts there,
    not from the checkpoint; with rank 0's copy of part 2 at 9 it starts at 9."""
    part = [Layout(3, 3, i, sharded=True, join_dim=0) for i in range(3)]
    own = [((9, {"t": (0, 9)}, part[r]), (8, {"t": (0, 8)}, part[r])) for r in range(2)] + [()]
    cut_short = [((8, part[2]),), ((9, part[0]), (8, part[0])), ()]
    start = live_start(own, committed=5, world=2, peers=cut_short)
    assert start == LiveResume(8, (0, 1, 0), {"t": (0, 8)}, cut=part[0])
    done = [((9, part[2]), (8, part[2])), ((9, part[0]), (8, part[0])), ()]
    assert live_start(own, committed=5, world=2, peers=done).index == 9
    assert live_start(own, committed=9, world=2, peers=cut_short) is None  # 8 < checkpoint 9


class _ExchangeCutShort:
    """An exchange whose peer is lost part way (the first call returns its own tree as the
    peer's; the second raises, as gloo does when the peer's connection closes)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, tree, buffers):
        self.calls += 1
        if self.calls > 1:
            buffers[torch.float32] = torch.zeros(1)  # a buffer written part way
            raise RuntimeError("Connection closed by peer")
        return {**tree, "layout": Layout(2, 2, 1, sharded=True)}, 0


def test_a_failed_exchange_leaves_the_previous_reports_copies_offered():
    keeper, objects = SnapshotKeeper(), built()
    mine = Layout(2, 2, 0, sharded=True)
    exchange = _ExchangeCutShort()
    keeper.take_with_peer("run", 4, {"t": (0, 4)}, objects, mine, exchange)
    report_4 = {k: v.clone() for k, v in keeper.latest.state["model"].items()}
    train(objects, 1)
    with pytest.raises(RuntimeError, match="closed by peer"):
        keeper.take_with_peer("run", 5, {"t": (0, 5)}, objects, mine, exchange)
    assert [index for index, _, _ in keeper.offers("run")] == [5, 4]
    assert keeper.peer_offers("run") == ((4, Layout(2, 2, 1, sharded=True)),)
    kept = keeper.earlier.state["model"]
    assert all(torch.equal(report_4[k], kept[k]) for k in report_4)  # untouched by report 5
    assert not torch.equal(report_4["0.weight"], keeper.latest.state["model"]["0.weight"])
