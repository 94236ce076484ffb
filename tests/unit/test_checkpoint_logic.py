"""Checkpoint pieces without processes: manifests, checksums, retention, locations."""

import json
import time

import pytest

from raytrain_ext.checkpoint.manifest import (
    MANIFEST,
    Manifest,
    checksum_file,
    parse_step_dir,
    step_dir_name,
    verify_dir,
)
from raytrain_ext.checkpoint.resolve import check_step
from raytrain_ext.checkpoint.restore import split_location
from raytrain_ext.checkpoint.tiers.base import prune
from raytrain_ext.checkpoint.tiers.disk import DiskTier
from raytrain_ext.config import ConfigError, load_config


def make_step(tier: DiskTier, step: int, commit: bool = True) -> Manifest:
    directory = tier.step_dir(step)
    directory.mkdir(parents=True)
    (directory / "__0_0.distcp").write_bytes(bytes(range(256)) * (step + 1))
    files = {"__0_0.distcp": checksum_file(directory / "__0_0.distcp")}
    manifest = Manifest(step=step, world_size=1, tier="local", files=files)
    if commit:
        tier.commit(manifest)
    return manifest


def test_step_dir_names_sort_and_parse():
    assert step_dir_name(42) == "step-00000042" and parse_step_dir("step-00000042") == 42
    assert parse_step_dir("step-7") == 7 and parse_step_dir("step-x") is None
    assert split_location("s3://b/p/step-00000008") == ("s3://b/p", 8)
    assert split_location("/c/step-3/") == ("/c", 3)


def test_manifest_round_trip_and_verification(tmp_path):
    tier = DiskTier(tmp_path)
    manifest = make_step(tier, 5)
    again = check_step(tier, 5).manifest
    assert again == manifest and json.loads((tier.step_dir(5) / MANIFEST).read_text())["step"] == 5
    assert verify_dir(tier.step_dir(5), again) is None
    shard = tier.step_dir(5) / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert "checksum" in verify_dir(tier.step_dir(5), again) and "corrupted" in verify_dir(
        tier.step_dir(5), again
    )
    shard.write_bytes(bytes(data[:50]))
    assert "truncated" in verify_dir(tier.step_dir(5), again)
    shard.unlink()
    assert "missing" in verify_dir(tier.step_dir(5), again)


def test_uncommitted_steps_do_not_exist_for_the_loader(tmp_path):
    tier = DiskTier(tmp_path)
    make_step(tier, 2)
    make_step(tier, 4, commit=False)  # a save interrupted before its manifest
    (tier.step_dir(6)).mkdir()
    (tier.step_dir(6) / MANIFEST).write_text("{not json")  # a torn manifest
    assert tier.committed_steps() == [2, 6] and check_step(tier, 6).manifest is None
    assert tier.all_steps() == [2, 4, 6]


def test_retention_keeps_last_k_and_never_the_newest_committed(tmp_path):
    tier = DiskTier(tmp_path)
    for step in (1, 2, 3, 4):
        make_step(tier, step)
    make_step(tier, 5, commit=False)  # in progress
    make_step(tier, 0, commit=False)  # stale partial, older than the newest committed
    assert prune(tier, keep_last=2) == [0, 1, 2]
    assert tier.all_steps() == [3, 4, 5]
    assert prune(tier, keep_last=1) == [3]  # step 5 is partial but newer: left alone
    assert tier.committed_steps() == [4]


@pytest.mark.parametrize(
    "override,message",
    [
        ("checkpoint.every_steps=0", r"checkpoint\.every_steps: must be > 0 or null"),
        ("checkpoint.s3.uri=bucket/x", r"checkpoint\.s3\.uri: 'bucket/x' is not an s3://"),
        ("checkpoint.resume=/some/dir", r"checkpoint\.resume: '/some/dir' must be auto, never"),
        ("checkpoint.on_busy=queue", r"checkpoint\.on_busy: 'queue' is not one of skip, wait"),
        ("checkpoint.local=false", r"checkpoint\.local: checkpoints are enabled but no persistent"),
    ],
)
def test_checkpoint_config_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_chunk_checksums_cover_the_file_in_order(tmp_path):
    from raytrain_ext.checkpoint.manifest import checksum_bytes

    data = bytes(range(256)) * 5
    (tmp_path / "f").write_bytes(data)
    entry = checksum_file(tmp_path / "f", chunk_size=300)
    assert entry.size == 1280 and entry.chunk_size == 300 and len(entry.chunk_xxh3) == 5
    assert entry.chunk_xxh3 == [checksum_bytes(data[i : i + 300]) for i in range(0, 1280, 300)]
    assert entry.xxh3_128 == checksum_bytes(data)


