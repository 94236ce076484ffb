"""raytrain_ext.train's pieces without Ray: checkpoint storage and its commit rule,
retention as Ray Train keeps checkpoints, metrics checks, report agreement, and Ray
Train's config objects translated or refused by name."""

import os
import shutil
import time
from dataclasses import replace

import numpy as np
import pyarrow.fs as pafs
import pytest
import torch

from raytrain_ext.config import load_config
from raytrain_ext.errors import ConfigError
from raytrain_ext.user_loop.checkpoint import Checkpoint
from raytrain_ext.user_loop.function_loop import where
from raytrain_ext.user_loop.held_reports import HeldReport
from raytrain_ext.user_loop.loop_function import takes_config
from raytrain_ext.user_loop.ray_train_config import (
    RunConfig,
    ScalingConfig,
    overrides_for,
    refuse_unsupported,
    worker_counts,
)
from raytrain_ext.user_loop.registered import Registration, SnapshotKeeper
from raytrain_ext.user_loop.report_log import KEPT, LoggedReport, ReportLog, merged
from raytrain_ext.user_loop.session import (
    LoopSession,
    ReportMismatch,
    StopAtBoundary,
    TrainContext,
    checked_metrics,
    stop_here,
)
from raytrain_ext.user_loop.staging import RewrittenDuringUpload, check_unchanged, stage
from raytrain_ext.user_loop.starting_point import choose_start
from raytrain_ext.user_loop.storage import Retention, RunStorage
from raytrain_ext.user_loop.uploader import Uploader, UploadJob


def storage(tmp_path, **retention) -> RunStorage:
    return RunStorage(
        pafs.LocalFileSystem(), str(tmp_path / "store" / "run"), Retention(**retention)
    )


def user_dir(tmp_path, name: str, content: str) -> str:
    d = tmp_path / name
    d.mkdir()
    (d / "state.txt").write_text(content)
    return str(d)


def commit(s, index, ranks, metrics, timeout_s, group="g2", still_wanted=lambda: True):
    return s.commit(index, ranks, metrics, {}, group, still_wanted, timeout_s)


def test_a_checkpoint_is_committed_only_once_every_uploading_rank_landed(tmp_path):
    s = storage(tmp_path)
    s.upload(user_dir(tmp_path, "stale", "an earlier group's"), 1, rank=1, group="g1")
    s.upload(user_dir(tmp_path, "r0", "zero"), 1, rank=0, group="g2")
    # rank 1's marker at this index is an earlier group's: it does not count
    assert not commit(s, 1, [0, 1], {"loss": 1.0}, timeout_s=0.3)
    assert s.latest() is None and s.committed() == []
    s.upload(user_dir(tmp_path, "r1", "one"), 1, rank=1, group="g2")
    assert commit(s, 1, [0, 1], {"loss": 1.0}, timeout_s=5)
    latest = s.latest()
    assert latest.index == 1 and latest.metrics == {"loss": 1.0}
    with latest.checkpoint.as_directory() as d:  # the user's files, nothing of ours
        assert sorted(os.listdir(d)) == ["state.txt"]
    copy = latest.checkpoint.to_directory(str(tmp_path / "copy"))
    assert open(os.path.join(copy, "state.txt")).read() == "one"  # ranks share one directory


def test_a_commit_gives_up_at_once_on_a_failed_upload_or_a_new_group(tmp_path):
    s = storage(tmp_path)
    s.upload(user_dir(tmp_path, "r0", "zero"), 1, rank=0, group="g2")
    begun = time.monotonic()
    assert not commit(s, 1, [0, 1], {}, timeout_s=60, still_wanted=lambda: False)
    with pytest.raises(RewrittenDuringUpload):
        s.upload(user_dir(tmp_path, "r1", "one"), 1, rank=1, group="g2", verify=rewritten)
    assert not commit(s, 1, [0, 1], {}, timeout_s=60)
    assert time.monotonic() - begun < 5 and s.latest() is None


def rewritten():
    raise RewrittenDuringUpload("state.txt changed in place")


