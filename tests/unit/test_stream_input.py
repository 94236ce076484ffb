"""A streamed dataset without Ray: records packed as ``data prepare`` packs them, and the
reader's order, fingerprint, re-reads and memory bound (the actor around it is
tests/cluster/test_stream_cluster.py and tests/ray/test_hf_elastic.py)."""

import os

import numpy as np
import pyarrow as pa
import pytest

from raytrain_ext.data.config import DataFormat
from raytrain_ext.data.open import open_prepared
from raytrain_ext.data.stream_reader import GENESIS, StreamReader, check_position
from raytrain_ext.data.stream_samples import SamplePacker, Tokenizing
from raytrain_ext.errors import InputError
from raytrain_ext.prepare.pipeline import prepare_dataset
from raytrain_ext.prepare.tokenizer import load_tokenizer, tokenizer_info
from tests.helpers.text_data import (
    build_tokenizer,
    messages_records,
    preference_records,
    prompt_response_records,
    text_records,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
SEQ = 16


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    return {
        "plain": str(build_tokenizer(root / "plain", with_chat_template=False)),
        "chat": str(build_tokenizer(root / "chat", with_chat_template=True)),
    }


def tokenizing(spec):
    tok = load_tokenizer(spec)
    info = tokenizer_info(tok, spec)
    return Tokenizing(tok, info.eos_id, info.pad_id)


def streamed(packer, table, cuts):
    """Every sample of one epoch, the table fed in pieces cut at ``cuts``."""
    samples, start = [], 0
    for stop in [*cuts, table.num_rows]:
        samples += packer.add(table.slice(start, stop - start))
        start = stop
    return samples + packer.end_epoch()


CASES = {
    "text": (text_records, "plain", DataFormat.text),
    "chat-messages": (messages_records, "chat", DataFormat.chat),
    "chat-prompt-response": (prompt_response_records, "plain", DataFormat.chat),
    "preference": (preference_records, "chat", DataFormat.preference),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_streamed_records_are_the_samples_of_their_prepared_directory(case, tokenizers, tmp_path):
    make, tok, fmt = CASES[case]
    table = pa.Table.from_pylist(make(60, seed=3))
    prepare_dataset(table, tokenizers[tok], tmp_path / "prep", str(fmt), records_per_shard=17)
    prepared = open_prepared(tmp_path / "prep", SEQ)
    packer = SamplePacker(fmt, SEQ, tokenizing(tokenizers[tok]))
    samples = streamed(packer, table, cuts=[1, 9, 30, 31])
    assert len(samples) == prepared.num_samples
    everything = np.arange(prepared.num_samples)
    batch = prepared.batch(everything)
    rows = np.stack([s.rows for s in samples])
    if fmt == DataFormat.preference:
        tokens = np.concatenate([rows[:, 0], rows[:, 1]])
    else:
        tokens = rows[:, 0]
    assert np.array_equal(tokens[:, :-1], batch.inputs.numpy())
    assert np.array_equal(tokens[:, 1:], batch.targets.numpy())
    if batch.weights is not None:
        masks = np.stack([s.mask for s in samples])
        flat = np.concatenate([masks[:, 0], masks[:, 1]]) if rows.shape[1] == 2 else masks[:, 0]
        assert np.array_equal(flat[:, 1:], batch.weights.numpy())
    weights = [s.weight for s in samples]
    assert np.array_equal(weights, prepared.target_weights(everything))


def test_token_lists_are_cut_into_the_windows_of_the_flat_token_stream():
    tokens = np.arange(1000) % 97
    table = pa.table({"tokens": [c.tolist() for c in np.array_split(tokens, 13)]})
    samples = streamed(SamplePacker(DataFormat.tokens, SEQ), table, cuts=[2, 3, 7])
    assert len(samples) == (len(tokens) - 1) // SEQ
    for i, sample in enumerate(samples):
        assert np.array_equal(sample.rows[0], tokens[i * SEQ : i * SEQ + SEQ + 1])
        assert sample.weight == SEQ


def test_records_without_a_tokenizer_or_the_format_s_columns_are_refused(tokenizers):
    with pytest.raises(InputError, match="data.tokenizer"):
        SamplePacker(DataFormat.text, SEQ)
    packer = SamplePacker(DataFormat.chat, SEQ, tokenizing(tokenizers["plain"]))
    with pytest.raises(InputError, match="neither a 'messages' column"):
        packer.add(pa.table({"text": ["a b"]}))
    with pytest.raises(InputError, match="'tokens' column"):
        SamplePacker(DataFormat.tokens, SEQ).add(pa.table({"ids": [[1, 2]]}))


def token_reader(tokens, batch_rows=7, **options):
    """A reader over ``tokens`` (split into 40 records), fed ``batch_rows`` records at a time;
    ``reads`` counts the executions of the source."""
    records = [c.tolist() for c in np.array_split(tokens, 40)]
    reads = []

    def epoch_batches(epoch):
        reads.append(epoch)
        for i in range(0, len(records), batch_rows):
            yield pa.table({"tokens": records[i : i + batch_rows]})

    options = {"global_batch_size": 4, "vocab_size": 512, **options}
    reader = StreamReader(epoch_batches, lambda: SamplePacker(DataFormat.tokens, SEQ), **options)
    return reader, reads


TOKENS = np.random.default_rng(0).integers(0, 500, 2000)  # 124 samples of 16: 31 steps


def test_steps_cross_epochs_in_order_and_each_epoch_holds_every_sample_once():
    reader, reads = token_reader(TOKENS)
    steps = [reader.take(s)[0] for s in range(40)]
    windows = [tuple(r[0]) for step in steps for r in step.rows]
    per_epoch = (len(TOKENS) - 1) // SEQ
    assert len(set(windows[:per_epoch])) == per_epoch
    assert windows[per_epoch:] == windows[: len(windows) - per_epoch]  # no shuffle: same order
    assert [s.epoch for s in steps][30:32] == [0, 1] and reads == [0, 1]
    assert reader.held_steps() == [38, 39]  # the newest and one behind: bounded
    ahead = reader.take(40, 4)  # a rank's fetch of 4 steps at once
    parts = [reader.take(40, 1, (rank, 3))[0] for rank in range(3)]  # 4 samples over 3 ranks
    assert [p.first for p in parts] == [0, 2, 3] and [len(p.rows) for p in parts] == [2, 1, 1]
    assert np.array_equal(np.concatenate([p.rows for p in parts]), ahead[0].rows)
    assert all(np.array_equal(p.weights, ahead[0].weights) for p in parts)
    assert [s.step for s in ahead] == [40, 41, 42, 43] and reader.held_steps() == list(
        range(39, 44)
    )


def test_shuffle_window_is_seeded_per_epoch_and_keeps_every_sample_once():
    reader, _ = token_reader(TOKENS, seed=5, shuffle_window=16)
    again, _ = token_reader(TOKENS, seed=5, shuffle_window=16, batch_rows=3)
    first = [tuple(r[0]) for s in range(31) for r in reader.take(s)[0].rows]
    assert first == [tuple(r[0]) for s in range(31) for r in again.take(s)[0].rows]
    in_order, _ = token_reader(TOKENS)
    plain = [tuple(r[0]) for s in range(31) for r in in_order.take(s)[0].rows]
    assert first != plain and sorted(first) == sorted(plain)
    second_epoch = [tuple(r[0]) for s in range(31, 62) for r in reader.take(s)[0].rows]
    assert second_epoch != first and sorted(second_epoch) == sorted(plain)


def test_a_step_before_the_held_ones_is_read_again_from_the_start_with_the_same_digests():
    reader, reads = token_reader(TOKENS, shuffle_window=8)
    digests = {s: reader.take(s)[0].digest for s in range(12)}
    assert reader.take(3)[0].digest == digests[3] and reader.stats.rereads == 1
    assert reads == [0, 0]
    fresh, _ = token_reader(TOKENS, shuffle_window=8)  # a restarted reader: from nothing
    step = fresh.take(9)[0]
    assert step.digest_before == digests[8] and fresh.stats.skipped_steps == 8
    check_position(step, digests[8])
    assert reader.take(0)[0].digest_before == GENESIS


def test_a_dataset_whose_rows_changed_is_refused_at_the_position():
    reader, _ = token_reader(TOKENS)
    before = reader.take(4)[0].digest_before
    changed, _ = token_reader(np.concatenate([TOKENS[:100], TOKENS[101:], TOKENS[:1]]))
    with pytest.raises(InputError, match="must be deterministic"):
        check_position(changed.take(4)[0], before)


def test_token_ids_beyond_the_vocabulary_and_an_empty_dataset_are_refused():
    reader, _ = token_reader(TOKENS, vocab_size=100)
    with pytest.raises(InputError, match="model.vocab_size is 100"):
        reader.take(0)
    empty = StreamReader(
        lambda epoch: iter([pa.table({"tokens": [[1, 2]]})]),
        lambda: SamplePacker(DataFormat.tokens, SEQ),
        4,
        512,
    )
    with pytest.raises(InputError, match="no complete sample"):
        empty.take(0)


def test_auto_streams_unless_the_run_needs_every_sample_up_front():
    from raytrain_ext import load_config
    from raytrain_ext.data.stream_input import streams
    from raytrain_ext.errors import ConfigError

    assert streams(load_config(None, []))
    assert not streams(load_config(None, ["data.ray_dataset=materialise"]))
    dpo = ["objective.name=dpo", "data.format=preference"]
    assert not streams(load_config(None, dpo))
    with pytest.raises(ConfigError, match="data.ray_dataset=stream: objective.name=dpo"):
        streams(load_config(None, [*dpo, "data.ray_dataset=stream"]))
    with pytest.raises(ConfigError, match="eval.fraction"):
        streams(load_config(None, ["eval.fraction=0.1", "data.ray_dataset=stream"]))


def test_an_error_of_the_dataset_is_raised_again_to_every_later_ask():
    reader, _ = token_reader(TOKENS, vocab_size=100)
    for _ in range(2):
        with pytest.raises(InputError, match="model.vocab_size is 100"):
            reader.take(0)


def test_fewer_samples_than_a_global_batch_are_refused_unless_repeats_are_allowed():
    few = TOKENS[: 3 * SEQ + 1]  # 3 samples, global batch 4
    with pytest.raises(InputError, match="data.allow_repeat=true"):
        token_reader(few)[0].take(0)
    step = token_reader(few, allow_repeat=True)[0].take(0)[0]
    assert len(step.rows) == 4 and np.array_equal(step.rows[3], step.rows[0])


def test_a_reader_that_cannot_start_raises_its_input_error_to_every_ask(tmp_path):
    from raytrain_ext.data.stream_input import StreamReaderActor, StreamSpec

    spec = StreamSpec(
        "text", SEQ, 4, 512, 0, 0, str(tmp_path / "no-tokenizer"), None, "text", False, False
    )
    reader = StreamReaderActor(None, spec)
    for _ in range(2):
        with pytest.raises(InputError, match="stream reader cannot start|data.tokenizer"):
            reader.take(0)


def test_auto_keeps_materialising_a_run_that_was_materialised_before(tmp_path):
    from raytrain_ext import load_config
    from raytrain_ext.data.ray_input import CURRENT, VIEW_DIR
    from raytrain_ext.data.stream_input import streams

    cfg = load_config(None, [f"run.output_dir={tmp_path}", "run.name=old"])
    assert streams(cfg)
    (tmp_path / "old" / VIEW_DIR).mkdir(parents=True)
    (tmp_path / "old" / VIEW_DIR / CURRENT).write_text("0" * 64 + "\n")
    assert not streams(cfg)  # its checkpoints index the materialised view
    assert streams(load_config(None, [f"run.output_dir={tmp_path}", "run.name=new"]))
