"""The builtin corpus: generated English-like text, byte-level tokens, shipped in the package.

The text comes from a small stochastic grammar (our own words, so no licence
questions and no download at run time).  It has enough structure for a tiny GPT
to show a clearly falling loss within a few dozen steps.  The shipped file
``assets/corpus.arrow`` is the output of ``python -m raytrain_ext.data.corpus``;
regenerating it with the same seed gives the same bytes.
"""

from __future__ import annotations

import argparse
import random
from importlib import resources
from pathlib import Path

import numpy as np
import pyarrow as pa

CORPUS_SEED = 20261130
CORPUS_BYTES = 2 * 1024 * 1024

_SUBJECTS = [
    "the worker",
    "a node",
    "the controller",
    "every rank",
    "the scheduler",
    "our model",
    "the optimizer",
    "a checkpoint",
    "the cluster",
    "the sampler",
    "one replica",
    "the old gardener",
    "a small boat",
    "the river",
    "the village",
    "a quiet student",
]
_VERBS = [
    "saves",
    "restores",
    "trains",
    "waits for",
    "sends",
    "receives",
    "counts",
    "watches",
    "repairs",
    "finds",
    "carries",
    "remembers",
    "measures",
    "follows",
    "builds",
    "reads",
]
_OBJECTS = [
    "the gradients",
    "a shard",
    "the next batch",
    "every sample",
    "the loss",
    "its state",
    "the weights",
    "a message",
    "the morning light",
    "a long letter",
    "the harvest",
    "seven stones",
    "the map",
    "a lantern",
    "the last step",
    "the global order",
]
_ADVERBS = [
    "quickly",
    "again",
    "exactly once",
    "in silence",
    "before dawn",
    "without fear",
    "at every step",
    "with care",
    "in the evening",
    "twice",
    "on time",
    "slowly",
]
_CONNECTIVES = ["and then", "because", "while", "so that", "although", "until", "after"]


def _clause(rng: random.Random) -> str:
    words = [rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)]
    if rng.random() < 0.5:
        words.append(rng.choice(_ADVERBS))
    return " ".join(words)


def _sentence(rng: random.Random) -> str:
    text = _clause(rng)
    if rng.random() < 0.4:
        text += f" {rng.choice(_CONNECTIVES)} {_clause(rng)}"
    return text[0].upper() + text[1:] + rng.choice([".", ".", ".", "!", "?"])


def generate_text(num_bytes: int, seed: int = CORPUS_SEED) -> bytes:
    """Deterministic paragraphs of grammar sentences, exactly ``num_bytes`` long."""
    rng = random.Random(seed)
    chunks, size = [], 0
    while size < num_bytes:
        paragraph = " ".join(_sentence(rng) for _ in range(rng.randint(3, 8))) + "\n\n"
        chunks.append(paragraph)
        size += len(paragraph)
    return "".join(chunks).encode("ascii")[:num_bytes]


def write_token_file(tokens: np.ndarray, path: Path) -> None:
    """Write a ``tokens`` column as an uncompressed Arrow IPC file (memory-mappable)."""
    table = pa.table({"tokens": pa.array(tokens)})
    path.parent.mkdir(parents=True, exist_ok=True)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)


def builtin_corpus_path() -> Path:
    return Path(str(resources.files("raytrain_ext.data").joinpath("assets/corpus.arrow")))


def main() -> None:
    parser = argparse.ArgumentParser(description="Regenerate the builtin corpus.")
    parser.add_argument("--out", type=Path, default=builtin_corpus_path())
    parser.add_argument("--bytes", type=int, default=CORPUS_BYTES)
    args = parser.parse_args()
    tokens = np.frombuffer(generate_text(args.bytes), dtype=np.uint8)
    write_token_file(tokens, args.out)
    print(f"wrote {len(tokens)} tokens to {args.out}")


if __name__ == "__main__":
    main()
