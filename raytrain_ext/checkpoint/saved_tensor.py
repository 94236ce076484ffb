"""A tensor saved by ``torch.save``, read as a view of its bytes rather than a copy.

DCP writes each tensor item of a checkpoint file with ``torch.save``: a zip archive
(stored, not compressed) of a small pickle that describes the tensor and one record
with the storage's bytes.  ``torch.load`` copies that record into a fresh storage;
here the pickle is read with an unpickler that admits only what such an archive holds
and the record is wrapped in place, so the only copy a restore makes is the one into
its target.

Invariant: the view aliases the caller's buffer; it is valid as long as the buffer
is, and it is only read.
"""

from __future__ import annotations

import io
import pickle
import struct
import sys
import warnings
import zipfile
from typing import Any, Dict, NamedTuple, Optional, Tuple

import torch

LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # a zip local file header, 30 bytes
LOCAL_HEADER_SIGNATURE = 0x04034B50
CENTRAL_HEADER = struct.Struct("<IHHHHHHIIIHHHHHII")  # a central directory entry, 46 bytes
CENTRAL_HEADER_SIGNATURE = 0x02014B50
END_RECORD = struct.Struct("<IHHHHIIH")  # end of central directory, 22 bytes
END_RECORD_SIGNATURE = 0x06054B50
ZIP64_MARK = 0xFFFFFFFF
STORAGE_DTYPES = {  # the legacy storage class names torch.save pickles, by dtype
    "FloatStorage": torch.float32,
    "DoubleStorage": torch.float64,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128,
}

# torch.frombuffer warns on every read-only buffer (memory-tier objects are read-only);
# the views made here are only read, so the warning says nothing to act on.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


class _Storage:
    """What the archive's pickle names as a tensor's storage: its dtype, record and size."""

    def __init__(self, dtype: torch.dtype, key: str, numel: int):
        self.dtype, self.key, self.numel = dtype, key, numel


def _rebuild(storage: _Storage, offset: int, size, stride, *rest) -> Tuple:
    return storage, offset, tuple(size), tuple(stride)


class _SpecUnpickler(pickle.Unpickler):
    """Admits only a plain tensor's pickle: ``_rebuild_tensor_v2`` of one storage."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module == "torch" and name in STORAGE_DTYPES:
            return STORAGE_DTYPES[name]
        raise pickle.UnpicklingError(f"not a plain saved tensor ({module}.{name})")

    def persistent_load(self, pid: Any) -> _Storage:
        kind, dtype, key, _location, numel = pid
        if kind != "storage":
            raise pickle.UnpicklingError(f"unexpected persistent id {kind!r}")
        return _Storage(dtype, key, numel)


class _ViewFile(io.RawIOBase):
    """A seekable, read-only file over a buffer, for ``zipfile``: it reads the small
    index and pickle parts, never the whole buffer."""

    def __init__(self, view: memoryview):
        super().__init__()
        self.view, self.pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.view.nbytes}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer) -> int:
        part = self.view[self.pos : self.pos + len(buffer)]
        buffer[: len(part)] = part
        self.pos += len(part)
        return len(part)


class Record(NamedTuple):
    """One stored file of the archive: where its local header is, its size, compression."""

    header_offset: int
    size: int
    compress_type: int


def tensor_view(blob: memoryview) -> torch.Tensor:
    """The tensor ``torch.save`` wrote into ``blob``, aliasing ``blob``'s bytes.

    Raises ``ValueError`` for anything but one plain CPU tensor in a little-endian,
    uncompressed archive (which is what DCP writes).
    """
    if sys.byteorder != "little":
        raise ValueError("saved-tensor views need a little-endian host")
    records = archive_records(blob)
    if "byteorder" in records and _record(blob, records["byteorder"]) != b"little":
        raise ValueError("the tensor was saved big-endian")
    storage, offset, size, stride = _SpecUnpickler(
        io.BytesIO(_record(blob, records["data.pkl"]))
    ).load()
    record = records.get(f"data/{storage.key}")
    itemsize = storage.dtype.itemsize
    if (
        record is None
        or record.compress_type != zipfile.ZIP_STORED
        or record.size != storage.numel * itemsize
    ):
        raise ValueError("the tensor's storage record is missing or compressed")
    start = _data_start(blob, record.header_offset)
    flat = (
        torch.frombuffer(blob, dtype=storage.dtype, count=storage.numel, offset=start)
        if storage.numel
        else torch.empty(0, dtype=storage.dtype)
    )
    return flat.as_strided(size, stride, offset)


def archive_records(blob: memoryview) -> Dict[str, Record]:
    """The archive's files by name (without the archive's top folder), read from its
    central directory.

    Why not ``zipfile``: a restore reads one archive per tensor, and ``ZipFile`` took
    70 us each here (a third of a restore's Python per item); this reads the few
    entries torch writes in a tenth of that.  An archive this does not cover (a
    comment, ZIP64 sizes or offsets) goes through ``zipfile``.
    """
    end = blob.nbytes - END_RECORD.size
    if end < 0:
        raise ValueError("too short for a zip archive")
    signature, _, _, _, count, _, directory, comment = END_RECORD.unpack_from(blob, end)
    if signature != END_RECORD_SIGNATURE or comment or directory == ZIP64_MARK:
        return _zipfile_records(blob)
    records = _central_directory(blob, directory, count)
    return _zipfile_records(blob) if records is None else records


def _central_directory(blob: memoryview, directory: int, count: int) -> Optional[Dict[str, Record]]:
    """The ``count`` entries at offset ``directory``; None for what ``zipfile`` should
    judge (an entry past the end, ZIP64 sizes or offsets, a damaged entry)."""
    records, pos = {}, directory
    for _ in range(count):
        if pos + CENTRAL_HEADER.size > blob.nbytes:
            return None
        fields = CENTRAL_HEADER.unpack_from(blob, pos)
        if fields[0] != CENTRAL_HEADER_SIGNATURE:
            return None
        size, name_length, extra_length, comment_length, header = (
            fields[9],
            fields[10],
            fields[11],
            fields[12],
            fields[16],
        )
        if ZIP64_MARK in (size, header):
            return None
        name = bytes(blob[pos + CENTRAL_HEADER.size : pos + CENTRAL_HEADER.size + name_length])
        records[name.decode().split("/", 1)[-1]] = Record(header, size, fields[4])
        pos += CENTRAL_HEADER.size + name_length + extra_length + comment_length
    return records


def _zipfile_records(blob: memoryview) -> Dict[str, Record]:
    archive = zipfile.ZipFile(_ViewFile(blob))
    return {
        info.filename.split("/", 1)[-1]: Record(
            info.header_offset, info.file_size, info.compress_type
        )
        for info in archive.infolist()
    }


def _record(blob: memoryview, record: Record) -> bytes:
    """A small stored record's bytes.  Not through ``ZipFile.read``: its CRC check fails on
    records DCP's stream writer leaves with a placeholder CRC; the manifest's checksums
    cover these bytes instead."""
    if record.compress_type != zipfile.ZIP_STORED:
        raise ValueError("a record of the saved tensor is compressed")
    start = _data_start(blob, record.header_offset)
    return blob[start : start + record.size].tobytes()


def _data_start(blob: memoryview, header_offset: int) -> int:
    fields = LOCAL_HEADER.unpack_from(blob, header_offset)
    if fields[0] != LOCAL_HEADER_SIGNATURE:
        raise ValueError("damaged zip header")
    name_length, extra_length = fields[-2], fields[-1]
    return header_offset + LOCAL_HEADER.size + name_length + extra_length
