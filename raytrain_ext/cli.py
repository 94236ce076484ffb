"""The ``raytrain-ext`` command line: ``raytrain-ext train [CONFIG.yaml] [key=value ...]``."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import List, Optional

DESCRIPTION = (
    "Elastic distributed training on Ray. Start with `raytrain-ext train` (a tiny GPT on CPU, "
    "about a minute); `raytrain-ext COMMAND --help` for each command."
)


def _train(args: argparse.Namespace) -> int:
    from raytrain_ext.checkpoint.save_failure import failed_save_alarms
    from raytrain_ext.checkpoint.tiers.base import TierError
    from raytrain_ext.config import ConfigError, load_config
    from raytrain_ext.elastic.controller import TrainingFailed
    from raytrain_ext.run_dir import RunAlreadyFinished
    from raytrain_ext.trainer import Trainer

    config_path, overrides = split_config_and_overrides(args.config, args.items)
    try:
        cfg = load_config(config_path, overrides)
        trainer = Trainer(cfg)
        with _ctrl_c_interrupts(trainer):
            summary = trainer.fit()
    except RunAlreadyFinished as e:  # a rerun of a finished run: nothing to do, not a failure
        print(str(e), file=sys.stderr)
        return 0
    except ConfigError as e:  # InputError too: found before anything started
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TierError as e:
        print(f"checkpoint storage error: {e}", file=sys.stderr)
        return 2
    except TrainingFailed as e:
        log_path = _newest_error_log(trainer.run_dir)
        print(
            f"{e}\nfull error: {log_path} (this attempt's records: {log_path.parent})"
            if log_path
            else str(e),
            file=sys.stderr,
        )
        return 1
    if summary["status"] == "interrupted":
        print(summary["transitions"][-1]["reason"], file=sys.stderr)
        return 130
    if summary["status"] == "preempted":
        print(
            f"preempted: emergency checkpoint at step {summary['steps_completed']} committed; "
            "rerun the same command to resume",
            file=sys.stderr,
        )
        return 3
    shown = {
        k: v
        for k, v in summary.items()
        if k not in ("loss_history", "step_times", "step_end_times", "transitions")
    }
    if trainer.summary_path.parent == trainer.run_dir:
        print(f"run summary ({trainer.summary_path}):")
    else:
        print(
            f"attempt {summary['attempt']} summary ({trainer.summary_path}; it trained no step, "
            f"so the run's {trainer.run_dir / 'summary.json'} keeps the earlier attempt's):"
        )
    print(json.dumps(shown, indent=2))
    for alarm in failed_save_alarms(summary["checkpoint"]):
        print(alarm, file=sys.stderr)
    return 0


@contextlib.contextmanager
def _ctrl_c_interrupts(trainer):
    """The first Ctrl-C asks for a checkpoint at the next step boundary and a clean end
    (``Trainer.interrupt``); a second one stops at once (KeyboardInterrupt)."""

    def first(signum, frame):
        signal.signal(signal.SIGINT, signal.default_int_handler)
        print(
            "interrupting: every rank checkpoints at the next step boundary, then the run "
            "ends (Ctrl-C again to stop at once, losing the steps since the last checkpoint)",
            file=sys.stderr,
        )
        trainer.interrupt("Ctrl-C")

    previous = signal.signal(signal.SIGINT, first)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _newest_error_log(run_dir: Path) -> Optional[Path]:
    from raytrain_ext.run_dir import ATTEMPTS, ERROR_LOG

    logs = [p for p in (run_dir / ATTEMPTS).glob(f"*/{ERROR_LOG}") if p.parent.name.isdigit()]
    return max(logs, key=lambda p: int(p.parent.name)) if logs else None


def _ckpt_export(args: argparse.Namespace) -> int:
    from raytrain_ext.checkpoint.export import ExportError, export_safetensors
    from raytrain_ext.ops.export_hf import export_hf

    try:
        if args.to_hf:
            info = export_hf(
                args.location,
                Path(args.to_hf),
                args.s3_endpoint_url,
                args.run_config,
                args.max_shard_size,
            )
        else:
            info = export_safetensors(args.location, Path(args.to), args.s3_endpoint_url)
    except ExportError as e:
        print(f"export failed: {e}", file=sys.stderr)
        return 2
    for skipped in info["skipped"]:
        print(f"skipped {skipped}", file=sys.stderr)
    print(
        f"exported step {info['step']}: {info['tensors']} tensors, "
        f"{info['parameters']:,} parameters -> {info['out']} (read "
        f"{info['fetched_bytes'] / 2**20:.1f} of {info['total_bytes'] / 2**20:.1f} MiB"
        f"{', ranged' if info['ranged'] else ''})"
    )
    if info.get("tokenizer"):
        print(f"with the run's tokenizer ({info['tokenizer']})")
    return 0


def _sections_epilog() -> str:
    import textwrap

    from raytrain_ext.config.show import sections

    width = max(len(name) for name, _ in sections())
    listed = "\n".join(
        textwrap.fill(
            about,
            width=96,
            initial_indent=f"  {name.ljust(width)}  ",
            subsequent_indent=" " * (width + 4),
        )
        for name, about in sections()
    )
    return (
        f"config sections (keys are SECTION.KEY):\n{listed}\n\n"
        "raytrain-ext config show [CONFIG.yaml] [SECTION ...] [key=value ...]\n"
        "  prints every key of those sections with its value, default and choices."
    )


def _add_config_parser(commands) -> None:
    config = commands.add_parser("config", help="show a resolved config: keys, defaults, choices")
    config_commands = config.add_subparsers(dest="config_command", required=True)
    show = config_commands.add_parser(
        "show",
        help="every key's value (after the YAML and overrides), default and choices",
    )
    show.add_argument(
        "items",
        nargs="*",
        metavar="[CONFIG.yaml] [SECTION ...] [key=value ...]",
        help="a config file, the sections to show (default: all) and overrides",
    )
    show.set_defaults(func=_config_show)


def _config_show(args: argparse.Namespace) -> int:
    from raytrain_ext.config import ConfigError, load_config
    from raytrain_ext.config.show import show_config

    overrides = [item for item in args.items if "=" in item]
    files = [item for item in args.items if "=" not in item and item.endswith((".yaml", ".yml"))]
    wanted = [item for item in args.items if item not in overrides and item not in files]
    try:
        if len(files) > 1:
            raise ConfigError(f"config show: one config file, got {', '.join(files)}")
        cfg = load_config(files[0] if files else None, overrides)
        print(show_config(cfg, wanted))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def split_config_and_overrides(config: Optional[str], items: List[str]):
    """``--config X`` wins; otherwise a first positional that is not key=value is the config."""
    items = list(items)
    if config is None and items and "=" not in items[0]:
        config = items.pop(0)
    return config, items


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raytrain-ext", description=DESCRIPTION)
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser(
        "train",
        help="train a model (model.source: the reference GPT, Hugging Face, your own) on Ray",
        description="Train with a YAML config and key=value overrides (defaults < YAML < "
        "overrides), e.g. `raytrain-ext train configs/sft_llama_tiny.yaml run.max_steps=10`.",
        epilog=_sections_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("--config", help="YAML config (default: the packaged tiny_cpu config)")
    train.add_argument(
        "items",
        nargs="*",
        metavar="[CONFIG.yaml] key=value",
        help="a config file and/or OmegaConf overrides, e.g. run.max_steps=10",
    )
    train.set_defaults(func=_train)
    _add_config_parser(commands)

    ckpt = commands.add_parser("ckpt", help="inspect and convert checkpoints")
    ckpt_commands = ckpt.add_subparsers(dest="ckpt_command", required=True)
    export = ckpt_commands.add_parser("export", help="full model to Hugging Face safetensors")
    export.add_argument(
        "location",
        metavar="RUN_OR_PATH",
        help="a run directory, a checkpoints directory, a step-<N> directory, "
        "or an s3:// prefix or step URI (newest committed step if not given)",
    )
    target = export.add_mutually_exclusive_group(required=True)
    target.add_argument(
        "--to", help="output .safetensors file (its directory is created if need be)"
    )
    target.add_argument(
        "--to-hf",
        metavar="DIR",
        help="a Hugging Face model directory (model.source=hf runs): config.json, sharded "
        "safetensors with an index, tokenizer files; loads with from_pretrained",
    )
    export.add_argument(
        "--run-config", help="the run's config.yaml (--to-hf; found beside the checkpoints)"
    )
    export.add_argument("--max-shard-size", default="5GB", help="--to-hf: per safetensors file")
    export.add_argument("--s3-endpoint-url", default=None)
    export.set_defaults(func=_ckpt_export)
    from raytrain_ext.ops.doctor.diagnosis import add_parser as add_doctor

    add_doctor(commands)
    from raytrain_ext.ops.plan.cli import add_parser as add_plan

    add_plan(commands)
    from raytrain_ext.ops.report import add_parser as add_report

    add_report(commands)
    from raytrain_ext.prepare.cli import add_parser as add_data

    add_data(commands)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Every command ends in a message, never a traceback: an error no command expected
    is reported in one line, its traceback written to a log file that the line names."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the last line of defence, reported in full to a file
        return _unexpected(args.command, e)


def _unexpected(command: str, error: Exception) -> int:
    import tempfile
    import traceback

    from raytrain_ext.errors.text import one_line

    fd, path = tempfile.mkstemp(prefix=f"raytrain-ext-{command}-", suffix=".log")
    with os.fdopen(fd, "w") as f:
        f.write("".join(traceback.format_exception(type(error), error, error.__traceback__)))
    print(
        f"{command} failed: {one_line(error)}\n(traceback in {path}; please report it if the "
        "message does not say what to fix)",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
