"""Expert parallelism (``parallel.ep``): layout checks, and ep=2 against DDP of the same MoE.

Tolerance: ep=2 computes exactly what DDP computes on the unsharded model
(routing, capacity and the combine stay on the token's rank); only float32
summation order differs (expert matmuls over rows from both ranks, expert
grads summed by an all-reduce of partial sums instead of inside one backward,
the clip norm from per-rank partial squares).  As in test_training_math.py,
that is ~1e-7 relative per step, and AdamW moves a parameter by at most ~lr =
3e-3 per step, so ``ATOL = 1e-5`` after 8 steps is 300x tighter than one update.
"""

import pytest

from raytrain_ext.config import ConfigError, load_config
from raytrain_ext.config.validate import validate
from raytrain_ext.parallel.dims import ParallelDims, ParallelLayoutError, check_batch_split
from raytrain_ext.parallel.ep_shards import expert_group_ranks, group_ranks, owned_experts
from tests.helpers.dist import train_processes

MOE = [
    "run.max_steps=8",
    "data.global_batch_size=12",
    "data.micro_batch_size=2",
    "model.moe.num_experts=4",
    "model.moe.top_k=2",
]
ATOL = 1e-5
LOSS_ATOL = 1e-5


def max_param_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def assert_curves_match(ddp, run):
    """Every step's loss, pre-clip grad norm and expert load on rank 0 equal DDP's."""
    for a, b in zip(ddp[0]["records"], run[0]["records"], strict=False):
        assert abs(a["loss"] - b["loss"]) < LOSS_ATOL
        assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-4 * max(1.0, a["grad_norm"])
        assert a["expert_load"] == pytest.approx(b["expert_load"], abs=1e-6)


def step4_checkpoint(tmp_path):
    """Overrides for a checkpoint every 4 steps under ``tmp_path / 'ckpt'``."""
    return [
        "checkpoint.enabled=true",
        "checkpoint.every_steps=4",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
    ]


def layout_matches_ddp_and_resumes_on_one_ddp_rank(ddp, layout, tmp_path):
    """``layout`` on 4 processes: identical replicas, DDP's parameters, curves and samples;
    then steps 5-8 on 1 DDP rank from its step-4 checkpoint, again at DDP's parameters.
    Returns the 1-rank run."""
    ckpt = step4_checkpoint(tmp_path)
    run = train_processes(4, MOE + layout + ckpt, tmp_path / "layout")
    assert len({r["result"]["params_sha256"] for r in run}) == 1
    assert max_param_diff(ddp[0]["params"], run[0]["params"]) < ATOL
    assert_curves_match(ddp, run)
    assert run[0]["result"]["samples_digest"] == ddp[0]["result"]["samples_digest"]

    resumed = train_processes(
        1,
        [
            *MOE,
            *ckpt[:2],
            f"checkpoint.resume={tmp_path / 'ckpt'}/step-00000004",
            f"checkpoint.dir={tmp_path / 'ck1'}",
        ],
        tmp_path / "one",
    )
    assert resumed[0]["result"]["restored"]["step"] == 4
    assert max_param_diff(resumed[0]["params"], ddp[0]["params"]) < ATOL
    return resumed


