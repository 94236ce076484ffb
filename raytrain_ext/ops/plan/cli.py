"""``raytrain-ext plan``: memory per GPU of each strategy and a recommended layout.

Exit status: 0 with a recommendation, 1 when no layout fits, 2 on invalid input.
"""

from __future__ import annotations

import json
import sys
from typing import Optional, Tuple

from raytrain_ext.ops.plan.cluster import Cluster, Settings
from raytrain_ext.ops.plan.layout import Plan, make_plan
from raytrain_ext.ops.plan.shape import ModelShape, PlanError, infer_shape, shape_from_config
from raytrain_ext.parallel.config import Precision

DEFAULT_VOCAB = 50304
DEFAULT_SEQ = 2048
SHAPE_FLAGS = ("layers", "hidden", "heads", "vocab", "mlp_ratio", "experts", "top_k")


def add_parser(commands) -> None:
    p = commands.add_parser(
        "plan", help="memory per GPU of DDP/ZeRO/FSDP/TP/PP/EP and a recommended layout"
    )
    _model_arguments(
        p.add_argument_group("model (one of --params, --config, --layers/--hidden/--heads)")
    )
    _workload_arguments(p.add_argument_group("workload"))
    _cluster_arguments(p.add_argument_group("cluster"))
    _margin_arguments(p.add_argument_group("margins and a split to check"))
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run_plan)


def _model_arguments(model) -> None:
    model.add_argument("--params", type=float, help="total parameters, e.g. 7e9 (shape inferred)")
    model.add_argument(
        "--config", help="a raytrain_ext YAML config; its model and micro-batch are used"
    )
    for flag, text in (
        ("--layers", "transformer blocks"),
        ("--hidden", "d_model"),
        ("--heads", "attention heads"),
        ("--vocab", f"vocabulary (default {DEFAULT_VOCAB})"),
        ("--mlp-ratio", "MLP hidden / d_model (default 4)"),
        ("--experts", "MoE experts per layer (0 = dense)"),
        ("--top-k", "experts per token (default 2)"),
    ):
        model.add_argument(flag, type=int, help=text)


def _workload_arguments(work) -> None:
    work.add_argument(
        "--seq", type=int, help=f"sequence length (default: the config's, else {DEFAULT_SEQ})"
    )
    work.add_argument(
        "--micro-batch", type=int, help="sequences per GPU per forward (default: config's, else 1)"
    )
    work.add_argument(
        "--precision", choices=Precision.values(), help="bf16 mixed precision (default) or fp32"
    )
    work.add_argument(
        "--no-flash-attention",
        action="store_true",
        help="count the a*s^2 attention scores (eager attention)",
    )


def _cluster_arguments(hw) -> None:
    hw.add_argument("--nodes", type=int, default=1)
    hw.add_argument("--gpus-per-node", type=int, default=8)
    hw.add_argument("--gpu-mem-gb", type=float, default=80.0, help="GiB per GPU (default 80)")
    hw.add_argument(
        "--host-mem-gb", type=float, default=1024.0, help="GiB of host RAM per node (default 1024)"
    )
    hw.add_argument("--intra", default="nvlink", help="link between GPUs of a node: nvlink | pcie")
    hw.add_argument("--inter", default="ib", help="link between nodes: ib | ethernet")


def _margin_arguments(knobs) -> None:
    knobs.add_argument(
        "--headroom",
        type=float,
        default=0.15,
        help="fraction of memory kept free for CUDA context/fragmentation (default 0.15)",
    )
    knobs.add_argument(
        "--host-buffer-factor", type=float, default=1.5, help="DeepSpeed's host buffer factor"
    )
    knobs.add_argument(
        "--meta-init", action="store_true", help="model built on the meta device (no full CPU copy)"
    )
    knobs.add_argument(
        "--tp", type=int, help="evaluate this tensor-parallel degree too (with --pp/--ep)"
    )
    knobs.add_argument(
        "--pp", type=int, help="pipeline stages of the split to evaluate (default 1)"
    )
    knobs.add_argument("--ep", type=int, help="expert-parallel degree of the split to evaluate")


