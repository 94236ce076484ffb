"""ChecksummingWriter: checksums taken while writing equal a read-back, and torch's tools load the files."""

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from raytrain_ext.checkpoint.manifest import FileHasher, checksum_bytes, checksum_file
from raytrain_ext.checkpoint.writer import ChecksummingWriter


def test_file_hasher_gives_the_same_entry_for_any_split(tmp_path):
    data = bytes(range(256)) * 5  # 1280 bytes
    (tmp_path / "f").write_bytes(data)
    hasher = FileHasher(chunk_size=300)
    for start, end in ((0, 7), (7, 300), (300, 301), (301, 1000), (1000, 1280)):
        hasher.update(memoryview(data)[start:end])
    entry = hasher.entry()
    assert entry == checksum_file(tmp_path / "f", chunk_size=300)
    assert entry.chunk_xxh3 == [checksum_bytes(data[i:i + 300]) for i in range(0, 1280, 300)]
    assert entry.size == 1280


def test_writer_checksums_match_the_files_and_torch_loads_them(tmp_path):
    state = {"w": torch.randn(300, 70), "b": torch.arange(1000, dtype=torch.int64),
             "step": torch.tensor(7.0)}
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
