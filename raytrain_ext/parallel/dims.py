"""How the world splits into pipeline, data-parallel and tensor-parallel groups (and experts).

A ``ParallelDims`` (torchtitan style) is pure arithmetic, checked once on the
driver for every world size the run may take and again in each worker for the
actual one; only ``build_mesh`` touches torch.distributed.

Mesh layout invariant: ranks are laid out row-major over
``("pp", "dp_replicate", "dp_shard", "tp")`` (torchtitan's order), so
``rank = (pp_rank * dp_size + dp_rank) * tp + tp_rank``.  The ``tp`` ranks of
one group are consecutive (one node, where the bandwidth is); every rank of a
TP group and of a pipeline (one rank per stage) reads the same samples, and
``dp_size = dp_replicate * dp_shard`` groups split the global batch.  With
``pp == 1`` this is the plain ``rank = dp_rank * tp + tp_rank``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional

from raytrain_ext.parallel.catalog import LiveState, capabilities, live_state, offered

MESH_DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "tp")


class ParallelLayoutError(ValueError):
    """A parallel layout that cannot work; the message names the key and the fix."""


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int = 1
    ep: int = 1

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    def dp_rank(self, rank: int) -> int:
        return (rank // self.tp) % self.dp_size

    def shard_index(self, rank: int) -> int:
        """This rank's place along ``dp_shard``: which shard of the state it holds (ranks
        of equal index in different ``dp_replicate`` groups hold the same shard)."""
        return (rank // self.tp) % self.dp_shard

    def pp_rank(self, rank: int) -> int:
        """This rank's pipeline stage (stage 0 embeds, stage ``pp - 1`` computes the loss)."""
        return rank // (self.dp_size * self.tp)

    def is_first_stage(self, rank: int) -> bool:
        return self.pp_rank(rank) == 0

    def is_last_stage(self, rank: int) -> bool:
        return self.pp_rank(rank) == self.pp - 1

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    @property
    def mesh_shape(self) -> tuple:
        return (self.pp, self.dp_replicate, self.dp_shard, self.tp)

    def build_mesh(self, device_type: str):
        """The 4-D DeviceMesh over the default process group (all ranks must call this)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=MESH_DIM_NAMES)

    @classmethod
    def data_parallel(cls, world_size: int) -> "ParallelDims":
        """Plain DDP: every rank is its own data-parallel rank."""
        return cls(dp_replicate=1, dp_shard=world_size, tp=1)

    @classmethod
    def build(cls, parallel_cfg, model_cfg, world_size: int) -> "ParallelDims":
        """Validate ``parallel.*`` against ``model.*`` and ``world_size``; derive ``dp_shard``."""
        check_degrees(parallel_cfg)
        check_expert_parallel(parallel_cfg, model_cfg)
        check_strategy_support(parallel_cfg)
        check_model_fits_tp(parallel_cfg.tp, model_cfg)
        check_sequence_parallel(parallel_cfg, model_cfg)
        check_pipeline(parallel_cfg, model_cfg)
        fixed = parallel_cfg.tp * parallel_cfg.dp_replicate * parallel_cfg.pp
        if world_size % fixed:
            raise ParallelLayoutError(
                f"parallel.tp: world size {world_size} is not divisible by dp_replicate x tp x pp "
                f"= {parallel_cfg.dp_replicate} x {parallel_cfg.tp} x {parallel_cfg.pp} = {fixed} "
                f"({world_size} = dp_replicate {parallel_cfg.dp_replicate} x dp_shard "
                f"{world_size / fixed:g} x tp {parallel_cfg.tp} x pp {parallel_cfg.pp}?). "
                f"Choose degrees whose product divides {world_size} "
                f"(divisors: {', '.join(map(str, divisors(world_size)))})."
            )
        dims = cls(
            dp_replicate=parallel_cfg.dp_replicate,
            dp_shard=world_size // fixed,
            tp=parallel_cfg.tp,
            pp=parallel_cfg.pp,
            ep=parallel_cfg.ep,
        )
        if dims.dp_size % dims.ep:
            raise ParallelLayoutError(
                f"parallel.ep: ep={dims.ep} does not divide the data-parallel size {dims.dp_size} "
                f"(world size {world_size}); experts are sharded over groups of ep consecutive "
                f"data-parallel ranks. Choose ep among {', '.join(map(str, divisors(dims.dp_size)))}."
            )
        return dims


def divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_degrees(parallel_cfg) -> None:
    for key in ("tp", "dp_replicate", "pp", "ep"):
        value = getattr(parallel_cfg, key)
        if value < 1:
            raise ParallelLayoutError(
                f"parallel.{key}: must be >= 1, got {value}. "
                f"Set parallel.{key}=1 to disable this dimension."
            )


def check_expert_parallel(parallel_cfg, model_cfg) -> None:
    """``ep > 1`` shards the experts of an MoE model over data-parallel ranks
    (:mod:`raytrain_ext.parallel.ep`), under DDP or FSDP (which composes with TP).

    ZeRO would shard the experts a second time; HSDP replica groups do not
    exclude them yet.  Every rank must hold whole, equally many experts.
    """
    ep = parallel_cfg.ep
    if ep == 1:
        return
    strategy = parallel_cfg.strategy
    unsupported = (
        [] if capabilities(strategy).expert_parallel else [f"parallel.strategy={strategy}"]
    )
    if parallel_cfg.dp_replicate > 1:
        unsupported.append(f"parallel.dp_replicate={parallel_cfg.dp_replicate}")
    if unsupported:
        raise ParallelLayoutError(
            f"parallel.ep: expert parallelism (ep={ep}) is not supported yet with "
            f"{', '.join(unsupported)}; it runs with parallel.strategy="
            f"{offered(lambda c: c.expert_parallel is not None)} (any tp and pp) "
            "and dp_replicate=1. Change those keys, or set parallel.ep=1."
        )
    experts = model_cfg.moe.num_experts
    if not experts:
        raise ParallelLayoutError(
            f"parallel.ep: expert parallelism (ep={ep}) needs a mixture-of-experts model, but "
            "model.moe.num_experts=0. Set model.moe.num_experts (a multiple of ep) or parallel.ep=1."
        )
    if experts % ep:
        raise ParallelLayoutError(
            f"parallel.ep: model.moe.num_experts={experts} is not divisible by ep={ep} "
            f"({experts} / {ep} = {experts / ep:g} experts per rank); every rank holds the same "
            f"number of whole experts. Choose ep among {', '.join(map(str, divisors(experts)))}."
        )


def check_strategy_support(parallel_cfg) -> None:
    """TP and HSDP need a strategy that declares them (FSDP2): DDP cannot all-reduce the
    DTensor parameters TP creates, and with DDP every rank already is a replica, so
    ``dp_replicate`` has no meaning."""
    strategy = parallel_cfg.strategy
    caps = capabilities(strategy)
    if parallel_cfg.tp > 1 and not caps.tensor_parallel:
        with_tp = offered(lambda c: c.tensor_parallel)
        raise ParallelLayoutError(
            f"parallel.tp: tensor parallelism (tp={parallel_cfg.tp}) needs parallel.strategy="
            f"{with_tp} (got {strategy!r}: {caps.label} cannot synchronise TP-sharded DTensor "
            f"parameters). Set parallel.strategy={with_tp} or parallel.tp=1."
        )
    if parallel_cfg.dp_replicate > 1 and not caps.replica_groups:
        with_replicas = offered(lambda c: c.replica_groups)
        raise ParallelLayoutError(
            f"parallel.dp_replicate: HSDP replica groups "
            f"(dp_replicate={parallel_cfg.dp_replicate}) need parallel.strategy={with_replicas}; "
            f"with {strategy!r} every rank is already a replica. "
            f"Set parallel.strategy={with_replicas} or parallel.dp_replicate=1."
        )
    for key in ("activation_checkpointing", "cpu_offload", "compile"):
        if getattr(parallel_cfg, key) and not caps.layer_options:
            with_options = offered(lambda c: c.layer_options)
            raise ParallelLayoutError(
                f"parallel.{key}: only implemented for "
                f"parallel.strategy={with_options} (got {strategy!r}). "
                f"Set parallel.strategy={with_options} or parallel.{key}=false."
            )


def check_pipeline(parallel_cfg, model_cfg) -> None:
    """Every stage holds at least one block, on a strategy and model the stages support.

    Blocks split as evenly as layer counts allow (earlier stages take the
    remainder), so ``n_layers`` need not divide by ``pp``.  ZeRO owns the
    backward itself, which the pipeline schedule needs.  The schedule's name needs
    no check here: its enum (``parallel.config.PipelineSchedule``) refuses others.
    """
    pp = parallel_cfg.pp
    if pp == 1:
        return
    if not capabilities(parallel_cfg.strategy).pipeline_stages:
        with_pp = offered(lambda c: c.pipeline_stages)
        raise ParallelLayoutError(
            f"parallel.pp: pipeline parallelism (pp={pp}) runs with parallel.strategy {with_pp} "
            f"(got {parallel_cfg.strategy!r}). Set parallel.strategy={with_pp}, "
            "or parallel.pp=1."
        )
    if model_cfg.n_layers < pp:
        raise ParallelLayoutError(
            f"parallel.pp: model.n_layers={model_cfg.n_layers} cannot fill pp={pp} stages; every "
            f"stage needs at least one block. Choose pp <= {model_cfg.n_layers}."
        )


def check_pipeline_microbatches(
    schedule: str, global_batch: int, micro: int, dims: "ParallelDims"
) -> None:
    """1F1B starts ``pp`` forwards before the first backward: it needs that many micro-batches."""
    if dims.pp == 1 or schedule != "1f1b":
        return
    counts = microbatch_counts(global_batch, dims.dp_size, micro)
    if min(counts) < dims.pp:
        raise ParallelLayoutError(
            f"data.global_batch_size: {global_batch} samples over {dims.dp_size} data-parallel "
            f"ranks in micro-batches of {micro} give {min(counts)} micro-batches per step, fewer "
            f"than the pp={dims.pp} stages parallel.pp_schedule=1f1b needs. Use a "
            f"global_batch_size of at least {dims.dp_size * micro * dims.pp}, a smaller "
            "micro_batch_size, or parallel.pp_schedule=gpipe."
        )


def check_sequence_parallel(parallel_cfg, model_cfg) -> None:
    """Sequence parallelism splits each TP rank's activations along the sequence.

    A MoE feed-forward would then route only part of the tokens on each TP rank
    (the rank-local expert gradients of :mod:`raytrain_ext.parallel.tp` assume
    whole sequences), and pipeline stages pass whole-sequence activations.
    """
    if not parallel_cfg.sequence_parallel:
        return
    tp = parallel_cfg.tp
    problems = [f"parallel.tp={tp} (needs tp > 1)"] if tp == 1 else []
    if parallel_cfg.pp > 1:
        problems.append(f"parallel.pp={parallel_cfg.pp}")
    if model_cfg.moe.num_experts:
        problems.append(f"model.moe.num_experts={model_cfg.moe.num_experts}")
    if tp > 1 and model_cfg.seq_len % tp:
        problems.append(f"model.seq_len={model_cfg.seq_len} (not divisible by tp={tp})")
    if problems:
        raise ParallelLayoutError(
            f"parallel.sequence_parallel: not available with {', '.join(problems)}; it splits "
            "dense, unpipelined TP layers along the sequence. Change those keys, or set "
            "parallel.sequence_parallel=false."
        )


def check_model_fits_tp(tp: int, model_cfg) -> None:
    """Each TP rank holds whole attention heads and an equal slice of the MLP hidden size.

    ``d_model`` is a multiple of ``n_heads`` (checked with ``model.*``), so heads
    divisible by tp make ``d_model`` and ``d_model x mlp_ratio`` divisible too.
    """
    if tp == 1:
        return
    if model_cfg.n_heads % tp:
        raise ParallelLayoutError(
            f"parallel.tp: model.n_heads={model_cfg.n_heads} is not divisible by tp={tp} "
            f"({model_cfg.n_heads} / {tp} = {model_cfg.n_heads / tp:g} heads per rank); each TP "
            "rank must hold whole heads. Choose tp dividing n_heads."
        )
    if model_cfg.dropout > 0:
        raise ParallelLayoutError(
            f"parallel.tp: model.dropout={model_cfg.dropout} with tp={tp} is not supported yet "
            "(the ranks of a TP group would draw different masks for the same activations). "
            "Set model.dropout=0 or parallel.tp=1."
        )


def microbatch_counts(global_batch: int, dp_size: int, micro: int) -> set:
    """The distinct micro-batch counts per data-parallel rank (shares differ by at most 1)."""
    base, extra = divmod(global_batch, dp_size)
    shares = {base + 1} if extra else set()
    if dp_size - extra:
        shares.add(base)
    return {math.ceil(share / micro) for share in shares}


def check_batch_split(
    strategy: str,
    global_batch: int,
    micro: int,
    dims: ParallelDims,
    world_size: Optional[int] = None,
) -> None:
    """Every dp rank needs a sample; FSDP also needs equal micro-batch counts.

    FSDP all-gathers parameters in every forward, so a rank with fewer
    micro-batches than its peers would leave them waiting; DDP only
    communicates on the last micro-batch and tolerates uneven splits.  A
    pipeline's stages exchange activations per micro-batch, so ``pp > 1``
    needs equal counts too (with DDP they are equal within a pipeline anyway), and
    so does ``ep > 1``: every forward exchanges tokens all-to-all within the EP group.
    """
    world = world_size if world_size is not None else dims.world_size
    if global_batch < dims.dp_size:
        raise ParallelLayoutError(
            f"data.global_batch_size: {global_batch} is smaller than the data-parallel size "
            f"{dims.dp_size} (world {world} / (tp {dims.tp} x pp {dims.pp})); every "
            "data-parallel rank needs at least one sample per step. Raise global_batch_size."
        )
    counts = microbatch_counts(global_batch, dims.dp_size, micro)
    lockstep = capabilities(strategy).lockstep_microbatches
    if (lockstep or dims.pp > 1 or dims.ep > 1) and len(counts) > 1:
        raise ParallelLayoutError(
            f"data.global_batch_size: {global_batch} samples over {dims.dp_size} data-parallel "
            f"ranks (world {world}) in micro-batches of {micro} give some ranks "
            f"{min(counts)} and others {max(counts)} micro-batches; "
            f"{_lockstep_reason(strategy, dims)} needs the same count on "
            f"every rank. Use a global_batch_size that is a multiple of "
            f"{dims.dp_size * micro} (data-parallel size x micro_batch_size)."
        )


def _lockstep_reason(strategy: str, dims: ParallelDims) -> str:
    """What makes every data-parallel rank run the same number of forwards."""
    caps = capabilities(strategy)
    if caps.lockstep_microbatches:
        return caps.label
    return "pipeline parallelism" if dims.pp > 1 else "expert parallelism (all-to-all per forward)"


def dims_for_run(cfg, world_size: int) -> ParallelDims:
    """The layout for this worker group's actual world size (after any elastic resize),
    checked like on the driver: degrees, model fit, and the batch split."""
    dims = ParallelDims.build(cfg.parallel, cfg.model, world_size)
    check_batch_split(
        cfg.parallel.strategy, cfg.data.global_batch_size, cfg.data.micro_batch_size, dims
    )
    check_pipeline_microbatches(
        cfg.parallel.pp_schedule, cfg.data.global_batch_size, cfg.data.micro_batch_size, dims
    )
    return dims


def replicates_state(parallel_cfg) -> bool:
    """Whether every rank holds the whole training state, so that any one rank can hand it
    to a re-formed group (``parallel.catalog.live_state``: plain DDP)."""
    return live_state(parallel_cfg) is LiveState.replicated


def holds_own_shards(parallel_cfg) -> bool:
    """Whether each rank holds shards that no live peer holds (FSDP, TP, PP, EP; not HSDP's
    replicas), so that a lost rank's state comes from a checkpoint
    (``checkpoint.snapshot_policy``: per-step snapshots by default)."""
    return live_state(parallel_cfg) is LiveState.own_shards


def state_from_peers(cfg) -> bool:
    """Whether a group re-formed in place takes its state from its live ranks (else from
    the newest checkpoint): a replicated layout, unless ``elastic.state_from_peers`` is off."""
    return cfg.elastic.state_from_peers and replicates_state(cfg.parallel)


def shards_from_replicas(cfg) -> bool:
    """Whether a group re-formed in place at the same ``dp_shard`` degree takes each shard
    from a live rank of another replica that holds it (HSDP: FSDP with ``dp_replicate``
    > 1 and no tensor, pipeline or expert sharding); ``elastic.state_from_peers`` off
    turns it off."""
    held = live_state(cfg.parallel) is LiveState.replica_shards
    return cfg.elastic.state_from_peers and held


def restores_own_shards(cfg) -> bool:
    """Whether a rank keeps its own shards when its group breaks, so that a checkpoint
    restore of their step copies them from memory and reads only the others: every
    layout whose state DCP saves as the ranks hold it (FSDP and HSDP shards and TP's as
    DTensor chunks; a pipeline stage's and EP's experts as plain tensors under their
    global names, the same on every rank that holds them), but not a replicated one (its
    state comes from a live peer) nor ZeRO (DeepSpeed saves its own).
    ``elastic.state_from_peers`` off turns it off."""
    held = live_state(cfg.parallel) in (LiveState.own_shards, LiveState.replica_shards)
    return cfg.elastic.state_from_peers and held


def resize_unit(parallel_cfg) -> int:
    """The step by which the world may shrink or grow: whole model-parallel groups.

    Any multiple of ``dp_replicate x tp x pp`` lays out (dp_shard takes the rest),
    and expert parallelism needs the data-parallel size to be a multiple of ``ep``.
    """
    return parallel_cfg.dp_replicate * parallel_cfg.tp * parallel_cfg.pp * max(1, parallel_cfg.ep)


def allowed_world_sizes(scaling_cfg, parallel_cfg) -> List[int]:
    """The world sizes the elastic controller may choose: multiples of the unit in min..max."""
    unit = resize_unit(parallel_cfg)
    return [
        w
        for w in range(max(1, scaling_cfg.min_workers), scaling_cfg.max_workers + 1)
        if w % unit == 0
    ]
