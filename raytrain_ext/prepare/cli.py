"""``raytrain-ext data prepare``: tokenize the user's records into a prepared directory.

Exit status: 0 when the directory is complete, 2 on invalid input (the message names the
flag and the fix; nothing is written before the input is checked).
"""

from __future__ import annotations

import argparse
import sys

from raytrain_ext.prepare.pipeline import (
    DEFAULT_RECORDS_PER_SHARD,
    check_workers,
    make_job,
    run_job,
)
from raytrain_ext.prepare.text_sources import FORMATS


def add_parser(commands) -> None:
    data = commands.add_parser("data", help="prepare training data")
    data_commands = data.add_subparsers(dest="data_command", required=True)
    p = data_commands.add_parser(
        "prepare",
        help="tokenize JSONL/Parquet/Arrow/datasets records into shards training reads",
    )
    p.add_argument(
        "source",
        metavar="SRC",
        help="a .jsonl/.json/.parquet/.arrow file, a directory of them, a datasets "
        "save_to_disk directory, or an s3:// URI of any of these",
    )
    p.add_argument(
        "--tokenizer", required=True, help="a Hugging Face tokenizer directory or tokenizer.json"
    )
    p.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="output directory (with --workers on several machines: a path every node shares)",
    )
    p.add_argument("--format", default="text", choices=FORMATS, help="default: text")
    p.add_argument(
        "--eos-token",
        default=None,
        help="the end-of-text token, when the tokenizer names none (a bare tokenizer.json)",
    )
    p.add_argument("--text-column", default="text", help="--format text: the documents' column")
    p.add_argument(
        "--records-per-shard",
        type=int,
        default=DEFAULT_RECORDS_PER_SHARD,
        help=f"source records per shard file (default {DEFAULT_RECORDS_PER_SHARD})",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="Ray Data workers, one CPU each (default 0: this process, no Ray)",
    )
    p.add_argument(
        "--address",
        default=None,
        help="--workers: the Ray cluster to join (default: RAY_ADDRESS, else a private local Ray)",
    )
    p.add_argument("--s3-endpoint-url", default=None)
    p.add_argument("--s3-region", default=None)
    p.set_defaults(func=_prepare)


def _prepare(args: argparse.Namespace) -> int:
    from raytrain_ext.errors import InputError

    started_ray = False
    try:
        job = make_job(
            args.source,
            args.tokenizer,
            args.out,
            args.format,
            text_column=args.text_column,
            records_per_shard=args.records_per_shard,
            s3_endpoint_url=args.s3_endpoint_url,
            s3_region=args.s3_region,
            eos_token=args.eos_token,
        )
        check_workers(args.workers)
        if args.workers:
            from raytrain_ext.ray_session import connect_ray

            started_ray = connect_ray(args.address)
        done = run_job(job, args.workers)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if started_ray:
            from raytrain_ext.ray_session import stop_private_ray

            stop_private_ray()
    index = done.index
    written_tokens = sum(index.shards[k].tokens for k in done.written)
    rate = written_tokens / done.seconds if written_tokens and done.seconds > 0 else 0.0
    print(
        f"prepared {index.records:,} records, {index.tokens:,} tokens ({index.format}) in "
        f"{len(index.shards)} shards -> {args.out}: wrote {len(done.written)}, reused "
        f"{len(done.reused)} ({done.seconds:.1f} s{f', {rate:,.0f} tokens/s' if rate else ''})"
    )
    return 0
