"""Text-data builders for tests: a tiny tokenizer trained here, JSONL files, records.

The tokenizer is a word-level one over :data:`WORDS` (whitespace-separated words map to
single ids, so tests can count tokens by counting words), saved as a Hugging Face
tokenizer directory with ``</s>`` as EOS, ``<pad>`` as pad and, optionally, a chat
template that writes ``<|role|> content`` per message and ``</s>`` after assistant turns.
Record generators are deterministic in ``(n, seed)``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Dict, Iterable, List

WORDS = (
    "the a of to and in is it that was for on are with as be at by this have from or one "
    "had not but what all were when we there can an your which their said if do will each "
    "about how up out them then she many some so these would other into has more her two "
    "like him see time could no make than first been its who now people my made over did "
    "down only way find use may water long little very after words called just where most "
    "know get through back much go good new write our me man too any day same right look "
    "think also around another came come work three word must because does part even place "
    "well such here take why things help put years different away again off went old number "
    "yes cat dog sun moon tree river stone cloud"
).split()
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = ("<unk>", "<pad>", "</s>", *ROLE_TOKENS)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
    "{% if m['role'] == 'assistant' %}</s> {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
CHOSEN_WORD, REJECTED_WORD = "yes", "no"


def build_tokenizer(directory: Path, with_chat_template: bool) -> Path:
    """Train a word-level tokenizer over WORDS and save it as a HF tokenizer directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(vocab_size=512, special_tokens=list(SPECIAL_TOKENS))
    backend.train_from_iterator([" ".join(WORDS)] * 2, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    if with_chat_template:
        tok.chat_template = CHAT_TEMPLATE
    directory = Path(directory)
    tok.save_pretrained(str(directory))
    return directory


def write_jsonl(path: Path, records: Iterable[Dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _sentence(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def text_records(n: int, seed: int = 0, column: str = "text") -> List[Dict]:
    rng = random.Random(seed)
    return [{column: _sentence(rng, 3, 40)} for _ in range(n)]


def prompt_response_records(n: int, seed: int = 0) -> List[Dict]:
    rng = random.Random(seed)
    return [{"prompt": _sentence(rng, 2, 12), "response": _sentence(rng, 1, 10)} for _ in range(n)]


def messages_records(n: int, seed: int = 0) -> List[Dict]:
    """Conversations of a system message then one or two user/assistant exchanges."""
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        messages = [{"role": "system", "content": _sentence(rng, 1, 4)}]
        for _ in range(rng.randint(1, 2)):
            messages.append({"role": "user", "content": _sentence(rng, 2, 8)})
            messages.append({"role": "assistant", "content": _sentence(rng, 1, 6)})
        records.append({"messages": messages})
    return records


def preference_records(n: int, seed: int = 0) -> List[Dict]:
    """A learnable preference: the chosen response repeats CHOSEN_WORD, the rejected one
    REJECTED_WORD, as many times as the prompt has words modulo 3, plus one."""
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        prompt = _sentence(rng, 2, 10)
        times = len(prompt.split()) % 3 + 1
        records.append(
            {
                "prompt": prompt,
                "chosen": " ".join([CHOSEN_WORD] * times),
                "rejected": " ".join([REJECTED_WORD] * times),
            }
        )
    return records
