"""``data prepare``: the same bytes with any number of Ray workers, resumed after a kill,
refusals of a directory it must not write into, and the CLI's error for a bad column.

One module-scoped reference preparation (in this process, no Ray) is what every other
preparation of the same input must equal, file by file.
"""

import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from raytrain_ext.data.tokens import open_token_dataset
from raytrain_ext.errors import InputError
from raytrain_ext.prepare.pipeline import run_preparation
from raytrain_ext.prepare.prepared_index import read_index
from tests.helpers.cli import RaySessionWatch, clean_env, raytrain_ext_cmd, run
from tests.helpers.text_data import build_tokenizer, messages_records, text_records, write_jsonl

os.environ.setdefault("HF_HUB_OFFLINE", "1")
RECORDS, PER_SHARD = 600, 50  # 12 shards
KILL_RECORDS, KILL_PER_SHARD = 3000, 20  # 150 small shards: a kill lands early on


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("prepare")
    tok = build_tokenizer(root / "tok", with_chat_template=True)
    text = write_jsonl(root / "text.jsonl", text_records(RECORDS, seed=4))
    chat = write_jsonl(root / "chat.jsonl", messages_records(90, seed=5))
    reference = run_preparation(
        str(text), str(tok), root / "reference", records_per_shard=PER_SHARD, workers=0
    )
    return {"root": root, "tok": tok, "text": text, "chat": chat, "reference": reference}


def files_of(directory: Path):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_one_and_three_ray_workers_write_the_reference_bytes(inputs, tmp_path, ray_local):
    root, tok = inputs["root"], str(inputs["tok"])
    expected = files_of(root / "reference")
    assert len([n for n in expected if n.endswith(".arrow")]) == RECORDS // PER_SHARD
    for workers in (1, 3):
        out = tmp_path / f"w{workers}"
        done = run_preparation(
            str(inputs["text"]), tok, out, records_per_shard=PER_SHARD, workers=workers
        )
        assert done.written == list(range(12)) and done.reused == []
        assert files_of(out) == expected, f"{workers} workers"
    index = read_index(root / "reference")
    shard = pa.ipc.open_file(
        pa.memory_map(str(root / "reference" / "shard-00003.arrow"))
    ).read_all()
    assert shard.schema == pa.schema([("tokens", pa.int32())])
    assert [s.records for s in index.shards] == [PER_SHARD] * 12
    assert index.tokens == sum(len(r["text"].split()) + 1 for r in text_records(RECORDS, seed=4))
    stream = open_token_dataset(str(root / "reference"), seq_len=8).tokens
    assert np.count_nonzero(stream == index.tokenizer.eos_id) == RECORDS


def test_chat_shards_are_the_same_with_ray_workers(inputs, tmp_path, ray_local):
    tok, chat = str(inputs["tok"]), str(inputs["chat"])
    here = run_preparation(chat, tok, tmp_path / "here", "chat", records_per_shard=20, workers=0)
    run_preparation(chat, tok, tmp_path / "ray", "chat", records_per_shard=20, workers=2)
    assert files_of(tmp_path / "ray") == files_of(tmp_path / "here")
    assert here.index.records == 90 and len(here.index.shards) == 5
    rows = pa.ipc.open_file(pa.memory_map(str(tmp_path / "here" / "shard-00000.arrow")))
    assert rows.read_all().column_names == ["tokens", "loss_mask"]


def test_bad_record_found_by_a_ray_worker_is_the_input_error_itself(inputs, tmp_path, ray_local):
    records = text_records(60, seed=7)
    records[47] = {"text": ["not", "text"]}
    data = write_jsonl(tmp_path / "bad.jsonl", records)
    with pytest.raises(InputError) as bad:
        run_preparation(
            str(data), str(inputs["tok"]), tmp_path / "out", records_per_shard=10, workers=2
        )
    assert str(bad.value) == (
        f"data.text_column (--text-column): {data} record 47 holds list ['not', 'text'], not "
        "text. Clean the data or set data.text_column to the column of documents."
    )
    assert not (tmp_path / "out" / "index.json").exists()


