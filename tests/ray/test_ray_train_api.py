"""raytrain_ext.train against Ray Train itself: the same loops (tests/helpers/ray_train_loops.py,
which import the API named in their config) run under both, on a real single-node Ray."""

import os
import signal

import pytest

from raytrain_ext import TrainingFailed
from raytrain_ext.data.row_input import reader_name
from raytrain_ext.user_loop.registered_files import REGISTERED_DIR
from tests.helpers.leaks import assert_nothing_left
from tests.helpers.ray_train_loops import (
    OURS,
    RAY_TRAIN,
    dataset_loop,
    environment_loop,
    line_rows,
    quickstart_loop,
    registered_loop,
    standing_ids,
)
from tests.helpers.registered_mlp import dcp_files
from tests.helpers.runs import FitThread, wait_until


def fit(api_name, tmp_path, name, loop=quickstart_loop, **kwargs):
    """``TorchTrainer(loop).fit()`` through the API ``api_name``; its Result."""
    return trainer(api_name, tmp_path, name, loop, **kwargs).fit()


def trainer(api_name, tmp_path, name, loop=quickstart_loop, *, config, workers=2, **run):
    import importlib

    train = importlib.import_module(api_name)
    torch_api = importlib.import_module(api_name + ".torch")
    resume = run.pop("resume_from_checkpoint", None)
    datasets = run.pop("datasets", None)
    return torch_api.TorchTrainer(
        loop,
        train_loop_config={"api": api_name, **config},
        scaling_config=train.ScalingConfig(num_workers=workers),
        run_config=train.RunConfig(
            name=name,
            storage_path=str(tmp_path / api_name),
            failure_config=train.FailureConfig(max_failures=run.pop("max_failures", 0)),
            checkpoint_config=train.CheckpointConfig(**run),
        ),
        resume_from_checkpoint=resume,
        datasets=datasets,
    )


def kill_rank_1_after(run, reports: int) -> dict:
    """SIGKILL rank 1's process from outside once the run made ``reports`` reports; the
    ranks' pids before the kill."""
    wait_until(
        lambda: run.controller is not None and len(run.controller.result.records) >= reports,
        f"{reports} reports",
    )
    workers = {w["rank"]: w["pid"] for w in run.controller.result.workers}
    os.kill(workers[1], signal.SIGKILL)
    return workers


def epochs_of(result):
    return [metrics["epoch"] for _, metrics in result.best_checkpoints]


@pytest.mark.slow
def test_quickstart_and_resume_give_ray_trains_results(ray_local, tmp_path):
    """The quick start with checkpoints every epoch, kept 2 by lowest loss, each epoch also
    reading its get_dataset_shard of a Ray Dataset, then the same run again for more
    epochs, which resumes from its newest checkpoint: the same metrics, to the bit, the same
    rows per rank, and the same checkpoints kept, as under Ray Train.  Ours also takes
    ``resume_from_checkpoint`` (Ray Train 2.60 refuses it as deprecated)."""
    import ray

    results = {}
    for api_name in (RAY_TRAIN, OURS):
        kept = dict(num_to_keep=2, checkpoint_score_attribute="loss", checkpoint_score_order="min")
        first = fit(
            api_name,
            tmp_path,
            "run",
            config={"epochs": 3, "checkpoint_every": 1, "rows": True},
            datasets={"train": ray.data.range(64)},  # 32 rows for each of 2 ranks
            **kept,
        )
        again = fit(api_name, tmp_path, "run", config={"epochs": 5, "checkpoint_every": 1}, **kept)
        results[api_name] = (first, again)
    (ray_first, ray_again), (our_first, our_again) = results[RAY_TRAIN], results[OURS]
    ours_by_epoch = {m["epoch"]: m["loss"] for m in our_first.metrics_history}
    for ray_metrics in ray_first.metrics_dataframe.to_dict("records"):  # the kept ones
        assert ours_by_epoch[ray_metrics["epoch"]] == ray_metrics["loss"]
        assert ray_metrics["rows"] == 32
    assert [m["rows"] for m in our_first.metrics_history] == [32, 32, 32]
    assert our_first.metrics["loss"] == ray_first.metrics["loss"]
    assert epochs_of(our_first) == epochs_of(ray_first) == [1, 2]  # worst first
    with our_first.checkpoint.as_directory() as directory:
        assert os.listdir(directory) == ["state.pt"]  # the user's files only
    assert [m["epoch"] for m in our_again.metrics_history] == [3, 4]
    assert our_again.metrics["loss"] == ray_again.metrics["loss"]
    assert epochs_of(our_again) == epochs_of(ray_again)  # the best two of five
    assert our_again.checkpoint.path.endswith("checkpoint_000005")  # the newest, kept
    resumed = fit(
        OURS,
        tmp_path,
        "from-first",
        config={"epochs": 5, "checkpoint_every": 1},
        resume_from_checkpoint=our_first.checkpoint,
    )
    assert [m["epoch"] for m in resumed.metrics_history] == [3, 4]
    assert resumed.metrics["loss"] == our_again.metrics["loss"]
    assert_nothing_left()


