"""Checkpoint pieces without processes: manifests, checksums, retention, locations."""

import json

import pytest

from raytrain_ext.checkpoint.disk import DiskTier
from raytrain_ext.checkpoint.manager import split_location
from raytrain_ext.checkpoint.manifest import (
    MANIFEST,
    Manifest,
    checksum_file,
    parse_step_dir,
    step_dir_name,
    verify_dir,
)
from raytrain_ext.checkpoint.resolve import check_step
from raytrain_ext.checkpoint.tier import prune
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
        tier.step_dir(5), again)
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


@pytest.mark.parametrize("override,message", [
    ("checkpoint.every_steps=0", r"checkpoint\.every_steps: must be > 0 or null"),
    ("checkpoint.s3.uri=bucket/x", r"checkpoint\.s3\.uri: 'bucket/x' is not an s3://"),
    ("checkpoint.resume=/some/dir", r"checkpoint\.resume: '/some/dir' must be auto, never"),
    ("checkpoint.on_busy=queue", r"checkpoint\.on_busy: 'queue' is not one of skip, wait"),
    ("checkpoint.local=false", r"checkpoint\.local: checkpoints are enabled but no persistent"),
])
def test_checkpoint_config_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_chunk_checksums_cover_the_file_in_order(tmp_path):
    from raytrain_ext.checkpoint.manifest import checksum_bytes

    data = bytes(range(256)) * 5
    (tmp_path / "f").write_bytes(data)
    entry = checksum_file(tmp_path / "f", chunk_size=300)
    assert entry.size == 1280 and entry.chunk_size == 300 and len(entry.chunk_xxh3) == 5
    assert entry.chunk_xxh3 == [checksum_bytes(data[i:i + 300]) for i in range(0, 1280, 300)]
    assert entry.xxh3_128 == checksum_bytes(data)


def test_dcp_loads_verified_in_memory_files_and_bad_buffers_are_named(tmp_path):
    """The memory tier's restore path: DCP files held as buffers load without a disk round
    trip; a truncated or corrupted buffer is reported (by name) before anything loads."""
    import torch
    import torch.distributed.checkpoint as dcp

    from raytrain_ext.checkpoint.buffers import BufferReader, verify_buffers

    saved = {"w": torch.randn(64, 32), "b": torch.arange(7.0), "step": 12}
    dcp.save(saved, checkpoint_id=tmp_path, no_dist=True)
    names = sorted(p.name for p in tmp_path.iterdir())
    manifest = Manifest(step=12, world_size=1, tier="memory",
                        files={n: checksum_file(tmp_path / n) for n in names})
    buffers = {n: memoryview((tmp_path / n).read_bytes()) for n in names}
    assert verify_buffers(buffers, manifest, "memory://run/step-12") is None
    loaded = {"w": torch.zeros(64, 32), "b": torch.zeros(7), "step": 0}
    dcp.load(loaded, storage_reader=BufferReader(buffers, "memory://run/step-12"), no_dist=True)
    assert torch.equal(loaded["w"], saved["w"]) and torch.equal(loaded["b"], saved["b"])
    assert loaded["step"] == 12
    data = next(n for n in names if n.endswith(".distcp"))
    flipped = bytearray(buffers[data])
    flipped[-1] ^= 0xFF
    problem = verify_buffers({**buffers, data: memoryview(flipped)}, manifest, "memory://r")
    assert problem.startswith(f"memory://r/{data} checksum") and "(corrupted)" in problem
    problem = verify_buffers({**buffers, data: buffers[data][:-1]}, manifest, "memory://r")
    assert f"memory://r/{data} has" in problem and "(truncated?)" in problem
