"""Bytes per GPU (and per host) of one training layout: model states and activations.

Model states, mixed-precision Adam (Rajbhandari et al. 2020, "ZeRO", K=12):
bf16 parameters 2 B + bf16 gradients 2 B + optimizer states 12 B (fp32 master
weights 4, Adam m 4, Adam v 4) = 16 bytes per parameter.  With ``N`` ranks in
the data-parallel shard group, ZeRO stage 1 divides the optimizer by ``N``
(``2Ψ + 2Ψ + 12Ψ/N``), stage 2 also the gradients (``2Ψ + 14Ψ/N``), stage 3
and FSDP also the parameters (``16Ψ/N``).  FSDP2 with a bf16 compute dtype
keeps fp32 shards of parameters and gradients plus Adam m, v (4+4+8): the
same 16 bytes, split differently.  Pure fp32 training: 4 + 4 + 8 (m, v; no
master copy) = 16 bytes.  Tensor and pipeline parallelism divide every
state by ``tp*pp``; expert parallelism divides the expert weights by ``ep``,
whose optimizer is then sharded over the ``dp/ep`` expert-data-parallel ranks.
Stage 3 additionally holds the unit being computed unsharded: its parameters
and gradients in the working precision (``gathered``).

DeepSpeed accounting (``engine="deepspeed"``), chosen for the ZeRO rows because
that is what DeepSpeed allocates, agrees with DeepSpeed 0.19's
``estimate_zero2_model_states_mem_needs`` and ``estimate_zero3_model_states_mem_needs``
(the functions behind the ``*_all_cold`` printers) term by term:

* DeepSpeed also keeps an fp32 gradient partition (4 B/param / N) next to the
  optimizer partition: ZeRO-2 is ``2Ψ + 18Ψ/N``, not the paper's ``2Ψ + 14Ψ/N``;
  under ZeRO-3 it counts 18 B/param / N, with no persistent bf16 gradient shard.
* ZeRO-3's gathered working set is ``4 B x largest module`` (bf16 weight + grad).
* Host memory: offloaded optimizer partitions (16 B/param incl. the fp32
  gradient, +2 for offloaded bf16 params) summed over the node's ranks, or the
  fp32 model each rank builds on the CPU before sharding (4 B/param x ranks per
  node; 4 B x largest module with meta-device init = DeepSpeed's ``zero_init``),
  whichever is larger, times ``buffer_factor`` (DeepSpeed default 1.5).  With
  offload and ``zero_init`` DeepSpeed counts only the offloaded states and
  drops the init term; the ``offload`` figure of :func:`host_bytes_per_node`
  is the one comparable there.
* Not comparable: DeepSpeed's ZeRO-2 offload host estimate does not divide the
  offloaded states by the node count and uses ``4 B x all GPUs`` (not per node)
  for model init, so for more than one node it exceeds ours; we divide, as ZeRO
  partitions across all ranks.  DeepSpeed estimates no activations, no
  communication buckets and no CUDA context; we add activations and leave the
  rest to the headroom fraction of the planner.

Activations follow Korthikanti et al. 2022, "Reducing Activation Recomputation
in Large Transformer Models", per layer and micro-batch, 16-bit:
``s*b*h*(34 + 5*a*s/h)`` bytes: attention 11sbh + 5as²b, two LayerNorm inputs
4sbh, MLP 19sbh (generalised to ``(3 + 4r) sbh`` for MLP ratio ``r``; a
top-k MoE stores ``(3 + k(2 + 4r)) sbh``: each routed copy keeps its input and
GELU input/output).  ``F.scaled_dot_product_attention`` (flash/memory-efficient
kernels) never stores the ``a*s²`` score matrices, so the ``5as²b`` term is
dropped unless ``flash_attention=False``.  Tensor parallelism with sequence
parallelism divides everything by ``tp``.  Full activation checkpointing keeps
only each layer's input, ``2sbh/tp``, plus one layer's full activations while
it is recomputed.  Under 1F1B the first pipeline stage holds ``pp``
micro-batches of ``L/pp`` layers, i.e. as much as the whole model for one
micro-batch: pipeline parallelism does not shrink peak activations.  The last
stage adds the logits, ``s*b*V*(2 + 4)/tp`` (bf16 logits + fp32 log-softmax).
fp32 training doubles the 2-byte terms (approximated as 2x everything).
"""

from __future__ import annotations

from dataclasses import dataclass

from raytrain_ext.ops.plan.shape import ModelShape, ParamCounts

ENGINES = ("pytorch", "deepspeed")


@dataclass(frozen=True)
class BytesPerParam:
    """State bytes per parameter; ``grad_fp32`` is DeepSpeed's extra fp32 gradient partition."""

    param: float
    grad: float
    optimizer: float
    grad_fp32: float = 0.0
    grad_shard_in_stage3: bool = True

    @property
    def total(self) -> float:
        return self.param + self.grad + self.optimizer + self.grad_fp32


def bytes_per_param(precision: str, engine: str) -> BytesPerParam:
    if precision == "fp32":
        return BytesPerParam(param=4, grad=4, optimizer=8)
    if engine == "deepspeed":
        return BytesPerParam(param=2, grad=2, optimizer=12, grad_fp32=4, grad_shard_in_stage3=False)
    return BytesPerParam(param=2, grad=2, optimizer=12)


