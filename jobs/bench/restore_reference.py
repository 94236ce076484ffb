"""Raw reads of a checkpoint's bytes, the references a restore is measured against.

Each reference does what a restore of a replicated (DDP) state must do at the least:
every one of the W workers ends up with all of the state's bytes in its own memory, all
W at once, from the same medium:
- memory: W new processes each ``ray.get`` an object holding the bytes (put by another
  process, as a holder puts the files) and copy it into a fresh buffer of their own,
  allocated as the state a restore fills is (two more figures are printed beside it: a
  second get by the same processes, with the store already mapped, and a get into a
  numpy buffer, which asks the kernel for 2 MiB pages: see ``object_store_get_s``);
- local: W threads each read the step's files into fresh buffers, after the files were
  written back and dropped from the page cache (``sync``, then ``posix_fadvise(DONTNEED)``),
  so the first reader goes to the disk; the restore being measured starts the same way;
- S3: W threads each download the step's objects with boto3 (multipart, the tier's
  part size and concurrency) into memory.
"""

from __future__ import annotations

import io
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List

MB = 1024 * 1024


def drop_from_page_cache(paths: List[Path]) -> None:
    """Write back every dirty page first (``DONTNEED`` keeps dirty pages, and a writeback
    still running would slow whichever read comes first), then drop the files' pages."""
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def step_files(step_dir: Path) -> List[Path]:
    return sorted(p for p in step_dir.iterdir() if p.is_file() and p.name != "manifest.json")


def local_read_s(step_dir: Path, workers: int) -> float:
    """Seconds for ``workers`` threads to each read every file of ``step_dir``, cold."""
    paths = step_files(step_dir)
    drop_from_page_cache(paths)

    def read_all(_):
        for path in paths:
            with open(path, "rb", buffering=0) as f:
                buffer = bytearray(os.fstat(f.fileno()).st_size)
                view, done = memoryview(buffer), 0
                while done < len(buffer):
                    done += f.readinto(view[done:])

    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(read_all, range(workers)))
    return time.perf_counter() - start


def s3_download_s(endpoint: str, bucket: str, prefix: str, workers: int) -> float:
    """Seconds for ``workers`` threads to each download every object under ``prefix``."""
    import boto3
    from boto3.s3.transfer import TransferConfig

    client = boto3.client("s3", endpoint_url=endpoint)
    keys = [
        o["Key"]
        for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]
        if not o["Key"].endswith("manifest.json")
    ]
    config = TransferConfig(
        multipart_threshold=16 * MB, multipart_chunksize=16 * MB, max_concurrency=8
    )

    def download_all(_):
        for key in keys:
            client.download_fileobj(bucket, key, io.BytesIO(), Config=config)

    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(download_all, range(workers)))
    return time.perf_counter() - start


def object_store_get_s(nbytes: int, workers: int, tries: int) -> Dict[str, object]:
    """Seconds for ``workers`` zero-CPU actors to each ``ray.get`` an ``nbytes`` object put
    by another actor and copy it into a fresh buffer of their own, at once.

    ``fresh``: one figure per try, each the first get of new actors, as a restore is (it
    runs in new worker processes, which map the object store's pages for the first time),
    copied into ``torch.empty``: memory as the state a restore fills is allocated (4 KiB
    pages, first touched by the copy; the local and S3 references' buffers are alike);
    ``warm``: the best second get of the same actors, the store's pages already mapped;
    ``numpy``: the first get of new actors into ``np.empty``, which ``madvise``s its
    allocations for 2 MiB pages: faster when the kernel has free huge pages, up to ten
    times slower when it must compact memory first (0.07-1.03 s, bimodal within each run here).
    """
    import numpy as np
    import ray

    @ray.remote(num_cpus=0)
    class Holder:
        def put(self, size):
            self.ref = ray.put(np.random.randint(0, 255, size, dtype=np.uint8))
            return [self.ref]

    @ray.remote(num_cpus=0)
    class Getter:
        def ready(self):
            import warnings

            import torch

            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            return torch.get_num_threads()  # 1, as in a training worker

        def get(self, wrapped, into_numpy=False):
            start = time.perf_counter()
            held = ray.get(wrapped[0])
            if into_numpy:
                np.copyto(np.empty_like(held), held)
            else:
                import torch

                source = torch.frombuffer(held, dtype=torch.uint8)
                torch.empty(held.nbytes, dtype=torch.uint8).copy_(source)
            return time.perf_counter() - start

    holder = Holder.remote()
    wrapped = ray.get(holder.put.remote(nbytes))
    times: Dict[str, List[float]] = {"fresh": [], "warm": [], "numpy": []}
    try:
        for _ in range(tries):
            for kind in ("fresh", "numpy"):
                getters = [Getter.remote() for _ in range(workers)]
                ray.get([g.ready.remote() for g in getters])
                first = [g.get.remote(wrapped, kind == "numpy") for g in getters]
                times[kind].append(max(ray.get(first)))
                if kind == "fresh":
                    times["warm"].append(max(ray.get([g.get.remote(wrapped) for g in getters])))
                for getter in getters:
                    ray.kill(getter)
    finally:
        ray.kill(holder)
    return {"fresh": times["fresh"], "warm": min(times["warm"]), "numpy": times["numpy"]}