def test_groups_are_consecutive_blocks_and_strided_replicas():
    assert group_ranks(4, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert group_ranks(2, 2) == ([[0, 1]], [[0], [1]])
    assert list(owned_experts(8, 4, 3)) == [6, 7]


def test_under_tp_expert_groups_stay_within_one_tp_coordinate():
    """dp2 x tp2: ranks 0, 2 share TP coordinate 0 (see the same tokens as 1, 3 do), so they
    split the experts between them; ranks 1, 3 likewise."""
    dims = ParallelDims(dp_replicate=1, dp_shard=2, tp=2, ep=2)
    assert expert_group_ranks(dims, 4) == ([[0, 2], [1, 3]], [[0], [2], [1], [3]])
    dims = ParallelDims(dp_replicate=1, dp_shard=4, tp=2, ep=2)
    assert expert_group_ranks(dims, 8) == (
        [[0, 2], [4, 6], [1, 3], [5, 7]],
        [[0, 4], [2, 6], [1, 5], [3, 7]],
    )


def test_dims_accept_ep_dividing_experts_and_dp():
    cfg = load_config(None, ["scaling.num_workers=4", "parallel.ep=2", *MOE[3:]])
    dims = ParallelDims.build(cfg.parallel, cfg.model, 4)
    assert (dims.ep, dims.dp_size) == (2, 4)
    with pytest.raises(
        ParallelLayoutError,
        match=r"parallel\.ep: ep=2 does not divide the "
        r"data-parallel size 3 \(world size 3\)",
    ):
        ParallelDims.build(cfg.parallel, cfg.model, 3)


def test_ranks_need_equal_microbatch_counts_under_ep():
    """Each forward is an all-to-all, so no rank may run one micro-batch more than its peers."""
    dims = ParallelDims(dp_replicate=1, dp_shard=2, tp=1, ep=2)
    check_batch_split("ddp", 8, 2, dims)
    with pytest.raises(
        ParallelLayoutError,
        match=r"data\.global_batch_size: 5 samples over 2 "
        r"data-parallel ranks .* give some ranks 1 and others 2 micro-batches; "
        r"expert parallelism \(all-to-all per forward\) needs the same count",
    ):
        check_batch_split("ddp", 5, 2, dims)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["parallel.ep=3", "scaling.num_workers=3", "data.global_batch_size=6"],
            r"parallel\.ep: model\.moe\.num_experts=4 is not divisible by ep=3 .* Choose ep among 1, 2, 4",
        ),
        (
            ["parallel.ep=4", "scaling.num_workers=2"],
            r"parallel\.ep: ep=4 does not divide the data-parallel size 2 \(world size 2\)",
        ),
        (
            ["parallel.ep=2", "parallel.strategy=zero"],
            r"parallel\.ep: expert parallelism \(ep=2\) is not supported yet with parallel\.strategy=zero",
        ),
        (
            [
                "parallel.ep=2",
                "scaling.num_workers=4",
                "parallel.strategy=fsdp",
                "parallel.dp_replicate=2",
            ],
            r"parallel\.ep: .* not supported yet with parallel\.dp_replicate=2",
        ),
        (
            ["parallel.ep=2", "model.moe.num_experts=0"],
            r"parallel\.ep: expert parallelism \(ep=2\) needs a mixture-of-experts model",
        ),
        (
            ["parallel.ep=2", "scaling.min_workers=2", "scaling.max_workers=5"],
            r"scaling\.max_workers: 5 is not a multiple of dp_replicate x tp x pp x ep = "
            r"1 x 1 x 1 x 2 = 2",
        ),
    ],
)
def test_invalid_expert_layouts_name_the_key(overrides, message):
    base = ["scaling.num_workers=2", "data.micro_batch_size=2", *MOE[3:]]
    with pytest.raises(ConfigError, match=message):
        validate(load_config(None, base + overrides))