def model_and_workload(args) -> Tuple[ModelShape, int, int, str, bool]:
    """Shape, micro-batch, sequence length, precision, and whether the sequence cap comes from a config."""
    given = [f for f in SHAPE_FLAGS if getattr(args, f) is not None]
    if args.config:
        if args.params is not None or given:
            raise PlanError(
                f"--config already defines the model; drop --params/--{given[0] if given else 'params'} "
                "or edit the config"
            )
        from raytrain_ext.config import ConfigError, load_config

        try:
            cfg = load_config(args.config)
        except (ConfigError, FileNotFoundError) as e:
            raise PlanError(f"--config {args.config}: {e}") from e
        precision = args.precision or ("fp32" if cfg.parallel.mixed_precision == "fp32" else "bf16")
        return (
            shape_from_config(cfg.model),
            args.micro_batch or int(cfg.data.micro_batch_size),
            args.seq or int(cfg.model.seq_len),
            precision,
            True,
        )
    seq, micro, precision = args.seq or DEFAULT_SEQ, args.micro_batch or 1, args.precision or "bf16"
    if args.layers is not None or args.hidden is not None or args.heads is not None:
        if args.params is not None:
            raise PlanError("give either --params or --layers/--hidden/--heads, not both")
        missing = [f"--{f}" for f in ("layers", "hidden", "heads") if getattr(args, f) is None]
        if missing:
            raise PlanError(
                f"{', '.join(missing)} missing: --layers, --hidden and --heads go together"
            )
        shape = ModelShape(
            n_layers=args.layers,
            d_model=args.hidden,
            n_heads=args.heads,
            vocab_size=args.vocab or DEFAULT_VOCAB,
            seq_len=seq,
            mlp_ratio=args.mlp_ratio or 4,
            num_experts=args.experts or 0,
            top_k=args.top_k or 2,
        )
        return shape, micro, seq, precision, False
    if args.params is None:
        raise PlanError(
            "describe the model with --params 7e9, --config FILE or --layers/--hidden/--heads"
        )
    if args.experts:
        raise PlanError(
            "--experts needs the architecture: use --layers/--hidden/--heads or --config, not --params"
        )
    shape = infer_shape(args.params, args.vocab or DEFAULT_VOCAB, seq, args.mlp_ratio or 4)
    return shape, micro, seq, precision, False


def build_plan(args) -> Plan:
    shape, micro, seq, precision, seq_from_config = model_and_workload(args)
    cluster = Cluster(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        gpu_mem_gib=args.gpu_mem_gb,
        host_mem_gib=args.host_mem_gb,
        intra=args.intra,
        inter=args.inter,
    )
    settings = Settings(
        micro_batch=micro,
        seq_len=seq,
        precision=precision,
        headroom=args.headroom,
        host_buffer_factor=args.host_buffer_factor,
        meta_init=args.meta_init,
        flash_attention=not args.no_flash_attention,
    )
    split: Optional[tuple] = None
    if args.tp is not None or args.pp is not None or args.ep is not None:
        split = (args.tp or 1, args.pp or 1, args.ep)
    return make_plan(shape, cluster, settings, split, seq_from_config)


def run_plan(args) -> int:
    try:
        plan = build_plan(args)
    except PlanError as e:
        print(f"plan: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_dict(), indent=2) if args.json else render(plan))
    return 0 if plan.recommended else 1


def render(plan: Plan) -> str:
    s, c, st = plan.shape, plan.cluster, plan.settings
    shape = (
        f"{'inferred shape: ' if s.inferred else ''}{s.n_layers} layers, hidden {s.d_model}, "
        f"{s.n_heads} heads, vocab {s.vocab_size}"
        + (f", {s.num_experts} experts top-{s.top_k}" if s.is_moe else "")
    )
    lines = [
        f"Model: {plan.counts.total:,} parameters ({shape}); seq {st.seq_len}, micro-batch "
        f"{st.micro_batch}, {st.precision}",
        f"Cluster: {c.nodes} node(s) x {c.gpus_per_node} GPUs x {c.gpu_mem_gib:g} GiB "
        f"({c.gpu_mem_gib * (1 - st.headroom):.1f} GiB usable at {st.headroom:.0%} headroom), "
        f"{c.intra} + {c.inter}, {c.host_mem_gib:g} GiB host RAM per node",
        "",
        f"{'Per GPU, GiB':<62}{'params':>7}{'grads':>7}{'optim':>7}{'gather':>7}{'states':>8}"
        f"{'act':>7}{'act-ckpt':>9}{'total':>8}{'host/node':>10}  fits",
    ]
    for ev in plan.rows:
        d = ev.to_dict()["per_gpu_gib"]
        name = f"{ev.layout.name} [{ev.layout.split()}]"
        lines.append(
            f"{name:<62}{d['params']:>7.1f}{d['grads']:>7.1f}{d['optimizer']:>7.1f}"
            f"{d['gathered']:>7.1f}{d['model_states']:>8.1f}{d['activations']:>7.1f}"
            f"{d['activations_checkpointed']:>9.1f}{d['total']:>8.1f}"
            f"{ev.host['offload'] / 2**30:>10.0f}  {ev.verdict()}"
        )
    lines += [
        "",
        "total = states + act (no recompute); host/node = offloaded states x buffer factor.",
        "",
        "Recommendation:",
    ] + [f"  {line}" for line in plan.explanation()]
    if plan.notes:
        lines += ["", "Notes:"] + [f"  - {note}" for note in plan.notes]
    return "\n".join(lines)
