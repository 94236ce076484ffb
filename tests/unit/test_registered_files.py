"""A report with a checkpoint carries the registered state as DCP files
(``user_loop.registered_files``), through the real ``LoopSession`` and storage, no Ray and
no process group (rank 0's side of a group of 2; rank 1's upload is made by hand)."""

import os
import tempfile
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import torch
from torch import nn

from raytrain_ext.user_loop.checkpoint import Checkpoint
from raytrain_ext.user_loop.registered import Registration, SnapshotKeeper
from raytrain_ext.user_loop.registered_files import REGISTERED_DIR, RegisteredFiles
from raytrain_ext.user_loop.session import LoopSession, ReportMismatch, TrainContext
from raytrain_ext.user_loop.storage import Retention, RunStorage
from raytrain_ext.user_loop.uploader import Uploader

OTHER_RANK = ("report", 5, False, None, {}, False, None, False, True)  # registered, no files


def _objects(seed: int) -> dict:
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    return {"model": model, "optimizer": optimizer, "progress": {"epoch": seed}}


def _trained() -> dict:
    objects = _objects(0)
    objects["model"](torch.ones(2, 4)).sum().backward()
    objects["optimizer"].step()
    return objects


def _session(tmp_path, uploader: Uploader):
    store = RunStorage(pafs.LocalFileSystem(), str(tmp_path / "store" / "run"), Retention())
    context = TrainContext(0, 2, 0, 2, 0, "run", store, {})
    registration = Registration(
        "run", 4, None, SnapshotKeeper(), resume=None, world=2, files=RegisteredFiles()
    )
    session = LoopSession(
        context,
        start_index=4,
        start_checkpoint=None,
        exchange=lambda payload: [payload, OTHER_RANK],
        push=lambda logged: None,
        stop_asked=lambda: None,
        uploader=uploader,
        group_id="g2",
        datasets={},
        registration=registration,
    )
    return session, store


def _user_dir(tmp_path) -> str:
    d = tmp_path / "mine"
    d.mkdir()
    (d / "notes.txt").write_text("rank zero's own file")
    return str(d)


def test_a_reported_checkpoint_holds_the_registered_state_and_loads_it_back(tmp_path):
    uploader = Uploader()
    uploader.start_group("g2")
    session, store = _session(tmp_path, uploader)
    objects = _trained()
    session.register(objects)
    session.report({"loss": 0.5}, Checkpoint.from_directory(_user_dir(tmp_path)))
    rank_1 = tmp_path / "rank1"  # its own part: nothing here, as a replicated state's
    (rank_1 / REGISTERED_DIR).mkdir(parents=True)
    store.upload(str(rank_1), 5, rank=1, group="g2")
    assert uploader.drain(30) and uploader.failures == []
    assert store.latest().index == 5
    stored = tmp_path / "store" / "run" / "checkpoint_000005"
    files = sorted(os.listdir(stored / REGISTERED_DIR))
    assert files == [".metadata", "__0_0.distcp", "checksums-0.json"]
    assert (stored / "notes.txt").read_text() == "rank zero's own file"
    fresh = _objects(7)  # another seed; its optimizer has not stepped
    record = RegisteredFiles().load(fresh, Checkpoint(str(stored)))
    assert record is not None and record["bytes"] > 0
    assert torch.equal(fresh["model"].weight, objects["model"].weight)
    moments = [fresh["optimizer"].state[p]["exp_avg"] for p in fresh["model"].parameters()]
    expected = [objects["optimizer"].state[p]["exp_avg"] for p in objects["model"].parameters()]
    assert all(torch.equal(a, b) for a, b in zip(moments, expected, strict=True))
    assert fresh["optimizer"].param_groups[0]["lr"] == 0.1
    assert fresh["progress"] == {"epoch": 0}


