"""Parallel layouts: the mesh arithmetic and a clear config error for every layout that cannot work.

Pure: no process group is formed; invalid layouts fail in ``load_config`` on the
driver, before any worker starts.
"""

import pytest
import torch

from raytrain_ext.config import ConfigError, load_config
from raytrain_ext.parallel import DistContext, ParallelDims, ParallelLayoutError, dims_for_run
from raytrain_ext.parallel.dims import microbatch_counts

FSDP = "parallel.strategy=fsdp"


def test_world_splits_into_replicate_shard_and_tp():
    cfg = load_config(
        None,
        [
            "scaling.num_workers=8",
            FSDP,
            "parallel.tp=2",
            "parallel.dp_replicate=2",
            "data.global_batch_size=16",
        ],
    )
    dims = ParallelDims.build(cfg.parallel, cfg.model, 8)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp) == (2, 2, 2)
    assert dims.dp_size == 4 and dims.world_size == 8
    # row-major over (dp_replicate, dp_shard, tp): TP groups are consecutive ranks
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [dims.tp_rank(r) for r in range(8)] == [0, 1, 0, 1, 0, 1, 0, 1]


def test_pipeline_stages_are_the_outer_mesh_axis():
    cfg = load_config(
        None,
        [
            "scaling.num_workers=4",
            "parallel.pp=2",
            "data.global_batch_size=8",
            "data.micro_batch_size=2",
        ],
    )
    dims = ParallelDims.build(cfg.parallel, cfg.model, 4)
    assert (dims.pp, dims.dp_shard, dims.dp_size, dims.mesh_shape) == (2, 2, 2, (2, 1, 2, 1))
    assert [dims.pp_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert [dims.dp_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert [dims.is_last_stage(r) for r in range(4)] == [False, False, True, True]
    # samples from the first stage, the loss from the last: each counted once per dp group
    ctxs = [DistContext(r, 4, r, torch.device("cpu"), None, dims=dims) for r in range(4)]
    assert [c.counts_samples for c in ctxs] == [True, True, False, False]
    assert [c.counts_loss for c in ctxs] == [False, False, True, True]


def test_context_defaults_to_plain_data_parallel_and_marks_one_counter_per_tp_group():
    ddp = DistContext(
        rank=3, world_size=4, local_rank=3, device=torch.device("cpu"), autocast_dtype=None
    )
    assert (ddp.dp_rank, ddp.dp_size, ddp.counts_samples) == (3, 4, True)
    tp = DistContext(3, 4, 3, torch.device("cpu"), None, dims=ParallelDims(1, 2, 2))
    assert (tp.dp_rank, tp.dp_size, tp.counts_samples) == (1, 2, False)
    with pytest.raises(ValueError, match="describe 4 ranks, but the world size is 2"):
        DistContext(0, 2, 0, torch.device("cpu"), None, dims=ParallelDims(1, 2, 2))


@pytest.mark.parametrize(
    "global_batch,dp,micro,counts",
    [
        (12, 2, 2, {3}),
        (10, 3, 2, {2}),
        (8, 3, 2, {1, 2}),
        (4, 4, 2, {1}),
        (5, 4, 1, {1, 2}),
    ],
)
def test_microbatch_counts(global_batch, dp, micro, counts):
    assert microbatch_counts(global_batch, dp, micro) == counts


def test_valid_tp_and_hsdp_layouts_load():
    cfg = load_config(
        None,
        [
            "scaling.num_workers=4",
            FSDP,
            "parallel.tp=2",
            "data.global_batch_size=8",
            "data.micro_batch_size=2",
        ],
    )
    assert cfg.parallel.tp == 2 and cfg.parallel.strategy == "fsdp"
    cfg = load_config(
        None,
        [
            "scaling.num_workers=4",
            FSDP,
            "parallel.dp_replicate=2",
            "data.global_batch_size=8",
            "data.micro_batch_size=2",
        ],
    )
    assert ParallelDims.build(cfg.parallel, cfg.model, 4).dp_shard == 2


BAD_LAYOUTS = [
    (
        ["scaling.num_workers=4", FSDP, "parallel.tp=3", "model.n_heads=3", "model.d_model=96"],
        r"parallel\.tp: world size 4 is not divisible by dp_replicate x tp x pp = 1 x 3 x 1 = 3 "
        r"\(4 = dp_replicate 1 x dp_shard 1\.33333 x tp 3 x pp 1\?\).*divisors: 1, 2, 4",
    ),
    (
        ["scaling.num_workers=6", "data.global_batch_size=12", FSDP, "parallel.tp=3"],
        r"parallel\.tp: model\.n_heads=4 is not divisible by tp=3 "
        r"\(4 / 3 = 1\.33333 heads per rank\)",
    ),
    (
        ["scaling.num_workers=4", "parallel.tp=2"],
        r"parallel\.tp: tensor parallelism \(tp=2\) needs parallel\.strategy=fsdp \(got 'ddp'",
    ),
    (
        ["scaling.num_workers=4", "parallel.dp_replicate=2"],
        r"parallel\.dp_replicate: HSDP replica groups .* need parallel\.strategy=fsdp",
    ),
    (
        ["parallel.activation_checkpointing=true"],
        r"parallel\.activation_checkpointing: only implemented for parallel\.strategy=fsdp",
    ),
    (
        [FSDP, "parallel.cpu_offload=true"],
        r"parallel\.cpu_offload: offloads GPU parameters .* Set parallel\.cpu_offload=false",
    ),
    (
        [
            "scaling.num_workers=3",
            "parallel.pp=2",
            "data.global_batch_size=6",
            "data.micro_batch_size=1",
        ],
        r"parallel\.tp: world size 3 is not divisible by dp_replicate x tp x pp = 1 x 1 x 2 = 2",
    ),
    (
        ["parallel.strategy=zero", "parallel.ep=2"],
        r"parallel\.ep: expert parallelism \(ep=2\) is not supported yet with parallel\.strategy=zero",
    ),
    (["parallel.tp=0"], r"parallel\.tp: must be >= 1, got 0"),
    (
        [FSDP, "parallel.sequence_parallel=true"],
        r"parallel\.sequence_parallel: not available with parallel\.tp=1 \(needs tp > 1\)",
    ),
    (
        [
            "scaling.num_workers=4",
            FSDP,
            "parallel.tp=2",
            "parallel.sequence_parallel=true",
            "model.moe.num_experts=4",
        ],
        r"parallel\.sequence_parallel: not available with model\.moe\.num_experts=4",
    ),
    (
        ["scaling.num_workers=4", FSDP, "parallel.tp=2", "model.dropout=0.1"],
        r"parallel\.tp: model\.dropout=0\.1 with tp=2 is not supported yet",
    ),
    (
        [
            "scaling.num_workers=4",
            "scaling.min_workers=3",
            FSDP,
            "parallel.tp=2",
            "data.global_batch_size=8",
            "data.micro_batch_size=2",
        ],
        r"scaling\.min_workers: 3 is not a multiple of dp_replicate x tp x pp x ep = "
        r"1 x 2 x 1 x 1 = 2; the world grows and shrinks in whole model-parallel groups",
    ),
    (
        [
            "scaling.num_workers=4",
            FSDP,
            "parallel.tp=2",
            "data.global_batch_size=6",
            "data.micro_batch_size=2",
        ],
        r"data\.global_batch_size: 6 is not a multiple of data\.micro_batch_size x the data-parallel "
        r"size \(scaling\.num_workers / \(parallel\.tp x parallel\.pp\) = 4 / 2\) = 2 x 2 = 4",
    ),
    (
        [
            "scaling.num_workers=2",
            "scaling.max_workers=3",
            FSDP,
            "data.global_batch_size=8",
            "data.micro_batch_size=2",
        ],
        r"data\.global_batch_size: 8 samples over 3 data-parallel ranks \(world 3\) in micro-batches "
        r"of 2 give some ranks 1 and others 2 micro-batches; FSDP needs the same count",
    ),
]


@pytest.mark.parametrize(
    "overrides,message", BAD_LAYOUTS, ids=[" ".join(o) for o, _ in BAD_LAYOUTS]
)
def test_invalid_layouts_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_ddp_accepts_the_uneven_split_that_fsdp_refuses():
    cfg = load_config(
        None,
        [
            "scaling.num_workers=2",
            "scaling.max_workers=3",
            "data.global_batch_size=8",
            "data.micro_batch_size=2",
        ],
    )
    assert cfg.scaling.max_workers == 3


def test_runtime_check_uses_the_actual_world_size():
    """A config valid for 4 workers, run on 3 (as after a resize the config did not allow)."""
    cfg = load_config(
        None,
        [
            "scaling.num_workers=4",
            FSDP,
            "parallel.tp=2",
            "data.global_batch_size=8",
            "data.micro_batch_size=2",
        ],
    )
    assert dims_for_run(cfg, 4).dp_size == 2
    with pytest.raises(
        ParallelLayoutError,
        match=r"world size 3 is not divisible by "
        r"dp_replicate x tp x pp = 1 x 2 x 1 = 2",
    ):
        dims_for_run(cfg, 3)


def test_tp_layouts_may_resize_in_whole_model_parallel_groups():
    """min 2, max 4 with tp=2: the controller may use 2 or 4 workers, never 3."""
    from raytrain_ext.elastic.policy import GrowPolicy, ScalingPolicy
    from raytrain_ext.parallel.dims import allowed_world_sizes, resize_unit

    cfg = load_config(
        None,
        [
            "scaling.num_workers=4",
            "scaling.min_workers=2",
            FSDP,
            "parallel.tp=2",
            "data.global_batch_size=8",
            "data.micro_batch_size=2",
        ],
    )
    assert resize_unit(cfg.parallel) == 2
    assert allowed_world_sizes(cfg.scaling, cfg.parallel) == [2, 4]
    policy = ScalingPolicy(2, 4, unit=2)
    assert policy.decide(3).world_size == 2 and "multiples of 2" in policy.decide(3).reason
    assert policy.decide(1).action == "fail"
    grow = GrowPolicy(max_workers=4, cooldown_s=0.0, stable_s=0.0, unit=2)
    assert grow.observe(10.0, 2, 1, last_reform_at=0.0) is None  # one more worker: not a group
    assert grow.observe(11.0, 2, 2, last_reform_at=0.0) == 4