@pytest.fixture(scope="module")
def ddp_and_ep(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep")
    return (
        train_processes(2, MOE, root / "ddp"),
        train_processes(2, MOE + ["parallel.ep=2"], root / "ep"),
    )


@pytest.mark.slow
def test_ep2_matches_ddp_of_the_same_moe(ddp_and_ep):
    """The MoE model trains, and its experts sharded over 2 ranks (all_to_all dispatch) reach
    what plain DDP reaches; test_ep2_checkpoint_resumes_on_one_ddp_rank then carries it onto
    1 rank, so MoE also matches across world sizes."""
    ddp, ep = ddp_and_ep
    assert ddp[0]["result"]["final_loss"] < 4.5 < ddp[0]["records"][0]["loss"]
    assert any(".experts.3.w_up" in k for k in ep[0]["params"])  # gathered from rank 1
    assert max_param_diff(ddp[0]["params"], ep[0]["params"]) < ATOL
    assert ep[0]["result"]["params_sha256"] == ep[1]["result"]["params_sha256"]
    assert ep[0]["result"]["samples_digest"] == ddp[0]["result"]["samples_digest"]
    assert_curves_match(ddp, ep)
    assert ep[0]["result"]["final_loss"] < 4.5


@pytest.mark.slow
def test_expert_load_is_reported_per_step_on_rank_zero(ddp_and_ep):
    _, ep = ddp_and_ep
    loads = [r["expert_load"] for r in ep[0]["records"]]
    assert len(loads) == 8 and all(len(load) == 4 for load in loads)
    assert all(sum(load) == pytest.approx(1.0, abs=1e-5) for load in loads)
    assert all(min(load) > 0 for load in loads)
    assert all("expert_load" not in r for r in ep[1]["records"])


@pytest.mark.slow
def test_ep2_checkpoint_resumes_on_one_ddp_rank(ddp_and_ep, tmp_path):
    """Steps 1-4 on 2 ranks with ep=2, then 5-8 on 1 rank (plain DDP) from its checkpoint."""
    _, ep = ddp_and_ep
    ckpt = step4_checkpoint(tmp_path)
    first = train_processes(2, [*MOE, "run.max_steps=4", "parallel.ep=2", *ckpt], tmp_path / "a")
    assert first[0]["result"]["steps"] == 4
    resumed = train_processes(1, [*MOE, *ckpt], tmp_path / "b")
    assert resumed[0]["result"]["restored"]["step"] == 4
    continued = [r["loss"] for r in resumed[0]["records"]]
    reference = [r["loss"] for r in ep[0]["records"][4:]]
    assert continued == pytest.approx(reference, abs=LOSS_ATOL)
    assert max_param_diff(resumed[0]["params"], ep[0]["params"]) < ATOL
    assert resumed[0]["result"]["samples_digest"] == ep[0]["result"]["samples_digest"]


@pytest.mark.slow
def test_moe_under_tp2_matches_ddp_of_the_same_moe(ddp_and_ep, tmp_path):
    """FSDP x TP=2 of the MoE model: attention split over the TP pair, the MoE feed-forward
    whole on both (parallel/tp.py); one data-parallel rank runs all 6 micro-batches, so this
    also crosses world sizes against the 2-rank DDP run. Measured: parameters 1.1e-6, losses
    8e-8, grad norms 9e-8 relative (asserted: ATOL, LOSS_ATOL, 1e-4)."""
    ddp, _ = ddp_and_ep
    tp = train_processes(2, MOE + ["parallel.strategy=fsdp", "parallel.tp=2"], tmp_path)
    assert tp[0]["result"]["params_sha256"] == tp[1]["result"]["params_sha256"]
    assert max_param_diff(ddp[0]["params"], tp[0]["params"]) < ATOL
    assert tp[0]["result"]["samples_digest"] == ddp[0]["result"]["samples_digest"]
    assert_curves_match(ddp, tp)


@pytest.mark.slow
def test_ep2_under_fsdp_x_tp2_matches_ddp_and_resumes_on_one_ddp_rank(ddp_and_ep, tmp_path):
    """dp2 x tp2 with ep=2 on 4 processes: FSDP shards the dense parameters over dp, TP splits
    attention, and each TP coordinate's 2 data-parallel ranks split the experts (all-to-all
    within the line). It reaches the DDP run's parameters, and its step-4 checkpoint carries
    on under 1-rank DDP. Measured: parameters 1.1e-6, losses 8e-8, grad norms 6e-7 relative
    (asserted: ATOL, LOSS_ATOL, 1e-4)."""
    ddp, _ = ddp_and_ep
    layout = ["parallel.strategy=fsdp", "parallel.tp=2", "parallel.ep=2"]
    resumed = layout_matches_ddp_and_resumes_on_one_ddp_rank(ddp, layout, tmp_path)
    assert resumed[0]["result"]["samples_digest"] == ddp[0]["result"]["samples_digest"]


@pytest.mark.slow
def test_moe_in_two_pipeline_stages_matches_ddp_of_the_same_moe(ddp_and_ep, tmp_path):
    """pp=2 of the MoE model on 2 processes (one block per stage, 6 micro-batches through
    1F1B): each stage ties its MoE layer's weighted balance loss to its activations
    (parallel/pp.py AttachAuxLoss), so the update is DDP's; the last stage reports the loss,
    and each stage counts its own layer's expert load. Measured: parameters 7.7e-8, losses
    8e-8, grad norms 1.4e-7 relative, expert loads equal."""
    ddp, _ = ddp_and_ep
    pp = train_processes(2, MOE + ["parallel.pp=2"], tmp_path)
    assert max_param_diff(ddp[0]["params"], pp[0]["params"]) < ATOL
    assert pp[0]["result"]["params_sha256"] == pp[1]["result"]["params_sha256"]
    assert_curves_match(ddp, pp)


@pytest.mark.slow
def test_ep2_in_two_pipeline_stages_matches_ddp_and_resumes_on_one_ddp_rank(ddp_and_ep, tmp_path):
    """pp2 x dp2 with ep=2 on 4 processes: each stage's 2 data-parallel ranks split that
    stage's experts. It reaches the DDP run's parameters, and its step-4 checkpoint (each
    expert written by its owner, whole-model param groups) carries on under 1-rank DDP.
    Measured: parameters 9.0e-7, losses 8e-8, grad norms 7e-8 relative."""
    ddp, _ = ddp_and_ep
    layout_matches_ddp_and_resumes_on_one_ddp_rank(
        ddp, ["parallel.pp=2", "parallel.ep=2"], tmp_path
    )


@pytest.mark.slow
def test_ep2_in_dp2_x_tp2_x_pp2_on_eight_processes_matches_ddp(ddp_and_ep, tmp_path):
    """The 4-D layout: pp2 (one block per stage) x dp2 (FSDP) x tp2 (attention), and each
    stage's experts split over the 2 data-parallel ranks of each TP coordinate (ep=2).
    Measured: parameters 1.1e-6, losses 8e-8, grad norms 4.3e-7 relative, loads equal."""
    ddp, _ = ddp_and_ep
    layout = ["parallel.strategy=fsdp", "parallel.tp=2", "parallel.pp=2", "parallel.ep=2"]
    run = train_processes(8, MOE + layout, tmp_path)
    assert len({r["result"]["params_sha256"] for r in run}) == 1
    assert max_param_diff(ddp[0]["params"], run[0]["params"]) < ATOL
    assert_curves_match(ddp, run)
    assert run[0]["result"]["samples_digest"] == ddp[0]["result"]["samples_digest"]