def _saved_step(directory):
    import torch
    import torch.distributed.checkpoint as dcp

    saved = {
        "w": torch.randn(64, 32),
        "b": torch.arange(7.0),
        "h": torch.randn(8, 8).to(torch.bfloat16),
        "step": 12,
    }
    dcp.save(saved, checkpoint_id=directory, no_dist=True)
    names = sorted(p.name for p in directory.iterdir())
    chunked = {n: checksum_file(directory / n, chunk_size=1024) for n in names}
    return saved, Manifest(step=12, world_size=1, tier="memory", files=chunked)


def _load_verified(views, manifest):
    import torch
    import torch.distributed.checkpoint as dcp

    from raytrain_ext.checkpoint.reader import VerifiedReader

    loaded = {
        "w": torch.zeros(64, 32),
        "b": torch.zeros(7),
        "h": torch.zeros(8, 8, dtype=torch.bfloat16),
        "step": 0,
    }
    reader = VerifiedReader(views, manifest, "memory://r/step-12", threads=3)
    dcp.load(loaded, storage_reader=reader, no_dist=True)
    return loaded, reader.problem


def test_verified_reader_loads_mapped_and_in_memory_files_bit_identical(tmp_path):
    """The restore path of every tier: DCP items copied straight from mapped files or
    held buffers (read-only ones too) into their targets, checksums verified as they load."""
    import torch

    from raytrain_ext.checkpoint.reader import map_files, size_problem

    saved, manifest = _saved_step(tmp_path)
    names = sorted(manifest.files)
    for views in (
        map_files(tmp_path, names),
        {n: memoryview((tmp_path / n).read_bytes()) for n in names},
    ):
        assert size_problem(views, manifest, "memory://r") is None
        loaded, problem = _load_verified(views, manifest)
        assert problem is None and loaded["step"] == 12
        for key in ("w", "b", "h"):
            assert loaded[key].dtype == saved[key].dtype and torch.equal(loaded[key], saved[key])


def test_verified_reader_names_a_corrupted_chunk_and_a_truncated_file(tmp_path):
    from raytrain_ext.checkpoint.reader import size_problem

    _, manifest = _saved_step(tmp_path)
    views = {n: memoryview(bytearray((tmp_path / n).read_bytes())) for n in manifest.files}
    data = next(n for n in manifest.files if n.endswith(".distcp"))
    views[data][-1] ^= 0xFF
    _, problem = _load_verified(views, manifest)
    size = views[data].nbytes
    assert problem.startswith(f"memory://r/step-12/{data} bytes ") and problem.endswith(
        f"-{size} fail their checksum (corrupted)"
    ), problem
    problem = size_problem({**views, data: views[data][:-1]}, manifest, "memory://r")
    assert f"memory://r/{data} has" in problem and "(truncated?)" in problem


def test_saved_tensor_view_aliases_the_bytes_and_matches_torch_load():
    """Views of what torch.save wrote (the format of DCP's items): same values and dtype as
    torch.load, for strided and empty tensors, without copying the data record."""
    import io

    import torch

    from raytrain_ext.checkpoint.saved_tensor import tensor_view

    cases = [
        torch.randn(5, 6).t(),
        torch.arange(12, dtype=torch.bfloat16).view(3, 4)[1:],
        torch.tensor(3.0),
        torch.zeros(0, 4),
        torch.ones(7, dtype=torch.bool),
        torch.randint(0, 9, (4,), dtype=torch.int64),
    ]
    for tensor in cases:
        buffer = io.BytesIO()
        torch.save(tensor, buffer)
        blob = bytearray(buffer.getvalue())
        view = tensor_view(memoryview(blob))
        assert view.dtype == tensor.dtype and torch.equal(view, tensor)
        if tensor.numel():
            start = torch.frombuffer(blob, dtype=torch.uint8).data_ptr()
            assert start <= view.data_ptr() < start + len(blob)  # inside the blob: no copy