@dataclass(frozen=True)
class Layout:
    """One way to place the model on ``dp*tp*pp`` GPUs.

    ``zero_stage`` applies to the data-parallel dimension (0 = DDP, 1 = sharded
    optimizer as Megatron's distributed optimizer, 3 = ZeRO-3/FSDP);
    ``shard_group`` is how many data-parallel ranks one shard spans (``dp``,
    or the GPUs of one node for HSDP); ``ep`` ranks are carved out of ``dp``.
    """

    name: str
    dp: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    zero_stage: int = 0
    shard_group: int = 0
    offload_optimizer: bool = False
    offload_params: bool = False
    engine: str = "pytorch"
    gather_unit: str = "module"  # module: DeepSpeed's largest layer | block: an FSDP unit

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def sharding(self) -> int:
        return self.shard_group or self.dp

    def split(self) -> str:
        parts = [f"TP={self.tp}", f"PP={self.pp}"] + ([f"EP={self.ep}"] if self.ep > 1 else [])
        return " x ".join(parts + [f"DP={self.dp}"])


@dataclass(frozen=True)
class ModelStates:
    """Bytes of model states on one GPU, and what that rank offloads to host RAM."""

    params: float
    grads: float
    optimizer: float
    gathered: float
    host_offload_per_rank: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.gathered


def model_states(counts: ParamCounts, layout: Layout, bpp: BytesPerParam) -> ModelStates:
    """Per-GPU model states of ``layout`` (see the module docstring for the terms)."""
    dense = counts.dense / (layout.tp * layout.pp)
    expert = counts.expert / (layout.tp * layout.pp * layout.ep)
    expert_group = max(1, layout.sharding // layout.ep)

    def elements(sharded: bool) -> float:
        return dense / layout.sharding + expert / expert_group if sharded else dense + expert

    stage = layout.zero_stage
    params = bpp.param * elements(stage >= 3)
    keeps_grad_shard = stage < 3 or bpp.grad_shard_in_stage3
    grads16 = bpp.grad * elements(stage >= 2) if keeps_grad_shard else 0.0
    grads32 = bpp.grad_fp32 * elements(stage >= 1)
    optimizer = bpp.optimizer * elements(stage >= 1)
    unit = counts.largest_fsdp_unit if layout.gather_unit == "block" else counts.largest_module
    gathered = (bpp.param + bpp.grad) * unit / layout.tp if stage >= 3 else 0.0
    host = 0.0
    if layout.offload_optimizer:
        host += optimizer + (grads32 or bpp.grad * elements(True))
        optimizer = grads32 = 0.0
        if stage >= 2:
            grads16 = 0.0
    if layout.offload_params:
        host += params
        params = 0.0
    return ModelStates(
        params=params,
        grads=grads16 + grads32,
        optimizer=optimizer,
        gathered=gathered,
        host_offload_per_rank=host,
    )


def host_bytes_per_node(
    states: ModelStates,
    counts: ParamCounts,
    ranks_per_node: int,
    meta_init: bool,
    buffer_factor: float,
) -> dict:
    """Host RAM one node needs: offloaded states, and the fp32 model each rank builds first.

    ``raytrain_ext.models.build_model`` materialises the full fp32 model on the
    CPU in every rank (``meta_init=False``); meta-device/deferred init keeps
    only the largest module at a time.
    """
    offload = states.host_offload_per_rank * ranks_per_node
    init = 4 * (counts.largest_module if meta_init else counts.total) * ranks_per_node
    return {
        "offload": offload * buffer_factor,
        "model_init": init * buffer_factor,
        "total": max(offload, init) * buffer_factor,
    }


@dataclass(frozen=True)
class Activations:
    """Activation bytes on the busiest GPU for one micro-batch in flight per stage."""

    per_layer: float
    stored_layers: float
    recompute_working: float
    logits: float

    @property
    def total(self) -> float:
        return self.stored_layers + self.recompute_working + self.logits


def layer_activation_bytes(
    shape: ModelShape,
    micro_batch: int,
    seq_len: int,
    tp: int,
    precision: str = "bf16",
    flash_attention: bool = True,
) -> float:
    """Korthikanti et al. per-layer activations, generalised to MLP ratio and top-k MoE."""
    s, b, h, a, r = seq_len, micro_batch, shape.d_model, shape.n_heads, shape.mlp_ratio
    sbh = s * b * h
    attention = 11 * sbh + (0 if flash_attention else 5 * a * s * s * b)
    mlp = (3 + shape.top_k * (2 + 4 * r)) * sbh if shape.is_moe else (3 + 4 * r) * sbh
    scale = 2 if precision == "fp32" else 1
    return scale * (attention + 4 * sbh + mlp) / tp


def activations(
    shape: ModelShape,
    micro_batch: int,
    seq_len: int,
    tp: int,
    pp: int,
    recompute: bool,
    precision: str = "bf16",
    flash_attention: bool = True,
) -> Activations:
    """Peak over pipeline stages: the first holds ``L`` layers' worth (1F1B), the last the logits."""
    per_layer = layer_activation_bytes(shape, micro_batch, seq_len, tp, precision, flash_attention)
    word = 4 if precision == "fp32" else 2
    stored_per_layer = word * seq_len * micro_batch * shape.d_model / tp if recompute else per_layer
    working = per_layer if recompute else 0.0
    logits = seq_len * micro_batch * shape.vocab_size * (word + 4) / tp
    first_stage = shape.n_layers * stored_per_layer
    last_stage = (shape.n_layers / pp) * stored_per_layer + logits
    if pp == 1 or first_stage > last_stage:
        stored, logits_on_peak = first_stage, (logits if pp == 1 else 0.0)
    else:
        stored, logits_on_peak = (shape.n_layers / pp) * stored_per_layer, logits
    return Activations(
        per_layer=per_layer, stored_layers=stored, recompute_working=working, logits=logits_on_peak
    )