def test_the_summary_names_every_ranks_upload_failures_not_only_rank_0s():
    from raytrain_ext.messages import FitResult
    from raytrain_ext.trainer import checkpoint_stats

    def ranked(rank, *failures):
        stats = {"reports_with_checkpoint": 2, "upload_failures": list(failures)}
        return FitResult(rank=rank, steps=2, checkpoint=stats)

    ranks = [ranked(0), ranked(1, "report 2: RewrittenDuringUpload: state.txt"), ranked(2)]
    assert checkpoint_stats(ranks) == {
        "reports_with_checkpoint": 2,
        "upload_failures": ["rank 1: report 2: RewrittenDuringUpload: state.txt"],
    }
    built_in = [FitResult(rank=r, steps=2, checkpoint={"saves": 1}) for r in (0, 1)]
    assert checkpoint_stats(built_in) == {"saves": 1} and checkpoint_stats([]) is None


def test_a_new_group_discards_what_earlier_groups_left_after_its_checkpoint(tmp_path):
    s = storage(tmp_path)
    commit_losses(s, tmp_path, [0.5, 0.4])
    s.upload(user_dir(tmp_path, "left", "rank 2 of a larger group"), 3, rank=2, group="g1")
    s.discard_after(2)
    root = tmp_path / "store" / "run"
    assert not (root / "checkpoint_000003").exists()
    assert sorted(os.listdir(root / ".uploads")) == [
        "checkpoint_000001.rank-0",
        "checkpoint_000002.rank-0",
    ]
    assert [c.index for c in s.committed()] == [1, 2]


def commit_losses(s, tmp_path, losses):
    for index, loss in enumerate(losses, start=1):
        s.upload(user_dir(tmp_path, f"c{index}", str(index)), index, rank=0, group="g2")
        assert commit(s, index, [0], {"loss": loss, "epoch": index}, timeout_s=5)
        s.prune()


def test_retention_keeps_the_best_by_score_and_always_the_newest(tmp_path):
    """Ray Train's CheckpointConfig: num_to_keep best by the score attribute; the newest
    stays on storage (a restart resumes from it) but is listed only if it scores."""
    s = storage(tmp_path, num_to_keep=2, score_attribute="loss", score_order="min")
    commit_losses(s, tmp_path, [0.9, 0.2, 0.1, 0.5, 0.7])
    assert [c.index for c in s.best()] == [2, 3]  # worst first, as Ray Train lists them
    assert [c.index for c in s.committed()] == [2, 3, 5]
    assert sorted(os.listdir(tmp_path / "store" / "run")) == [
        ".committed",
        ".uploads",
        "checkpoint_000002",
        "checkpoint_000003",
        "checkpoint_000005",
    ]
    assert sorted(os.listdir(tmp_path / "store" / "run" / ".uploads")) == [
        "checkpoint_000002.rank-0",
        "checkpoint_000003.rank-0",
        "checkpoint_000005.rank-0",
    ]


def test_retention_without_a_score_keeps_the_newest(tmp_path):
    s = storage(tmp_path, num_to_keep=2)
    commit_losses(s, tmp_path, [0.9, 0.2, 0.1])
    assert [c.index for c in s.best()] == [2, 3] == [c.index for c in s.committed()]


def test_metrics_are_taken_as_plain_values_or_refused_by_key():
    plain = checked_metrics(
        {"loss": torch.tensor(0.5), "n": np.int64(3), "acc": np.float32(0.25), "tag": "a"}
    )
    assert plain == {"loss": 0.5, "n": 3, "acc": 0.25, "tag": "a"}
    assert type(plain["n"]) is int
    with pytest.raises(TypeError, match=r"'weights' is a Tensor, which cannot be recorded"):
        checked_metrics({"loss": 1.0, "weights": torch.zeros(3)})
    with pytest.raises(TypeError, match=r"'eval.model' is a Linear"):
        checked_metrics({"eval": {"model": torch.nn.Linear(1, 1)}})
    with pytest.raises(TypeError, match="a dict of str -> number"):
        checked_metrics([1.0])