def test_archive_records_read_from_the_central_directory_match_zipfile():
    """The restore's own reading of a saved tensor's zip index gives what zipfile gives,
    and an archive it does not cover (here one with a comment) goes through zipfile."""
    import io
    import zipfile

    import torch

    from raytrain_ext.checkpoint.saved_tensor import archive_records, tensor_view

    buffer = io.BytesIO()
    torch.save(torch.randn(64, 33), buffer)
    blob = bytearray(buffer.getvalue())
    expected = {
        info.filename.split("/", 1)[-1]: (info.header_offset, info.file_size, info.compress_type)
        for info in zipfile.ZipFile(io.BytesIO(bytes(blob))).infolist()
    }
    assert {name: tuple(r) for name, r in archive_records(memoryview(blob)).items()} == expected
    assert "data.pkl" in expected and "data/0" in expected

    commented = io.BytesIO(bytes(blob))
    with zipfile.ZipFile(commented, "a") as archive:
        archive.comment = b"not written by torch"
    with_comment = bytearray(commented.getvalue())
    records = archive_records(memoryview(with_comment))
    assert records["data/0"].size == 64 * 33 * 4
    assert torch.equal(tensor_view(memoryview(with_comment)), torch.load(io.BytesIO(blob)))


def test_memory_watch_sees_a_transient_peak_and_not_what_stays():
    """The restore record's peak memory: what a restore held only while it ran counts,
    the state it leaves behind does not."""
    import torch

    from raytrain_ext.checkpoint.phases import MemoryWatch, anonymous_rss

    if anonymous_rss() is None:
        pytest.skip("no /proc/self/status RssAnon on this system")
    mb = 2**20
    with MemoryWatch(interval_s=0.001) as watch:
        kept = torch.ones(32 * mb // 4)  # stays: the "state"
        transient = torch.ones(64 * mb // 4)
        time.sleep(0.05)
        del transient
    record = watch.record(state_bytes=32 * mb)
    assert 56 <= record["transient_peak_mb"] <= 80, record
    assert record["peak_over_state"] == round((32 + record["transient_peak_mb"]) / 32, 3)
    assert kept.sum() > 0


def test_a_load_that_raises_on_one_rank_is_reported_not_raised(tmp_path):
    """Each rank loads alone (no DCP collectives), so a rank whose load fails must report
    it for the ranks' agreement instead of raising while its peers wait in it."""
    import torch

    from raytrain_ext.checkpoint.reader import VerifiedReader, map_files
    from raytrain_ext.checkpoint.restore import load_planned

    saved, manifest = _saved_step(tmp_path)
    reader = VerifiedReader(map_files(tmp_path, sorted(manifest.files)), manifest, "r", threads=2)
    targets = {"w": torch.zeros(64, 32), "absent": torch.zeros(3)}
    problem = load_planned(targets, reader)
    assert problem is not None and problem.startswith("cannot load:") and "absent" in problem

    reader = VerifiedReader(map_files(tmp_path, sorted(manifest.files)), manifest, "r", threads=2)
    targets = {"w": torch.zeros(64, 32), "step": 0}
    assert load_planned(targets, reader) is None
    assert torch.equal(targets["w"], saved["w"]) and targets["step"] == 12


def test_the_first_time_based_save_comes_early_only_without_a_step_schedule():
    from raytrain_ext.checkpoint.manager import seconds_between_saves

    def after(*overrides, saves=0):
        return seconds_between_saves(load_config(None, list(overrides)).checkpoint, saves)

    assert after() == 60.0 and after(saves=1) == 600.0  # the defaults: 60 s, then 600 s
    assert after("checkpoint.every_steps=100") == 600.0  # the user's schedule is left alone
    assert after("checkpoint.every_seconds=30") == 30.0
    assert after("checkpoint.first_save_after_s=null") == 600.0
    assert after("checkpoint.every_seconds=null") == 60.0
    assert after("checkpoint.every_seconds=null", saves=1) is None
