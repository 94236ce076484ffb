"""Token files: the shipped corpus, local Arrow/Parquet, s3:// through a real S3 server."""

import io

import boto3
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytrain_ext.data import open_token_dataset
from raytrain_ext.data.corpus import CORPUS_BYTES, builtin_corpus_path, generate_text


def test_builtin_corpus_is_shipped_and_reproducible():
    ds = open_token_dataset("builtin:corpus", seq_len=128)
    assert len(ds.tokens) == CORPUS_BYTES and ds.max_token() < 128  # ASCII text
    assert ds.num_samples == (CORPUS_BYTES - 1) // 128
    regenerated = np.frombuffer(generate_text(4096), dtype=np.uint8)
    assert np.array_equal(ds.tokens[:4096], regenerated)
    assert builtin_corpus_path().stat().st_size < 3 * 1024 * 1024


def test_samples_are_shifted_windows():
    tokens = np.arange(1000, dtype=np.int32)
    from raytrain_ext.data import TokenDataset

    ds = TokenDataset(tokens, seq_len=10)
    batch = ds.batch(np.array([3, 0]))
    inputs, targets = batch.inputs, batch.targets
    assert batch.weights is None and batch.indices.tolist() == [3, 0]
    assert inputs.shape == targets.shape == (2, 10)
    assert inputs[0].tolist() == list(range(30, 40)) and targets[0].tolist() == list(range(31, 41))


def test_local_parquet_directory_and_arrow_file(tmp_path):
    for i in range(2):
        pq.write_table(
            pa.table({"tokens": pa.array(np.arange(600) + i * 600, pa.uint16())}),
            tmp_path / f"part-{i}.parquet",
        )
    ds = open_token_dataset(str(tmp_path), seq_len=100)
    assert len(ds.tokens) == 1200 and ds.tokens[600] == 600 and ds.num_samples == 11
    from raytrain_ext.data.corpus import write_token_file

    write_token_file(np.arange(300, dtype=np.uint16), tmp_path / "one.arrow")
    assert open_token_dataset(str(tmp_path / "one.arrow"), seq_len=100).num_samples == 2


def test_bad_token_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data\.path: .*nope does not exist"):
        open_token_dataset(str(tmp_path / "nope"), seq_len=8)
    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "t.parquet")
    with pytest.raises(ValueError, match=r"t\.parquet has no 'tokens' column"):
        open_token_dataset(str(tmp_path / "t.parquet"), seq_len=8)
    pq.write_table(pa.table({"tokens": pa.array([1, 2, 3])}), tmp_path / "short.parquet")
    with pytest.raises(ValueError, match=r"fewer than one sample"):
        open_token_dataset(str(tmp_path / "short.parquet"), seq_len=8)


def test_s3_prefix_through_a_real_s3_server(s3_endpoint):
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    s3.create_bucket(Bucket="tokens-test")
    for i in range(2):
        buf = io.BytesIO()
        pq.write_table(pa.table({"tokens": pa.array(np.full(500, i), pa.uint16())}), buf)
        s3.put_object(Bucket="tokens-test", Key=f"ds/part-{i}.parquet", Body=buf.getvalue())
    ds = open_token_dataset(
        "s3://tokens-test/ds/", seq_len=99, s3_endpoint_url=s3_endpoint, s3_region="us-east-1"
    )
    assert len(ds.tokens) == 1000 and ds.tokens[0] == 0 and ds.tokens[999] == 1
    with pytest.raises(FileNotFoundError, match=r"s3://tokens-test/missing/ does not exist"):
        open_token_dataset("s3://tokens-test/missing/", seq_len=8, s3_endpoint_url=s3_endpoint)
