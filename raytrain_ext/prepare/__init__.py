"""The offline data pipeline: ``raytrain-ext data prepare`` turns text, chat and preference
records into a prepared directory of token shards, in process or as Ray Data tasks.

``pipeline`` (the job: shards, workers, resume), ``cli`` (the command), ``shards`` (one
shard, its resume sidecar, the output directory's claim), ``text_sources`` (JSONL, Parquet,
Arrow or ``datasets`` records, local or on S3), ``render`` (records -> token rows),
``tokenizer`` (load, sha256, EOS) and ``prepared_index`` (``index.json``, the on-disk
contract the training's data reads).  A training run prepares raw records into its cache
through the same pipeline (``data.open``); nothing here imports the training side, and a
prepare worker imports no torch.
"""
