"""The user's tokenizer: loaded from local files only, identified by what it does.

``data.tokenizer`` (``--tokenizer``) names a Hugging Face tokenizer directory, a
``tokenizer.json`` file, or a model id already in the local Hugging Face cache; nothing
is downloaded.  :func:`tokenizer_info` records the ids a prepared dataset depends on and
a sha256 of the tokenizer's behaviour: the backend's canonical JSON (normalizer,
pre-tokenizer, model, added tokens, post-processor; not its truncation or padding
settings, which tokenizing calls change), the chat template and the EOS/pad tokens.  The
same tokenizer gives the same sha256 whatever directory it was loaded from, so a training
run can refuse data prepared with another one.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Dict, List, Optional

from raytrain_ext.errors import InputError
from raytrain_ext.prepare.prepared_index import TokenizerInfo

TOKENIZER_KEY = "data.tokenizer (--tokenizer)"
EOS_KEY = "data.eos_token (--eos-token)"
EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<eos>")
BEHAVIOUR_FREE_KEYS = ("truncation", "padding")


def load_tokenizer(spec: str, eos_token: Optional[str] = None):
    """A ``transformers`` tokenizer from a directory, a ``tokenizer.json`` or a cached id;
    ``eos_token`` (``data.eos_token``) becomes its EOS token, which must be in its vocab."""
    tok = _load(spec)
    if eos_token is not None:
        if eos_token not in tok.get_vocab():
            raise InputError(
                f"{EOS_KEY}: {eos_token!r} is not a token of the tokenizer {spec}. Give one "
                "of its tokens (its special tokens: "
                f"{', '.join(tok.all_special_tokens) or 'none'})."
            )
        tok.eos_token = eos_token
    return tok


def _load(spec: str):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(spec).expanduser()
    if not path.exists() and spec.startswith(("/", ".", "~")):
        raise InputError(
            f"{TOKENIZER_KEY}: {spec} does not exist. Give a Hugging Face tokenizer directory "
            "(tokenizer.json, tokenizer_config.json) or a tokenizer.json file."
        )
    try:
        if path.is_file():
            if path.suffix != ".json":
                raise InputError(
                    f"{TOKENIZER_KEY}: {spec} is a file but not a tokenizer.json. Give a "
                    "Hugging Face tokenizer directory or its tokenizer.json file."
                )
            return PreTrainedTokenizerFast(tokenizer_file=str(path))
        if path.is_dir():
            return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        return AutoTokenizer.from_pretrained(spec, local_files_only=True)
    except InputError:
        raise
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises bare Exception
        where = "directory" if path.is_dir() else "file" if path.is_file() else "model id"
        raise InputError(
            f"{TOKENIZER_KEY}: cannot load a tokenizer from {where} {spec!r} "
            f"({_first_line(e)}). Give a local directory holding tokenizer.json or "
            "tokenizer_config.json (as written by tokenizer.save_pretrained), a "
            "tokenizer.json file, or the id of a model already downloaded (nothing is "
            "downloaded here)."
        ) from None


def tokenizer_info(tok, source: str) -> TokenizerInfo:
    """The ids and behaviour hash that a prepared dataset records about ``tok``."""
    eos_id = eos_token_id(tok, source)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else eos_id
    return TokenizerInfo(
        sha256=tokenizer_sha256(tok),
        eos_id=int(eos_id),
        pad_id=int(pad_id),
        vocab_size=len(tok),
        source=source,
    )


def eos_token_id(tok, source: str) -> int:
    """The tokenizer's EOS id, else the id of a conventional end-of-text token in its vocab."""
    if tok.eos_token_id is not None:
        return int(tok.eos_token_id)
    vocab = tok.get_vocab()
    for token in EOS_CANDIDATES:
        if token in vocab:
            return int(vocab[token])
    raise InputError(
        f"{TOKENIZER_KEY}: the tokenizer {source} has no EOS token and none of "
        f"{', '.join(EOS_CANDIDATES)} in its vocabulary; documents need an end-of-text id. "
        "Name its end-of-text token with data.eos_token=<token> (data prepare: "
        "--eos-token <token>). Set eos_token in a tokenizer directory's tokenizer_config.json "
        "for the same effect."
    )


def tokenizer_sha256(tok) -> str:
    """sha256 of what decides the ids: the backend's canonical JSON, the chat template and
    the EOS/pad tokens."""
    described: Dict[str, Any] = {
        "backend": _backend_description(tok),
        "chat_template": tok.chat_template,
        "eos_token": tok.eos_token,
        "pad_token": tok.pad_token,
    }
    canonical = json.dumps(described, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _backend_description(tok) -> Dict[str, Any]:
    if tok.is_fast:
        backend = json.loads(tok.backend_tokenizer.to_str())
        return {k: v for k, v in backend.items() if k not in BEHAVIOUR_FREE_KEYS}
    return {
        "class": type(tok).__name__,
        "vocab": sorted(tok.get_vocab().items()),
        "special_tokens": tok.special_tokens_map,
    }


def encode_documents(tok, texts: List[str]) -> List[List[int]]:
    """Each text's ids without special tokens: the ids of ``tok(texts,
    add_special_tokens=False)["input_ids"]``.

    A fast tokenizer's Rust backend is called directly, set up as that call sets it (no
    truncation, no padding, the tokenizer's ``split_special_tokens``), with
    ``encode_batch_fast``: it skips the character offsets, which packing never reads,
    and the per-document dictionaries the ``transformers`` call builds around each
    encoding.  A slow tokenizer takes the ``transformers`` call itself."""
    if not tok.is_fast:
        return tok(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    backend = tok.backend_tokenizer
    if backend.truncation is not None:
        backend.no_truncation()
    if backend.padding is not None:
        backend.no_padding()
    if backend.encode_special_tokens != tok.split_special_tokens:
        backend.encode_special_tokens = tok.split_special_tokens
    return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]


def has_chat_template(tok) -> bool:
    return bool(tok.chat_template)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