def failing_loop(config):
    """Rank 1 raises at its second report."""
    import raytrain_ext.train as train

    for epoch in range(3):
        if epoch == 1 and train.get_context().get_world_rank() == 1:
            raise ValueError("bad batch on rank 1")
        train.report({"epoch": epoch})


def uneven_loop(config):
    """Rank 1 returns after one report; rank 0 reports twice."""
    import raytrain_ext.train as train

    reports = 2 if train.get_context().get_world_rank() == 0 else 1
    for epoch in range(reports):
        train.report({"epoch": epoch})


@pytest.mark.slow
@pytest.mark.parametrize(
    "loop, expected",
    [
        (
            failing_loop,
            r"worker rank 1 \(node 127\.0\.0\.1, pid \d+\) raised UserLoopError: "
            r"train_loop_per_worker raised ValueError: bad batch on rank 1, at "
            r".*test_ray_train_api\.py:\d+ in failing_loop: raise ValueError",
        ),
        (uneven_loop, r"ranks \[0\] called report #2; ranks \[1\] returned after 1"),
    ],
    ids=["raises", "uneven-reports"],
)
def test_a_broken_loop_fails_naming_the_rank_and_the_cause(ray_local, tmp_path, loop, expected):
    with pytest.raises(TrainingFailed, match=expected):
        fit(OURS, tmp_path, loop.__name__, loop, config={})
    assert_nothing_left()


def test_the_ranks_allocate_from_one_malloc_arena_as_a_main_thread_does(ray_local, tmp_path):
    """The loop runs on an actor's thread; its process starts with ``MALLOC_ARENA_MAX=1``
    (``worker.allocator``), so glibc keeps its memory as it would on the main thread."""
    result = fit(OURS, tmp_path, "environment", environment_loop, config={})
    assert result.metrics["malloc_arena_max"] == 1
    assert_nothing_left()


@pytest.mark.slow
@pytest.mark.chaos
def test_a_sigkill_and_a_restarted_run_resume_the_dataset_shard_where_the_checkpoint_left_it(
    ray_local, tmp_path
):
    """A loop fed by get_dataset_shard alone (44 rows, 2 ranks, batches of 4: 6 reports an
    epoch; a checkpoint every 4 reports, so most fall mid-epoch).  SIGKILL rank 1's process
    from outside mid-run: rank 0 keeps its process, the loop and its shard resume from the
    newest committed checkpoint, reports redone are at most the cadence minus 1 and train
    on the same rows, every row stands exactly once per epoch, and the final loss is the
    uninterrupted run's to the bit; a SIGKILL of the dataset's reader later (Ray restarts
    it, and it reads the epoch again to the position) changes nothing either.  A run that
    stopped mid-epoch and is fit again resumes there the same way."""
    import ray

    config = {"epochs": 3, "batch_size": 4, "every": 4}

    def run_of(name, max_failures=0, **extra):
        datasets = {"train": ray.data.from_items(line_rows(44))}
        loop_config = {**config, **extra}
        return trainer(
            OURS,
            tmp_path,
            name,
            dataset_loop,
            config=loop_config,
            datasets=datasets,
            max_failures=max_failures,
        )

    reference = run_of("reference").fit()
    every_row = {epoch: list(range(44)) for epoch in range(3)}
    assert {e: sorted(ids) for e, ids in standing_ids(reference.metrics_history).items()} == (
        every_row
    )
    run = run_of("killed", max_failures=1, step_sleep_s=0.2)  # the reader dies mid-run
    with FitThread(run) as thread:
        workers = kill_rank_1_after(run, reports=7)
        wait_until(lambda: len(run.controller.result.records) >= 12, "twelve reports")
        reader = ray.get_actor(reader_name("killed", "train"))
        os.kill(ray.get(reader.stats.remote())["pid"], signal.SIGKILL)  # Ray restarts it
        assert len(run.controller.result.records) < 19, "the reader died after the last report"
        result = thread.join(timeout_s=180)
    assert not isinstance(result, Exception), result
    (recovery,) = result.summary["recoveries"]
    assert recovery["decision"] == "replace" and recovery["restored_from"] == "storage"
    assert {w["rank"]: w["pid"] for w in result.summary["workers"]}[0] == workers[0]
    counts = [m["count"] for m in result.metrics_history]
    assert len(counts) - len(set(counts)) == recovery["steps_redone"] <= config["every"] - 1
    assert standing_ids(result.metrics_history) == standing_ids(reference.metrics_history)
    assert result.metrics["loss"] == reference.metrics["loss"]
    stopped = run_of("restarted", stop_after=9).fit()  # its newest checkpoint: report 8
    again = run_of("restarted").fit()
    assert [m["count"] for m in again.metrics_history][:2] == [9, 10]  # mid-epoch 1
    both = stopped.metrics_history + again.metrics_history
    assert standing_ids(both) == standing_ids(reference.metrics_history)
    assert again.metrics["loss"] == reference.metrics["loss"]
    assert_nothing_left()


