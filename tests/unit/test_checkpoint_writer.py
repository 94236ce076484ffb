"""ChecksummingWriter: checksums taken while writing equal a read-back, and torch's tools load the files."""

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from raytrain_ext.checkpoint.manifest import FileHasher, checksum_bytes, checksum_file
from raytrain_ext.checkpoint.resolve import check_step
from raytrain_ext.checkpoint.writer import ChecksummingWriter


def test_file_hasher_gives_the_same_entry_for_any_split(tmp_path):
    data = bytes(range(256)) * 5  # 1280 bytes
    (tmp_path / "f").write_bytes(data)
    hasher = FileHasher(chunk_size=300)
    for start, end in ((0, 7), (7, 300), (300, 301), (301, 1000), (1000, 1280)):
        hasher.update(memoryview(data)[start:end])
    entry = hasher.entry()
    assert entry == checksum_file(tmp_path / "f", chunk_size=300)
    assert entry.chunk_xxh3 == [checksum_bytes(data[i : i + 300]) for i in range(0, 1280, 300)]
    assert entry.size == 1280


def test_writer_checksums_match_the_files_and_torch_loads_them(tmp_path):
    state = {
        "w": torch.randn(300, 70),
        "b": torch.arange(1000, dtype=torch.int64),
        "step": torch.tensor(7.0),
    }
    writer = ChecksummingWriter(tmp_path / "ckpt", chunk_size=4096, thread_count=2)
    dcp.save(state, storage_writer=writer, no_dist=True)
    data_files = sorted(p.name for p in (tmp_path / "ckpt").glob("*.distcp"))
    assert sorted(writer.entries) == data_files == ["__0_0.distcp", "__0_1.distcp"]
    for name, entry in writer.entries.items():
        assert entry == checksum_file(tmp_path / "ckpt" / name, chunk_size=4096)
    assert torch.serialization.get_crc32_options() is True  # only the writer threads skip it

    loaded = {k: torch.empty_like(v) for k, v in state.items()}
    dcp.load(loaded, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    dcp_to_torch_save(tmp_path / "ckpt", tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert all(torch.equal(full[k], state[k]) for k in state)


def test_deleted_steps_files_are_overwritten_in_place_by_the_next_save(tmp_path):
    """Local retention with recycling: the step's manifest goes first, its data files go to
    the pool, and the next save writes over them (same inodes), cut to the new size; what
    it wrote verifies and loads, and the pool is empty again."""
    from raytrain_ext.checkpoint.manifest import MANIFEST, Manifest, verify_dir
    from raytrain_ext.checkpoint.recycle import POOL
    from raytrain_ext.checkpoint.tiers.disk import DiskTier

    tier = DiskTier(tmp_path, recycle=True)
    pool = tmp_path / POOL

    def save(step, state):
        writer = ChecksummingWriter(tier.step_dir(step), 4096, pool, thread_count=2)
        dcp.save(state, storage_writer=writer, no_dist=True)
        files = {p.name: checksum_file(p) for p in tier.step_dir(step).iterdir()}
        tier.commit(Manifest(step=step, world_size=1, tier="local", files=files))
        return writer

    save(1, {"w": torch.randn(400, 300), "b": torch.randn(5000)})
    inodes = {p.stat().st_ino for p in tier.step_dir(1).glob("*.distcp")}
    tier.delete(1)
    assert not tier.step_dir(1).exists() and tier.committed_steps() == []
    assert {p.stat().st_ino for p in pool.iterdir()} == inodes

    smaller = {"w": torch.randn(100, 30), "b": torch.randn(50)}
    writer = save(2, smaller)
    written = sorted(tier.step_dir(2).glob("*.distcp"))
    assert {p.stat().st_ino for p in written} == inodes and list(pool.iterdir()) == []
    for path in written:
        assert writer.entries[path.name] == checksum_file(path, chunk_size=4096)
    assert verify_dir(tier.step_dir(2), check_step(tier, 2).manifest) is None
    loaded = {k: torch.empty_like(v) for k, v in smaller.items()}
    dcp.load(loaded, checkpoint_id=tier.step_dir(2), no_dist=True)
    assert all(torch.equal(loaded[k], smaller[k]) for k in smaller)
    assert (tier.step_dir(2) / MANIFEST).is_file()