def session(tmp_path, exchange, stop=None, uploader=None):
    s = storage(tmp_path)
    context = TrainContext(0, 2, 0, 2, 0, "run", s, {})
    pushed = []
    loop_session = LoopSession(
        context,
        start_index=4,
        start_checkpoint=None,
        exchange=exchange,
        push=lambda logged: pushed.append((logged.index, logged.metrics)),
        stop_asked=lambda: stop,
        uploader=uploader or Uploader(),
        group_id="g2",
        datasets={},
        registration=Registration("run", 4, None, SnapshotKeeper(), resume=None, world=2),
    )
    return loop_session, pushed, s


def test_a_report_copies_the_directory_and_persists_it_in_the_background(tmp_path):
    """Report 5 (the session resumed at 4): the user's directory may go at once; rank 0
    commits once both ranks' files landed (rank 1's upload stands in for its process)."""
    uploader = Uploader()
    uploader.start_group("g2")
    loop_session, pushed, s = session(
        tmp_path,
        lambda payload: [payload, ("report", 5, True, None, {}, False, None, False, False)],
        uploader=uploader,
    )
    directory = user_dir(tmp_path, "mine", "rank zero")
    loop_session.report({"loss": 0.5}, Checkpoint.from_directory(directory))
    os.remove(os.path.join(directory, "state.txt"))  # the user's tempdir goes away
    s.upload(user_dir(tmp_path, "theirs", "rank one"), 5, rank=1, group="g2")
    assert uploader.drain(30)
    assert pushed == [(5, {"loss": 0.5})] and loop_session.index == 5
    assert s.latest().index == 5 and uploader.failures == []
    assert len(loop_session.blocked_s) == 1


def test_ranks_that_report_differently_are_named():
    loop_session = LoopSession.__new__(LoopSession)
    with pytest.raises(ReportMismatch, match=r"ranks \[0, 2\] called report #3; ranks \[1\] "):
        loop_session.check_agreement(
            [
                ("report", 3, False, None, {}, False),
                ("returned", 2, False, None, {}, False),
                ("report", 3, False, None, {}, False),
            ],
            "report",
            3,
        )
    with pytest.raises(ReportMismatch, match=r"ranks \[1\] registered with copy_to_peer=True"):
        loop_session.check_agreement(
            [("report", 3, False, None, {}, False, None, c) for c in (False, True)], "report", 3
        )


def test_a_stop_asked_on_any_rank_stops_every_rank_at_the_next_checkpointed_report(tmp_path):
    no_checkpoint = [
        ("report", 5, False, None, {}, False),
        ("report", 5, False, "pause", {}, False),
    ]
    assert stop_here(no_checkpoint) is None  # a pause waits for a checkpoint: nothing redone
    assert (
        stop_here([("report", 5, True, None, {}, False), ("report", 5, False, "pause", {}, False)])
        == "pause"
    )
    assert stop_here(
        [("report", 5, False, "preempt-now", {}, False), ("report", 5, False, None, {}, False)]
    ) == (
        "preempt"  # the grace ran out: stop at once
    )
    registered = [("report", 5, False, None, {}, True), ("report", 5, False, "pause", {}, True)]
    assert stop_here(registered) == "pause"  # the grown group takes the live copies
    half = [("report", 5, False, None, {}, False), ("report", 5, False, "pause", {}, True)]
    assert stop_here(half) is None
    preempted = [("report", 5, False, None, {}, True), ("report", 5, False, "preempt", {}, True)]
    assert stop_here(preempted) is None  # a preemption needs a persisted checkpoint
    loop_session, pushed, _ = session(
        tmp_path,
        lambda payload: [payload, ("report", 5, True, "pause", {}, False, None, False, False)],
    )
    with pytest.raises(StopAtBoundary) as stop:
        loop_session.report({"loss": 1.0})
    assert (stop.value.index, stop.value.kind) == (5, "pause") and pushed == [(5, {"loss": 1.0})]


def test_the_loop_takes_its_config_as_ray_train_decides():
    assert takes_config(lambda config: None) and not takes_config(lambda: None)
    with pytest.raises(ValueError, match="takes 2 required arguments"):
        takes_config(lambda a, b: None)


def test_a_user_error_names_the_users_own_line():
    def user_loop():
        torch.zeros(2) @ torch.zeros(3)

    try:
        user_loop()
    except RuntimeError as e:
        text = where(e)
    assert "test_user_loop.py" in text and "in user_loop: torch.zeros(2) @ torch.zeros(3)" in text