@pytest.mark.slow
@pytest.mark.chaos
@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp-copy-to-peer"])
def test_a_registered_loop_heals_from_its_live_peer_with_nothing_redone(ray_local, tmp_path, fsdp):
    """A loop that registers its model, optimizer and progress and never checkpoints:
    SIGKILL rank 1's process from outside mid-run.  The new group takes the state rank 0
    copied at its last report (``restored_from`` peers), goes on after that report (no
    epoch reported twice, none skipped), rank 0 keeps its process, and the final loss is
    the uninterrupted run's to the bit.  Under FSDP, rank 1's half of the state died with
    it: rank 0 holds a copy of it (``register(copy_to_peer=True)``)."""
    config = {"epochs": 8, "fsdp": fsdp}
    reference = fit(OURS, tmp_path, "reference", registered_loop, config=config)
    run = trainer(
        OURS, tmp_path, "killed", registered_loop, config={**config, "step_sleep_s": 0.03},
        max_failures=1,
    )  # fmt: skip
    with FitThread(run) as thread:
        workers = kill_rank_1_after(run, reports=3)
        result = thread.join(timeout_s=180)
    assert not isinstance(result, Exception), result
    (recovery,) = result.summary["recoveries"]
    assert recovery["decision"] == "replace" and recovery["restored_from"] == "peers"
    assert recovery["steps_redone"] == 0
    replayed = [r["step"] for r in run.controller.result.records if r.get("replayed")]
    assert all(step <= recovery["restored_step"] for step in replayed)  # here: [1, 2, 3]
    assert [m["epoch"] for m in result.metrics_history] == list(range(config["epochs"]))
    assert {w["rank"]: w["pid"] for w in result.summary["workers"]}[0] == workers[0]
    assert result.metrics["loss"] == reference.metrics["loss"]
    assert [m["loss"] for m in result.metrics_history] == [
        m["loss"] for m in reference.metrics_history
    ]
    assert_nothing_left()


@pytest.mark.slow
def test_a_restarted_run_loads_its_registered_fsdp_state_from_the_checkpoint_at_another_size(
    ray_local, tmp_path
):
    """A registered FSDP loop whose only checkpoint is rank 0's empty directory: each report
    with it also holds every rank's shards of the registered state as DCP files.  The run
    stops after epoch 4 on 2 ranks and is started again on 3: ``register`` loads the state
    of report 4 from storage, resharded 2 -> 3 by DCP (the whole parameters, momentum and
    progress equal to the bit), and the loop goes on at epoch 4 with no code of its own to
    save or load them."""
    config = {"epochs": 6, "fsdp": True, "checkpoint_every": 2, "digest": True}
    first = fit(OURS, tmp_path, "files", registered_loop, config={**config, "stop_after": 4})
    stored = tmp_path / OURS / "files" / "checkpoint_000004" / REGISTERED_DIR
    files = sorted(p.name for p in stored.iterdir())
    assert files == dcp_files(2)
    again = fit(OURS, tmp_path, "files", registered_loop, config=config, workers=3)
    assert [m["epoch"] for m in first.metrics_history] == [0, 1, 2, 3]
    assert [m["epoch"] for m in again.metrics_history] == [4, 5]
    assert again.metrics_history[0]["restored_digest"] == first.metrics_history[3]["state_digest"]
    assert again.checkpoint.path.endswith("checkpoint_000006")
    assert_nothing_left()