def test_a_registered_dict_comes_back_with_every_key_it_was_saved_with(tmp_path):
    """The loop's progress dict gained keys after it was built (a list, a nested dict with a
    tensor): the fresh dict, which has only its first key, gets all of them back, as a live
    copy gives them; a scheduler's state comes back too."""

    def objects(lr: float, step_size: int) -> dict:
        model = nn.Linear(2, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size)
        return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "progress": {}}

    saved = objects(0.1, 3)
    saved["optimizer"].step()
    saved["scheduler"].step()
    best = {"loss": 0.5, "at": torch.arange(3.0), "steps": [torch.zeros(1), 4]}
    saved["progress"].update(epoch=3, history=[1, 2], best=best, name="run-a")
    staged = RegisteredFiles().add_to(None, saved, "run")
    fresh = objects(0.5, 7)
    fresh["progress"]["epoch"] = 0
    RegisteredFiles().load(fresh, Checkpoint(staged.directory))
    progress = fresh["progress"]
    assert {k: progress[k] for k in ("epoch", "history", "name")} == {
        "epoch": 3,
        "history": [1, 2],
        "name": "run-a",
    }
    assert progress["best"]["loss"] == 0.5 and torch.equal(progress["best"]["at"], best["at"])
    assert torch.equal(progress["best"]["steps"][0], torch.zeros(1))
    assert progress["best"]["steps"][1] == 4
    assert fresh["scheduler"].state_dict() == saved["scheduler"].state_dict()
    assert fresh["optimizer"].param_groups[0]["lr"] == 0.1


def test_a_registered_state_that_cannot_be_written_keeps_no_checkpoint(tmp_path):
    """A value DCP cannot save (a lambda in the progress dict): the report is still made,
    keeps no checkpoint (one without the registered state would resume from state it
    lacks), the user's directory is untouched and nothing is left staged."""
    uploader = Uploader()
    uploader.start_group("g2")
    session, store = _session(tmp_path, uploader)
    objects = {**_objects(0), "progress": {"schedule": lambda step: step}}
    session.register(objects)
    directory = _user_dir(tmp_path)
    staged_before = _staged()
    session.report({"loss": 0.5}, Checkpoint.from_directory(directory))
    assert uploader.drain(30)
    assert session.index == 5 and session.failed_writes == [5]
    assert store.latest() is None
    assert os.listdir(directory) == ["notes.txt"]
    assert _staged() <= staged_before


def _staged() -> set:
    """The staging directories of run ``run``'s reports in the temporary directory."""
    return {
        n for n in os.listdir(tempfile.gettempdir()) if n.startswith("raytrain-ext-run-report-")
    }


def test_ranks_that_registered_and_ranks_that_did_not_are_named(tmp_path):
    session, _ = _session(tmp_path, Uploader())
    gathered = [("report", 3, True, None, {}, False, None, False, f) for f in (True, False)]
    with pytest.raises(ReportMismatch, match=r"ranks \[0\] had called register\(\)"):
        session.check_agreement(gathered, "report", 3)


def test_a_checkpoint_of_other_objects_is_refused_by_name(tmp_path):
    staged = RegisteredFiles().add_to(None, {"model": nn.Linear(2, 2)}, "run")
    with pytest.raises(ValueError, match=r"holds \['model'\], this group registered \['net'\]"):
        RegisteredFiles().load({"net": nn.Linear(2, 2)}, Checkpoint(staged.directory))


def test_a_damaged_registered_state_is_refused_naming_the_file(tmp_path):
    staged = RegisteredFiles().add_to(None, _trained(), "run")
    data = Path(staged.directory, REGISTERED_DIR, "__0_0.distcp")
    data.write_bytes(data.read_bytes()[:-1] + b"?")
    fresh = _objects(7)
    with pytest.raises(ValueError, match=r"damaged: .*__0_0\.distcp checksum .* \(corrupted\)"):
        RegisteredFiles().load(fresh, Checkpoint(staged.directory))
    assert fresh["progress"] == {"epoch": 7}


def test_a_users_directory_named_like_the_registered_state_is_refused(tmp_path):
    session, _ = _session(tmp_path, Uploader())
    session.register(_objects(0))
    directory = _user_dir(tmp_path)
    os.mkdir(os.path.join(directory, REGISTERED_DIR))
    with pytest.raises(ValueError, match=f"holds {REGISTERED_DIR}/.*rename it"):
        session.report({"loss": 0.5}, Checkpoint.from_directory(directory))