def test_a_killed_prepare_resumes_without_redoing_finished_shards(inputs, tmp_path, ray_local):
    tok = str(inputs["tok"])
    data = write_jsonl(tmp_path / "big.jsonl", text_records(KILL_RECORDS, seed=6))
    out = tmp_path / "out"
    cmd = [
        *raytrain_ext_cmd(), "data", "prepare", str(data), "--tokenizer", tok, "--out", str(out),
        "--records-per-shard", str(KILL_PER_SHARD),
    ]  # fmt: skip
    log = tmp_path / "killed.log"
    with open(log, "w") as stderr:
        proc = subprocess.Popen(cmd, env=clean_env(), stdout=subprocess.DEVNULL, stderr=stderr)
    deadline = time.monotonic() + 120
    while len(list(out.glob("shard-*.json"))) < 3 and proc.poll() is None:
        if time.monotonic() > deadline:
            break
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, log.read_text()
    assert not (out / "index.json").exists(), "the run ended before it was killed"
    finished = sorted(int(p.stem[len("shard-") :]) for p in out.glob("shard-*.json"))
    total = KILL_RECORDS // KILL_PER_SHARD
    assert 3 <= len(finished) < total
    before = {k: _identity(out / f"shard-{k:05d}.arrow") for k in finished}

    done = run_preparation(
        str(data), tok, out, records_per_shard=KILL_PER_SHARD, workers=2, progress=False
    )
    assert done.reused == finished
    assert done.written == [k for k in range(total) if k not in finished]
    assert {k: _identity(out / f"shard-{k:05d}.arrow") for k in finished} == before
    reference = run_preparation(
        str(data), tok, tmp_path / "whole", records_per_shard=KILL_PER_SHARD, workers=0
    )
    assert files_of(out) == files_of(tmp_path / "whole")
    index_file = _identity(out / "index.json")
    again = run_preparation(str(data), tok, out, records_per_shard=KILL_PER_SHARD)
    assert (again.written, again.index) == ([], reference.index)
    assert _identity(out / "index.json") == index_file  # returned as is, not rewritten


def _identity(path: Path):
    stat = path.stat()
    return stat.st_ino, stat.st_mtime_ns


def test_a_directory_of_other_files_or_another_preparation_is_refused(inputs, tmp_path):
    tok, text = str(inputs["tok"]), str(inputs["text"])
    reference = files_of(inputs["root"] / "reference")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(InputError, match=r"--out: .*mine already holds files that are not prep"):
        run_preparation(text, tok, mine, records_per_shard=PER_SHARD)
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    with pytest.raises(InputError, match=r"holds another preparation \(shard-00000\.json: record "):
        run_preparation(text, tok, inputs["root"] / "reference", records_per_shard=PER_SHARD + 1)
    with pytest.raises(InputError, match=r"holds another preparation .*format text there, chat"):
        run_preparation(str(inputs["chat"]), tok, inputs["root"] / "reference", "chat")
    assert files_of(inputs["root"] / "reference") == reference


def test_cli_missing_text_column_is_one_clean_error_before_ray(inputs, tmp_path):
    watch = RaySessionWatch()
    cmd = [
        *raytrain_ext_cmd(), "data", "prepare", str(inputs["text"]), "--tokenizer",
        str(inputs["tok"]), "--out", str(tmp_path / "out"), "--text-column", "body",
        "--workers", "2",
    ]  # fmt: skip
    result = run(cmd, cwd=tmp_path, env=watch.env(), timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: data.text_column (--text-column): {inputs['text']} has no 'body' column "
        "(columns: text). Set data.text_column (--text-column) to the column that holds the "
        "documents."
    )
    assert "Traceback" not in result.stderr
    assert watch.sessions() == [] and not (tmp_path / "out").exists()