def test_ray_trains_own_config_objects_translate_to_this_projects_config():
    import ray.train

    overrides = overrides_for(
        ray.train.ScalingConfig(num_workers=(2, 4), resources_per_worker={"CPU": 2}),
        ray.train.RunConfig(failure_config=ray.train.FailureConfig(max_failures=3)),
        "run",
        "/tmp/records",
        None,
    )
    cfg = load_config(None, overrides)
    s = cfg.scaling
    assert (s.num_workers, s.min_workers, s.max_workers) == (4, 2, 4)
    assert dict(s.resources_per_worker) == {"CPU": 2.0} and cfg.elastic.max_failures == 3
    assert cfg.run.name == "run" and cfg.run.output_dir == "/tmp/records"
    assert worker_counts(3) == {"num_workers": 3}
    with pytest.raises(ConfigError, match=r"num_workers=\(3, 2\): an int >= 1, or \(min, max\)"):
        worker_counts((3, 2))


def test_what_has_no_counterpart_is_refused_by_name():
    import ray.train

    with pytest.raises(ConfigError, match=r"ScalingConfig.accelerator_type='A100' is not"):
        refuse_unsupported(ray.train.ScalingConfig(accelerator_type="A100"), "ScalingConfig")
    with pytest.raises(ConfigError, match=r"RunConfig.callbacks=.* use read the run's records"):
        refuse_unsupported(ray.train.RunConfig(callbacks=[ray.train.UserCallback()]), "RunConfig")
    refuse_unsupported(ScalingConfig(num_workers=2), "ScalingConfig")  # ours: all supported
    refuse_unsupported(RunConfig(name="x"), "RunConfig")


def test_a_staged_report_survives_its_directory_and_refuses_a_file_rewritten_in_place(tmp_path):
    """Staging links the files (the user's tempdir may go at once); a file rewritten in
    place before the upload ended fails that upload, which is then never committed."""
    s = storage(tmp_path)
    directory = user_dir(tmp_path, "kept", "first")
    staged = stage(directory, "run")
    assert staged.stamps  # linked, not copied: same filesystem
    shutil.rmtree(directory)
    s.upload(staged.directory, 1, 0, "g2", verify=lambda: check_unchanged(staged))
    assert commit(s, 1, [0], {}, timeout_s=5)
    with s.latest().checkpoint.as_directory() as d:
        assert open(os.path.join(d, "state.txt")).read() == "first"
    directory = user_dir(tmp_path, "reused", "second")
    staged = stage(directory, "run")
    with open(os.path.join(directory, "state.txt"), "w") as f:  # torch.save to the same path
        f.write("third, rewritten")
    with pytest.raises(RewrittenDuringUpload, match=r"state.txt changed in place after report"):
        s.upload(staged.directory, 2, 0, "g2", verify=lambda: check_unchanged(staged))
    assert not commit(s, 2, [0], {}, timeout_s=30) and s.latest().index == 1  # at once


def test_ranks_at_different_places_in_a_dataset_are_named_and_positions_are_committed(
    tmp_path,
):
    loop_session = LoopSession.__new__(LoopSession)
    with pytest.raises(ReportMismatch, match=r"different places in their dataset shards.*rank 1"):
        loop_session.check_agreement(
            [
                ("report", 3, False, None, {"train": [0, 8]}, False),
                ("report", 3, False, None, {}, False),
            ],
            "report",
            3,
        )
    s = storage(tmp_path)
    s.upload(user_dir(tmp_path, "r0", "zero"), 2, rank=0, group="g2")
    assert s.commit(2, [0], {}, {"train": [1, 40]}, "g2", lambda: True, 5)
    assert s.latest().positions == {"train": [1, 40]}


class BrokenReadsOnce(pafs.FSSpecHandler):
    """A local filesystem whose reads each break once, as an S3 response stream can after
    its request succeeded (seen with moto: "failed to flush response stream")."""

    def __init__(self):
        import fsspec

        super().__init__(fsspec.filesystem("file"))
        self.broken = set()

    def open_input_stream(self, path):
        if path not in self.broken:
            self.broken.add(path)
            raise OSError(f"AWS Error INTERNAL_FAILURE during GetObject of {path}")
        return super().open_input_stream(path)