@pytest.mark.slow
@pytest.mark.chaos
def test_registered_fsdp_shards_held_in_memory_heal_a_killed_rank_whose_part_no_peer_holds(
    ray_local, tmp_path
):
    """Pure FSDP registered without ``copy_to_peer``, rank 0 reporting an empty checkpoint at
    every epoch; rank 1's upload of report 3 takes 120 s (its later ones queue behind it).
    Rank 1 is SIGKILLed once report 3 is held in memory: its half of the state died with it,
    no live process holds a copy and storage has no report past 2, but the report's DCP files
    (every rank's shards) are in the memory tier.  The new group loads them through
    ``register`` (restored from memory, nothing redone), the state it starts from is report
    3's to the bit, and rank 0 kept its process."""
    config = {"epochs": 8, "fsdp": True, "checkpoint_every": 1, "digest": True}
    config = {**config, "copy_to_peer": False, "step_sleep_s": 0.1}
    run = _slow_report_3_run(tmp_path, "held-shards", registered_loop, config, only="__1_")
    with FitThread(run) as thread:
        workers = _kill_once_report_3_is_held(run, "held-shards", rank=1)
        assert len(run.controller.result.records) < 8, "the kill came after the last report"
        result = thread.join(timeout_s=100)  # well before report 3's upload could end
    assert not isinstance(result, Exception), result
    (recovery,) = result.summary["recoveries"]
    assert recovery["restored_from"] == "memory" and recovery["steps_redone"] == 0
    history = result.metrics_history
    assert [m["epoch"] for m in history] == list(range(8))
    first_after = next(m for m in history if "restored_digest" in m and m["epoch"] > 0)
    restored_at = first_after["epoch"] - 1
    assert restored_at == recovery["restored_step"] - 1 >= 2
    assert first_after["restored_digest"] == history[restored_at]["state_digest"]
    assert {w["rank"]: w["pid"] for w in result.summary["workers"]}[0] == workers[0]
    assert_nothing_left()


def _slow_report_3_run(tmp_path, name: str, loop, config: dict, only: str = ""):
    """``TorchTrainer(loop)`` on 2 workers whose storage (an fsspec store passed as
    ``storage_filesystem``, so the memory tier is on) takes 120 s to take report 3's files
    (those whose path holds ``only``), one failure allowed."""
    import raytrain_ext.train as train
    from raytrain_ext.train.torch import TorchTrainer
    from tests.helpers.slow_storage import slow_storage

    return TorchTrainer(
        loop,
        train_loop_config={"api": OURS, **config},
        scaling_config=train.ScalingConfig(num_workers=2),
        run_config=train.RunConfig(
            name=name,
            storage_path=str(tmp_path / "storage"),
            storage_filesystem=slow_storage(3, delay_s=120.0, only=only),
            failure_config=train.FailureConfig(max_failures=1),
        ),
    )


def _kill_once_report_3_is_held(run, name: str, rank: int) -> dict:
    """SIGKILL ``rank``'s process from outside once run ``name``'s report 3 is held in its
    memory tier; the ranks' pids before the kill."""
    from raytrain_ext.user_loop.held_reports import HeldReports

    held = HeldReports(name, keep=2)

    def held_through_3() -> bool:
        try:
            newest = held.newest()
        except ValueError:  # the run's memory tier is not started yet
            return False
        return newest is not None and newest.index >= 3

    wait_until(held_through_3, "report 3 held in memory")
    workers = {w["rank"]: w["pid"] for w in run.controller.result.workers}
    os.kill(workers[rank], signal.SIGKILL)
    return workers


@pytest.mark.slow
@pytest.mark.chaos
def test_a_report_held_in_memory_is_resumed_from_while_its_upload_is_still_on_its_way(
    ray_local, tmp_path
):
    """Storage (an fsspec store passed as ``storage_filesystem``, so the memory tier is on)
    takes 120 s to take report 3, as a large checkpoint on its way to a remote store would.
    Rank 0, the only rank that saves, is SIGKILLed from outside once report 3 is held in
    memory (at once: the controller may not have read its last reports yet).  The next
    group resumes from the newest held report without waiting for any upload: the restore
    record names the memory tier, every epoch is in the history once (those rank 0
    reported before it died included), report 3 never reached storage, and the Result
    names the newest persisted checkpoint."""
    config = {"epochs": 6, "checkpoint_every": 1, "step_sleep_s": 0.02}
    run = _slow_report_3_run(tmp_path, "held", quickstart_loop, config)
    with FitThread(run) as thread:
        workers = _kill_once_report_3_is_held(run, "held", rank=0)
        result = thread.join(timeout_s=100)  # well before report 3's upload could end
    assert not isinstance(result, Exception), result
    (recovery,) = result.summary["recoveries"]
    assert recovery["restored_from"] == "memory" and recovery["restored_step"] >= 3
    assert recovery["steps_redone"] == 0
    replayed = [r["step"] for r in run.controller.result.records if r.get("replayed")]
    assert all(step <= recovery["restored_step"] for step in replayed)  # here: [1, 2, 3]
    epochs = [m["epoch"] for m in result.metrics_history]
    assert epochs == list(range(6)), epochs  # none redone, none lost with rank 0's process
    assert {w["rank"]: w["pid"] for w in result.summary["workers"]}[1] == workers[1]
    persisted = sorted(p.name for p in (tmp_path / "storage" / "held").glob("checkpoint_*"))
    assert "checkpoint_000003" not in persisted, persisted
    assert result.checkpoint.path.endswith("checkpoint_000006")
    assert_nothing_left()
