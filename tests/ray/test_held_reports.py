"""``user_loop.held_reports`` on a real single-node Ray and memory tier: a report is held
once its record and every uploading rank's files are there, its files come back as
reported, an earlier group's files at the same index never mix in, and retention and a
new group's discard release what they should."""

import os

import pytest

from raytrain_ext.checkpoint.tiers.memory import start_memory_tier, stop_memory_tier
from raytrain_ext.user_loop.held_reports import HeldReport, HeldReports
from raytrain_ext.user_loop.staging import stage


def reported(tmp_path, name, files):
    """A directory with ``files`` (relative path -> bytes), staged as ``report`` stages it."""
    directory = tmp_path / name
    for relative, data in files.items():
        (directory / relative).parent.mkdir(parents=True, exist_ok=True)
        (directory / relative).write_bytes(data)
    return stage(str(directory), "held-test")


def read_tree(directory):
    found = {}
    for here, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(here, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, directory)] = f.read()
    return found


@pytest.fixture()
def held(ray_local):
    actors = start_memory_tier("held-test")
    try:
        yield HeldReports("held-test", keep=2)
    finally:
        stop_memory_tier(actors)


def test_a_report_is_held_once_every_uploading_rank_is_and_comes_back_as_reported(held, tmp_path):
    rank_0 = {"model.pt": b"weights" * 1000, "opt/state.pt": b"moments"}
    rank_1 = {"rank1/extra.bin": bytes(range(256))}
    earlier_group = reported(tmp_path, "earlier", {"model.pt": b"an earlier group's"})
    held.hold(1, "g-old", 0, earlier_group)  # a group that rewound past report 1
    held.record(HeldReport(1, "g1", (0, 1), {"loss": 0.5}, {"train": [0, 32]}))
    held.hold(1, "g1", 0, reported(tmp_path, "r0", rank_0))
    assert held.newest() is None  # rank 1's files are not held yet
    held.hold(1, "g1", 1, reported(tmp_path, "r1", rank_1))
    newest = held.newest()
    assert newest == HeldReport(1, "g1", (0, 1), {"loss": 0.5}, {"train": [0, 32]})
    checkpoint = held.materialize(newest, str(tmp_path / "restored"))
    assert read_tree(checkpoint.path) == {**rank_0, **rank_1}  # no earlier group's, no marker


def test_retention_keeps_the_newest_held_and_a_new_group_discards_what_follows_its_start(
    held, tmp_path
):
    for index in (1, 2, 3):
        held.record(HeldReport(index, "g1", (0,)))
        held.hold(index, "g1", 0, reported(tmp_path, f"r{index}", {"f": bytes([index])}))
    held.record(HeldReport(4, "g1", (0,)))  # report 4's files still on their way
    assert held.retain() == [1]  # keep=2: reports 2 and 3, and 4 arriving
    assert held.tier.all_steps() == [2, 3, 4]
    assert held.newest().index == 3
    held.discard_after(2)
    assert held.tier.all_steps() == [2]
    restored = held.materialize(held.newest(), str(tmp_path / "restored"))
    assert read_tree(restored.path) == {"f": bytes([2])}
