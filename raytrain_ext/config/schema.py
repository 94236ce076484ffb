"""Typed configuration: one structured dataclass per section.

OmegaConf enforces the types, rejects unknown keys and refuses a value outside a
key's choice enum (:mod:`raytrain_ext.config.choices`) when YAML files and
``key=value`` overrides are merged onto these defaults.  Numeric ranges are declared
beside each field (:mod:`raytrain_ext.config.fields`); the checks of ranges and
between keys live in :mod:`raytrain_ext.config.validate`.
Interpolations such as ``${run.seed}`` are resolved on the driver, so workers
always receive plain values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from raytrain_ext.config.choices import (
    Backend,
    DataFormat,
    Device,
    MixedPrecision,
    ModelSource,
    NanPolicy,
    ObjectiveName,
    Offload,
    OnBusy,
    PipelineSchedule,
    PlacementStrategy,
    StrategyName,
)
from raytrain_ext.config.fields import at_least, minus_one_or_more, positive, within


@dataclass
class RunConfig:
    """Identity and length of a run; ``output_dir/name`` is the run directory."""

    name: str = "tiny"
    output_dir: str = "runs"
    seed: int = at_least(0, 1234)
    max_steps: int = positive(40)
    log_every: int = positive(5)
    device: Device = Device.auto
    tensorboard: bool = True


@dataclass
class MoEConfig:
    """Mixture-of-experts feed-forward; ``num_experts: 0`` means a dense MLP."""

    num_experts: int = at_least(0, 0)
    top_k: int = 2
    capacity_factor: float = 1.25
    aux_loss_weight: float = at_least(0, 0.01)


@dataclass
class HFModelConfig:
    """``model.source: hf``: a Hugging Face causal LM of a family with a shipped spec.

    ``path`` is a local directory holding ``config.json`` (and, for pretrained
    weights, safetensors), or a model id already in the local HF cache; ``config`` is
    an inline architecture (``{model_type: llama, hidden_size: 64, ...}``) for a
    randomly initialised model, merged over ``path``'s when both are given.
    """

    path: Optional[str] = None
    config: Dict[str, Any] = field(default_factory=dict)
    pretrained: bool = True  # load path's safetensors; false: random init of the architecture


@dataclass
class ModelConfig:
    """The model: by default the reference GPT, whose shape the fields below set
    (``vocab_size: 256`` matches the byte-level corpus).  For ``source: hf`` the shape
    fields are read from the Hugging Face config (``model.hf``) when the config loads,
    so every check and the planner see the real model; ``source: python`` builds the
    user's module from ``factory`` (``"pkg.module:build"``, called with this section and
    the seed; it returns an ``nn.Module``, or ``(module, ModelSpec)`` for layouts beyond
    DDP/FSDP), and FSDP wraps each module of class ``block_class``.
    """

    source: ModelSource = ModelSource("gpt")
    hf: HFModelConfig = field(default_factory=HFModelConfig)
    factory: Optional[str] = None
    block_class: Optional[str] = None
    n_layers: int = positive(2)
    d_model: int = positive(128)
    n_heads: int = positive(4)
    vocab_size: int = positive(256)
    seq_len: int = positive(128)
    mlp_ratio: int = positive(4)
    dropout: float = within(0, 1, 0.0, hi_open=True)
    moe: MoEConfig = field(default_factory=MoEConfig)


@dataclass
class DataConfig:
    """Token source and the global batch.

    ``path`` is ``builtin:corpus`` (ships with the package), a local Arrow IPC
    or Parquet file or directory, or an ``s3://bucket/prefix`` URI.  Each step
    consumes exactly ``global_batch_size`` samples of the global order whatever
    the world size; ``micro_batch_size`` is what one rank runs per forward.
    """

    path: str = "builtin:corpus"
    global_batch_size: int = positive(16)
    micro_batch_size: int = positive(4)
    shuffle: bool = True
    seed: int = at_least(0, "${run.seed}")
    s3_endpoint_url: Optional[str] = None
    s3_region: Optional[str] = None
    # a dataset of fewer samples than one global batch is refused unless this is true
    # (each batch would then hold some samples more than once)
    allow_repeat: bool = False
    # tokens: ids in a ``tokens`` column (or a prepared directory); text/chat/preference:
    # raw records (tokenized at start, cached in the run directory) or a prepared directory
    format: DataFormat = DataFormat.tokens
    # a Hugging Face tokenizer directory or a tokenizer.json; null: the model directory's
    # (model.source=hf) or, for a prepared directory, the one recorded in its index
    tokenizer: Optional[str] = None
    # the tokenizer's end-of-text token, when it names none (a bare tokenizer.json) or
    # another one should end documents; null: its own EOS, else </s>, <|endoftext|>, <eos>
    eos_token: Optional[str] = None
    text_column: str = "text"  # format text: the column holding each document
    # format text: attention and loss never cross a document boundary (the EOS separators)
    document_mask: bool = False
    # an evaluation split: a path like data.path (same format), or null with eval.fraction
    eval_path: Optional[str] = None
    # assemble the next micro-batches on a background thread while the current one runs
    # (the same batches either way: it only hides the reading time)
    prefetch: bool = True


@dataclass
class OptimConfig:
    """AdamW with linear warmup then cosine decay to ``min_lr``."""

    lr: float = positive(3.0e-3)
    min_lr: float = at_least(0, 3.0e-4)
    weight_decay: float = at_least(0, 0.1)
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = positive(1.0e-8)
    warmup_steps: int = at_least(0, 5)
    decay_steps: int = positive("${run.max_steps}")
    grad_clip: float = at_least(0, 1.0)


@dataclass
class ScalingConfig:
    """How many workers, what each one needs, and how they are placed.

    ``min_workers``/``max_workers`` default to ``num_workers``; the elastic
    controller keeps the world size inside that range.
    """

    num_workers: int = positive(2)
    min_workers: Optional[int] = None
    max_workers: Optional[int] = None
    resources_per_worker: Dict[str, float] = field(default_factory=lambda: {"CPU": 1.0})
    use_gpu: bool = False
    placement_strategy: PlacementStrategy = PlacementStrategy.PACK
    placement_timeout_s: float = positive(60.0)
    ray_address: Optional[str] = None
    # the CPU priority of the ranks, their spares and the memory tier's holders: Ray's
    # worker processes run at nice 15 below the node's daemons, ours at this (19: lowest;
    # 15: Ray's own, to share nodes with other Ray work on equal terms; worker/priority.py)
    worker_niceness: int = within(0, 19, 0)


@dataclass
class ZeroConfig:
    """DeepSpeed ZeRO (``parallel.strategy: zero``); the DeepSpeed JSON config is generated
    from these keys, ``optim.*`` and ``data.micro_batch_size``; ``extra`` is merged last."""

    stage: int = 2  # 1: optimizer state, 2: + gradients, 3: + parameters sharded
    offload_optimizer: Offload = Offload.none
    offload_param: Offload = Offload.none  # stage 3 only
    nvme_path: Optional[str] = None  # directory for nvme offload
    extra: Dict[str, Any] = field(default_factory=dict)  # raw DeepSpeed keys, merged last
    # also write DeepSpeed's own save_checkpoint files into every checkpoint (same manifest
    # and tiers), and restore through load_checkpoint at the same world size and stage
    native_checkpoint: bool = False


@dataclass
class ParallelConfig:
    """Distribution strategy, the layout of the world, and the process group it runs on.

    The world splits as ``dp_replicate x dp_shard x tp`` (x ``pp``); ``dp_shard``
    is whatever is left of the world size.  ``tp > 1``, ``dp_replicate > 1``
    (HSDP: replicate across groups, shard within) and the memory/speed options
    need ``strategy: fsdp``.  ``pp > 1`` splits the blocks into pipeline stages
    (``strategy: ddp`` or ``fsdp`` over each stage's data-parallel group).
    ``ep > 1`` shards the experts of an MoE model over groups of ``ep``
    consecutive data-parallel ranks (tokens exchanged all-to-all; ``strategy:
    ddp`` or ``fsdp``, any ``tp`` and ``pp``; no ``dp_replicate``).
    """

    strategy: StrategyName = StrategyName("ddp")
    backend: Backend = Backend.auto
    timeout_s: float = positive(120.0)
    mixed_precision: MixedPrecision = MixedPrecision.auto
    tp: int = 1  # tensor-parallel degree (consecutive ranks, keep it within a node)
    # with tp > 1: the residual stream, LayerNorms and embeddings split along the sequence
    sequence_parallel: bool = False
    dp_replicate: int = 1  # HSDP replica groups; dp_shard = world / (dp_replicate x tp x pp)
    pp: int = 1  # pipeline stages (blocks split by layer count; strategy ddp or fsdp)
    # each micro-batch of the schedule holds data.micro_batch_size samples
    pp_schedule: PipelineSchedule = PipelineSchedule("1f1b")
    ep: int = 1  # expert-parallel degree: MoE experts sharded over ep data-parallel ranks
    activation_checkpointing: bool = False  # recompute each block's activations in backward
    cpu_offload: bool = False  # FSDP CPUOffloadPolicy: sharded params/grads/optimizer on host
    compile: bool = False  # torch.compile each transformer block
    zero: ZeroConfig = field(default_factory=ZeroConfig)  # strategy: zero


@dataclass
class S3Config:
    """The S3 tier; ``uri: null`` disables it.  Credentials come from the boto3 chain."""

    uri: Optional[str] = None  # s3://bucket/prefix
    endpoint_url: Optional[str] = None  # MinIO, COS, OSS, moto, ...
    region: Optional[str] = None
    part_size_mb: int = positive(16)
    max_concurrency: int = positive(8)
    max_attempts: int = positive(5)
    retry_backoff_s: float = at_least(0, 1.0)


@dataclass
class CheckpointConfig:
    """When and where checkpoints are written, and how a run resumes.

    A checkpoint is written to the fastest tier, then persisted down the others
    in the background: the Ray object store (``memory``, replicated on a second
    node), local disk (``dir``, on each node) and S3 (``s3.uri``).
    Saves trigger every ``every_steps`` steps and/or every ``every_seconds``
    seconds (``null`` disables either), on demand, and on preemption.
    """

    enabled: bool = True
    memory: Optional[bool] = None  # Ray object store tier; null = on when >1 node
    keep_in_memory: int = positive(2)
    dir: str = "${run.output_dir}/${run.name}/checkpoints"
    local: bool = True
    s3: S3Config = field(default_factory=S3Config)
    every_steps: Optional[int] = positive(None, null="disabled")
    every_seconds: Optional[float] = positive(600.0, null="disabled")
    # without every_steps, the first time-based save comes this soon (a run that dies whole
    # early loses at most this, not every_seconds); about what a restart costs anyway
    first_save_after_s: Optional[float] = positive(60.0, null="every_seconds")
    save_final: bool = True
    # also save every step to the memory tier alone (a copy on a second node); a step waits
    # for the last save to persist: a sharded layout that loses a node redoes <= 1 step
    snapshot_every_step: bool = False
    async_save: bool = True
    write_threads: int = positive(2)  # DCP writer threads per rank (2 doubles write bandwidth here)
    # restore: checksum chunks verified and items loaded at once, per rank
    read_threads: int = positive(4)
    recycle_files: bool = True  # a deleted local step's data files are reused by the next save
    checksum_chunk_kb: int = positive(8192)  # granularity of verified ranged reads from S3
    on_busy: OnBusy = OnBusy.skip
    keep_last: int = positive(3)
    resume: str = "auto"  # auto (newest committed, if any) | never | a step-<N> path or URI
    preemption_grace_s: float = positive(30.0)  # SIGTERM -> emergency checkpoint within this budget
    timeout_s: float = positive(600.0)


@dataclass
class ElasticConfig:
    """How the controller watches and recovers the run.

    After a worker or node failure the group is re-formed with as many workers
    as fit within ``scaling.min_workers..max_workers`` and resumes from the
    newest committed checkpoint, up to ``max_failures`` times (-1: unlimited).
    After a failure the group is re-formed in place instead whenever a process
    survived: surviving processes (their collectives raised when the peer vanished)
    are kept; a lost rank whose node is alive gets a new process in its slot (or a
    warm spare takes its place), one whose node died is left out (the group
    shrinks, within min..max).  A spare waits in a lost node's slot and joins at a
    step boundary once Ray re-places the slot (the group grows back).  With DDP the
    new group takes the survivors' state, with no checkpoint read.
    """

    # how often the controller takes rank 0's records and checks notices; a failed rank is
    # seen at once, whatever this is.  Each poll is a call into a rank: at 0.2 s the
    # driver's polling cost the 2-CPU-rank reference about 1% of its step time
    poll_interval_s: float = positive(1.0)
    # recover by default, a bounded number of times: a crash loop still ends the run
    max_failures: int = minus_one_or_more(3)
    # hung: no step for max(hang_factor x median step, hang_floor_s)
    hang_factor: float = positive(20.0)
    hang_floor_s: float = positive(120.0)
    # below min_workers: wait this long for nodes, then fail
    wait_for_capacity_s: float = at_least(0, 300.0)
    # how often a running group below max_workers looks for capacity
    grow_check_s: float = positive(2.0)
    # extra capacity must be seen this long before growing ...
    grow_stable_s: float = at_least(0, 10.0)
    # ... and this long after the last re-form (hysteresis)
    resize_cooldown_s: float = at_least(0, 60.0)
    # preemptions (SIGTERM, drain) survived by shrinking; -1: unlimited
    max_preemptions: int = minus_one_or_more(-1)
    # after a preemption below min_workers: wait, then stop
    preemption_wait_s: float = at_least(0, 0.0)
    reuse_survivors: bool = True  # after a failure, keep the processes whose collectives failed
    # ... if they return within this long (else: restart them all)
    reuse_wait_s: float = at_least(0, 5.0)
    # wait up to this long for Ray's verdict on a lost process: died on a live node
    # (a new process takes its slot) or its node died (the group goes on without it)
    fate_wait_s: float = at_least(0, 10.0)
    # a replicated layout (DDP) takes the survivors' in-memory state after a re-form in
    # place (no checkpoint read, no step redone); false: restore the newest checkpoint
    state_from_peers: bool = True
    # a process lost on a live node: false = wait for its replacement (same size, same
    # numerics); true = go on without it at once, and let the replacement join at a step
    # boundary once warm (below min_workers it is always waited for)
    replace_in_background: bool = False
    # warm standby processes placed with the gang (each holds a slot)
    spare_workers: int = at_least(0, 0)
    # keep one idle worker process per node of the gang in Ray's worker pool, torch
    # imported, for a replacement to take instead of starting one (no slot, CPU or GPU
    # held; about 300 MB of host memory per node)
    prestart_processes: bool = True


@dataclass
class ChaosConfig:
    """Fault injection for rehearsals and tests; everything is off by default."""

    stall_save_s: float = at_least(0, 0.0)  # hold each checkpoint between writing and committing it
    kill_rank: int = minus_one_or_more(-1)  # this rank's process exits abruptly ...
    kill_at_step: int = at_least(0, 0)  # ... right after this step (first attempt only)
    hang_rank: int = minus_one_or_more(-1)  # this rank stops making progress ...
    hang_at_step: int = at_least(0, 0)  # ... right after this step (first attempt only)
    # faults fire on the first this-many attempts (2: back-to-back failures)
    attempts: int = positive(1)
    # chaos.kill_rank also dies right after the first re-form's restore
    kill_during_recovery: bool = False
    nan_rank: int = minus_one_or_more(-1)  # this rank's loss becomes NaN ...
    nan_at_step: int = at_least(0, 0)  # ... at this step (first attempt only)
    slow_rank: int = minus_one_or_more(-1)  # this rank sleeps ...
    slow_s: float = at_least(0, 0.0)  # ... this long in every step (a straggler)


@dataclass
class GuardsConfig:
    """In-run guards, on by default.

    A rank whose compute time per step exceeds ``straggler_factor`` x the median
    of all ranks for ``straggler_window`` consecutive steps is reported (and
    evicted by the elastic controller when ``evict_stragglers``).  A non-finite
    loss or gradient norm is handled by ``nan_policy``: ``skip_step`` (no update,
    the batch is consumed), ``rollback`` (restore the last checkpoint and skip the
    offending batch) or ``fail``.  When the controller declares a hang, Python
    stacks of every worker go to ``<run_dir>/hang-stacks/``.
    """

    straggler_factor: float = positive(1.5)
    straggler_window: int = positive(20)
    evict_stragglers: bool = False
    nan_policy: NanPolicy = NanPolicy.skip_step
    max_nan_steps: int = at_least(0, 10)  # more non-finite steps than this in one run: fail
    hang_stacks: bool = True


@dataclass
class ProfileConfig:
    """torch.profiler traces (Chrome trace format, open in Perfetto) for a step range.

    ``steps: [a, b]`` records steps a..b inclusive on the ``ranks`` listed;
    an empty list disables profiling.
    """

    steps: List[int] = field(default_factory=list)
    ranks: List[int] = field(default_factory=lambda: [0])
    dir: str = "${run.output_dir}/${run.name}/profile"
    record_shapes: bool = False
    with_stack: bool = False


@dataclass
class DPOConfig:
    """``objective.name: dpo``: the sigmoid loss of Rafailov et al. (2023) against a frozen
    reference (the starting weights), whose log-probs are computed in a first pass."""

    beta: float = positive(0.1)
    label_smoothing: float = within(0, 0.5, 0.0, hi_open=True)


@dataclass
class ObjectiveConfig:
    """How a batch and the model's output become the loss.

    ``causal_lm`` (next-token loss on every target), ``sft`` (loss on response tokens
    only; needs ``data.format: chat``), ``dpo`` (needs ``data.format: preference``) or
    ``user``: ``fn: "pkg.module:loss"`` taking ``(logits, batch)`` and returning the sum
    of its per-token losses (the loop averages over the global batch's target weight).
    ``name: null`` (the default) follows what is given: ``user`` with ``fn`` or a loss
    function from Python, else the format's objective (chat: sft, preference: dpo,
    tokens and text: causal_lm); see :func:`raytrain_ext.objectives.objective_name`.
    """

    name: Optional[ObjectiveName] = None
    fn: Optional[str] = None
    dpo: DPOConfig = field(default_factory=DPOConfig)


@dataclass
class EvalConfig:
    """Evaluation every ``every_steps`` steps (null: never) on ``data.eval_path`` or on the
    last ``fraction`` of the samples, which are then held out of training.  Evaluation
    never changes the training order or the sample ledger."""

    every_steps: Optional[int] = positive(None, null="disabled")
    fraction: float = within(0, 0.5, 0.0, hi_open=True)
    max_samples: Optional[int] = positive(None, null="all")  # cap per evaluation


@dataclass
class TrainConfig:
    """The whole run configuration: every section a run needs."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    chaos: ChaosConfig = field(default_factory=ChaosConfig)
    guards: GuardsConfig = field(default_factory=GuardsConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
