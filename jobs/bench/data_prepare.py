"""``data prepare`` throughput: tokens/s per core, ours (Ray Data) vs ``datasets.map``.

On the same generated JSON lines (``--mb`` MB of Zipf-distributed pseudo-words, fixed
seed) and the same byte-level BPE tokenizer (trained here on the first MB):
- ours: ``make_job`` + ``run_job(workers=cores)`` on a local Ray of ``cores`` CPUs, timed
  from opening the source to the index (Ray already up, so its start is not counted),
  twice: cold (the first run starts Ray's worker processes, which import this package)
  and warm (a second run on the same Ray, as in a session that prepares again);
- reference: ``datasets.load_dataset("json").map(tokenize, batched=True,
  num_proc=cores)`` with the same tokenizer call and an EOS per document, timed from
  load to the end of map (both write their output to disk);
- scaling: ours (warm) on a ``ray.cluster_utils.Cluster`` of 1, 2, 3 nodes of 1 CPU
  each.  These nodes share this machine's cores, so more nodes than cores cannot go
  faster.

Usage: python jobs/bench/data_prepare.py [--mb 32] [--cores N] [--skip-scaling]
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker on both sides

import numpy as np  # noqa: E402

from raytrain_ext.prepare.pipeline import make_job, run_job  # noqa: E402

EOS = "<|endoftext|>"
SYLLABLES = "ka ri to ne mu sa lo pe di ga vu ho zi be fa qu ly or en at".split()


def generate_jsonl(path: Path, megabytes: float, seed: int = 0) -> int:
    """Documents of 20-400 words drawn from a 20k-word Zipf vocabulary; their count."""
    rng = np.random.default_rng(seed)
    parts = rng.integers(0, len(SYLLABLES), size=(20_000, 3))
    lengths = rng.integers(1, 4, size=20_000)
    vocab = ["".join(SYLLABLES[s] for s in row[:n]) for row, n in zip(parts, lengths, strict=True)]
    target, written, docs = int(megabytes * 2**20), 0, 0
    with open(path, "w") as f:
        while written < target:
            words = np.minimum(rng.zipf(1.3, size=rng.integers(20, 400)), len(vocab)) - 1
            line = json.dumps({"text": " ".join(vocab[w] for w in words)}) + "\n"
            f.write(line)
            written += len(line)
            docs += 1
    return docs


def train_tokenizer(corpus: Path, directory: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = []
    with open(corpus) as f:
        for line in f:
            texts.append(json.loads(line)["text"])
            if sum(map(len, texts)) > 2**20:
                break
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8192, special_tokens=[EOS])
    backend.train_from_iterator(texts, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS)
    tok.save_pretrained(str(directory))
    return directory


def ours(data: Path, tok: Path, out: Path, workers: int, per_shard: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    job = make_job(str(data), str(tok), out, records_per_shard=per_shard)
    done = run_job(job, workers, progress=False)
    seconds = time.perf_counter() - start
    return {"tokens": done.index.tokens, "seconds": seconds, "shards": len(done.index.shards)}


def datasets_map(data: Path, tok_dir: Path, cache: Path, cores: int) -> dict:
    import datasets
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    tok = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    eos = tok.eos_token_id

    def tokenize(batch):
        ids = tok(batch["text"], add_special_tokens=False, return_attention_mask=False)
        return {"input_ids": [x + [eos] for x in ids["input_ids"]]}

    shutil.rmtree(cache, ignore_errors=True)
    start = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=str(data), split="train", cache_dir=str(cache))
    ds = ds.map(tokenize, batched=True, num_proc=cores, remove_columns=["text"])
    seconds = time.perf_counter() - start
    tokens = sum(len(x) for x in ds.with_format("arrow")["input_ids"].to_pylist())
    return {"tokens": tokens, "seconds": seconds}


def scaling(data: Path, tok: Path, work: Path, per_shard: int) -> list:
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False, "node_ip_address": "127.0.0.1"},
    )
    rows = []
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        for nodes in (1, 2, 3):
            cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
            cluster.wait_for_nodes()
            ours(data, tok, work / f"nodes{nodes}", nodes, per_shard)  # warms the new node
            rows.append((nodes, ours(data, tok, work / f"nodes{nodes}", nodes, per_shard)))
    finally:
        ray.shutdown()
        cluster.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=32.0, help="MB of generated JSON lines")
    parser.add_argument("--cores", type=int, default=os.cpu_count(), help="workers on both sides")
    parser.add_argument("--skip-scaling", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-prepare-"))
    try:
        run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args, work: Path) -> None:
    import ray

    data = work / "data.jsonl"
    docs = generate_jsonl(data, args.mb)
    tok = train_tokenizer(data, work / "tok")
    per_shard = max(50, docs // (8 * args.cores))
    print(f"input: {data.stat().st_size / 2**20:.1f} MB, {docs:,} documents, {per_shard} per shard")
    reference = datasets_map(data, tok, work / "hf-cache", args.cores)
    ray.init(address="local", num_cpus=args.cores, include_dashboard=False, log_to_driver=False)
    try:
        cold = ours(data, tok, work / "ours", args.cores, per_shard)
        warm = ours(data, tok, work / "ours", args.cores, per_shard)
    finally:
        ray.shutdown()
    assert cold["tokens"] == reference["tokens"], (cold, reference)
    print(f"tokens: {cold['tokens']:,} (identical count on both sides)")
    hf_rate = reference["tokens"] / reference["seconds"] / args.cores
    print(
        f"datasets.map (num_proc={args.cores}): {reference['seconds']:.2f} s, "
        f"{hf_rate:,.0f} tokens/s/core"
    )
    for name, r in (("cold", cold), ("warm", warm)):
        rate = r["tokens"] / r["seconds"] / args.cores
        print(
            f"ours (Ray Data, {args.cores} workers, {name}): {r['seconds']:.2f} s, "
            f"{rate:,.0f} tokens/s/core, ratio ours / datasets.map {rate / hf_rate:.2f}"
        )
    if args.skip_scaling:
        return
    print(f"scaling (nodes of 1 CPU each, all sharing this machine's {os.cpu_count()} cores):")
    rows = scaling(data, tok, work, per_shard)
    base = rows[0][1]["tokens"] / rows[0][1]["seconds"]
    for nodes, r in rows:
        rate = r["tokens"] / r["seconds"]
        print(f"  {nodes} node(s): {r['seconds']:.2f} s, {rate:,.0f} tokens/s, x{rate / base:.2f}")


if __name__ == "__main__":
    main()