def test_a_read_that_breaks_once_is_tried_again_and_a_missing_file_is_not(tmp_path):
    handler = BrokenReadsOnce()
    s = RunStorage(pafs.PyFileSystem(handler), str(tmp_path / "run"), Retention())
    s.upload(user_dir(tmp_path, "r0", "zero"), 1, rank=0, group="g1")
    assert commit(s, 1, [0], {"loss": 1.0}, timeout_s=5, group="g1")
    assert s.latest().metrics == {"loss": 1.0}
    assert handler.broken  # the marker and the commit record each broke once
    assert s._read(str(tmp_path / "run" / "absent")) is None


def test_the_report_log_keeps_the_newest_reports_and_merges_the_latest_of_each_index():
    """A process keeps the newest KEPT reports of a run; merging every rank's logs takes
    for each index the report made last (a group that rewound made it again) and none past
    where the next group starts."""
    log = ReportLog()
    for index in range(1, KEPT + 6):
        log.add("run", LoggedReport(index, time=float(index), interval_s=1.0))
    log.add("other", LoggedReport(1, time=0.0, interval_s=1.0))
    assert [r.index for r in log.reports("run")] == list(range(6, KEPT + 6))
    first_run = [LoggedReport(i, float(i), 1.0, {"loss": 1.0}) for i in (3, 4, 5)]
    rewound = [LoggedReport(i, 10.0 + i, 1.0, {"loss": 2.0}) for i in (4, 5)]
    joined_later: list = []
    found = merged([first_run, first_run[:2] + rewound, joined_later], through=4)
    assert [(r.index, r.metrics["loss"]) for r in found] == [(3, 1.0), (4, 2.0)]


def test_a_start_from_a_held_report_falls_back_to_storages_newest(tmp_path):
    """A run with checkpoints 1 and 2 committed in storage starts from 2; a start from a
    held report 3 that a rank cannot read becomes that start, positions included."""
    storage = RunStorage(pafs.LocalFileSystem(), str(tmp_path / "run"), Retention())
    for index in (1, 2):
        storage.commit(index, [], {"loss": 1.0}, {"train": [0, 4 * index]}, "g", lambda: True, 1)
    start = choose_start(storage, None, offers=[], world_size=2, resume_from=None)
    assert (start.index, start.positions, start.held) == (2, {"train": (0, 8)}, None)
    assert start.checkpoint == Checkpoint(str(tmp_path / "run" / "checkpoint_000002"))
    from_memory = replace(
        start, index=3, checkpoint=Checkpoint("/held"), positions={"train": (0, 12)},
        held=HeldReport(3, "g", (0,)),
    )  # fmt: skip
    assert from_memory.from_storage() == start


def test_a_new_group_waits_only_for_a_last_groups_upload_past_its_start(tmp_path):
    """Storage takes 1 s for report 3 (tests/helpers/slow_storage.py); its upload is in
    flight, report 4's queued, when a new group forms.  Abandoning the last group skips
    report 4 (it could never commit) without waiting for report 3, whose upload cannot
    collide with a group starting after report 3; one starting after report 2 waits for it
    (here: gives up after 0.1 s, then waits until it landed)."""
    from tests.helpers.slow_storage import slow_storage

    s = RunStorage(slow_storage(3, delay_s=1.0), str(tmp_path / "run"), Retention())
    uploader = Uploader()
    uploader.start_group("g1")
    for index in (3, 4):
        staged = stage(user_dir(tmp_path, f"r{index}", str(index)), "settle")
        uploader.submit(UploadJob(s, index, 0, "g1", staged))
    deadline = time.monotonic() + 30
    while not (tmp_path / "run" / "checkpoint_000003").exists():  # report 3 in flight
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert uploader.abandon(timeout_s=0.0)  # no commit in flight
    assert uploader.settle(3, timeout_s=0.0)
    assert not uploader.settle(2, timeout_s=0.1)
    assert uploader.settle(2, timeout_s=30)
    assert uploader.drain(30)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".uploads", "checkpoint_000003"]
