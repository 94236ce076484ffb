"""Regenerate ``configs/data/``: the tiny tokenizer and records the example SFT and DPO
configs train on (``configs/sft_llama_tiny.yaml``, ``configs/dpo_llama_tiny.yaml``).

The text comes from the builtin corpus's grammar (:mod:`raytrain_ext.data.corpus`), the
tokenizer is word-level over that grammar's words, so everything is small, ours, and
deterministic: running this again writes the same bytes.

    python jobs/example_data.py [--out configs/data]
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

from raytrain_ext.data.corpus import _sentence, generate_text

SPECIAL_TOKENS = ["<unk>", "<pad>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
    "{% if m['role'] == 'assistant' %}</s> {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
RECORDS = 256


def write_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = sorted(set(re.findall(r"\w+|[^\w\s]", generate_text(1 << 16).decode())))
    backend = Tokenizer(models.WordLevel(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(vocab_size=1024, special_tokens=SPECIAL_TOKENS)
    backend.train_from_iterator([" ".join(words)], trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(out))


def sft_records(rng: random.Random):
    """Answer a question about a sentence with its first word (learnable within steps)."""
    for _ in range(RECORDS):
        sentence = _sentence(rng)
        yield {"prompt": f"{sentence} first word ?", "response": sentence.split()[0]}


def dpo_records(rng: random.Random):
    """Prefer the sentence ending with '.' over the same sentence ending with '?'."""
    for _ in range(RECORDS):
        sentence = _sentence(rng).rstrip(".!?")
        yield {"prompt": sentence, "chosen": ".", "rejected": "?"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parents[1] / "configs/data")
    out = parser.parse_args().out
    write_tokenizer(out / "tiny-tokenizer")
    for name, records in (("sft_tiny", sft_records), ("dpo_tiny", dpo_records)):
        lines = [json.dumps(r) + "\n" for r in records(random.Random(name))]
        (out / f"{name}.jsonl").write_text("".join(lines))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
