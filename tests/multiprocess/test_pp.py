"""Pipeline parallelism (``parallel.pp``) in the real training loop on multi-process gloo.

Every layout trains the same global batches as a 2-rank DDP run, so after 8
steps it must reach DDP's parameters up to float summation order.  Measured
here (max over 8 steps vs DDP): pp=2 GPipe, 1F1B and 1F1B with FSDP stages:
parameters 2.5e-7, loss 7.2e-7, gradient norm 2.7e-6 relative; dp2 x pp2
(FSDP stages, 4 processes): 3.9e-7, 3.3e-6 and 2.7e-5.  So the DDP
tolerances of test_fsdp_tp apply (parameters ``ATOL = 1e-5``, loss 1e-5,
gradient norm 1e-4 relative): a loss counted by two stages (2x), a gradient
norm of one stage only or a sample counted twice fails them.
The checkpoint tests save at step 4 under one layout, resume under the other,
and must reproduce the uninterrupted DDP run's steps 5-8.
"""

import shutil
from pathlib import Path

import pytest
import torch

from raytrain_ext.config import ConfigError, load_config
from raytrain_ext.models import build_model
from raytrain_ext.models.gpt_parallel import GPTStage
from raytrain_ext.models.spec import stage_layers
from raytrain_ext.parallel import ParallelDims
from tests.helpers.layouts import ATOL_UNEVEN, TP_LOSS_ATOL, assert_matches, curve, train

PP2 = ["parallel.pp=2"]


@pytest.fixture()
def ddp(ddp_layout_reference):
    return ddp_layout_reference


@pytest.fixture(scope="module")
def gpipe(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpipe")
    return {"ranks": train(2, tmp, *PP2, "parallel.pp_schedule=gpipe"), "ckpt": tmp / "ckpt"}


def stage_keys(ranks):
    return [set(r["params"]) for r in ranks]


@pytest.mark.slow
def test_gpipe_two_stages_match_ddp(gpipe, ddp):
    assert_matches(gpipe["ranks"], ddp["ranks"])
    losses = curve(gpipe["ranks"][0], "loss")
    assert losses[8] < losses[1] - 1.0 and losses[1] > 5.0  # from ~ln(256) = 5.5


@pytest.mark.slow
def test_1f1b_with_fsdp_stages_matches_ddp(ddp, tmp_path):
    """1F1B, each stage under FSDP2 (the schedule drives its gradient sync)."""
    ranks = train(
        2,
        tmp_path,
        *PP2,
        "parallel.pp_schedule=1f1b",
        "parallel.strategy=fsdp",
        "checkpoint.enabled=false",
    )
    assert_matches(ranks, ddp["ranks"])


@pytest.mark.slow
def test_dp2_x_pp2_matches_ddp(ddp, tmp_path):
    """4 processes: two pipelines of two stages, each stage FSDP-sharded over its dp pair."""
    ranks = train(4, tmp_path, *PP2, "parallel.strategy=fsdp", "checkpoint.enabled=false")
    assert_matches(ranks, ddp["ranks"])
    assert len({r["result"]["params_sha256"] for r in ranks}) == 1


@pytest.mark.slow
def test_dp2_x_tp2_x_pp2_on_eight_processes_matches_ddp(ddp, tmp_path):
    """3-D: two pipelines of two stages, each stage tensor-parallel over a tp pair and
    FSDP-sharded over its dp pair. TP blocks the matmuls differently, so test_fsdp_tp's TP
    tolerances apply (measured: parameters 5.4e-6, loss 1.3e-5, gradient norm 8e-6 relative)."""
    ranks = train(
        8, tmp_path, *PP2, "parallel.tp=2", "parallel.strategy=fsdp", "checkpoint.enabled=false"
    )
    assert_matches(ranks, ddp["ranks"], ATOL_UNEVEN, TP_LOSS_ATOL)


@pytest.mark.slow
def test_pp_checkpoint_resumes_on_ddp(gpipe, ddp, tmp_path):
    """Each stage saved its own keys at step 4; two DDP replicas load the whole model."""
    resumed = resume_from(gpipe["ckpt"], tmp_path, 2)
    assert resumed[0]["result"]["restored"]["saved_world_size"] == 2
    assert_matches(resumed, ddp["ranks"])


@pytest.mark.slow
def test_ddp_checkpoint_resumes_as_two_stages(ddp, tmp_path):
    """A DDP checkpoint, each stage loading only its own keys (and optimizer state)."""
    resumed = resume_from(ddp["ckpt"], tmp_path, 2, *PP2)
    assert_matches(resumed, ddp["ranks"])


def resume_from(ckpt: Path, tmp: Path, world: int, *extra):
    shutil.copytree(ckpt / "step-00000004", tmp / "ckpt" / "step-00000004")
    resumed = train(world, tmp, *extra)
    assert resumed[0]["result"]["restored"]["step"] == 4
    assert min(curve(resumed[0], "loss")) == 5  # trained steps 5..8 only
    return resumed


@pytest.mark.parametrize(
    "n_layers,pp,sizes", [(4, 2, [2, 2]), (5, 2, [3, 2]), (7, 3, [3, 2, 2]), (3, 3, [1, 1, 1])]
)
def test_blocks_split_contiguously_earlier_stages_take_the_remainder(n_layers, pp, sizes):
    split = stage_layers(n_layers, pp)
    assert [len(r) for r in split] == sizes
    assert [i for r in split for i in r] == list(range(n_layers))


def test_stages_keep_the_gpt_parameter_names_and_compute_its_logits():
    model_cfg = load_config(None, ["model.n_layers=3"]).model
    model = build_model(model_cfg, 7)
    stages = [GPTStage(model, s, 2) for s in range(2)]
    names = [[n for n, _ in stage.named_parameters()] for stage in stages]
    assert names[0] + names[1] == [n for n, _ in model.named_parameters()]
    assert "blocks.2.attn.wq.weight" in names[1] and "tok_emb.weight" in names[0]
    tokens = torch.randint(
        0, model_cfg.vocab_size, (2, model_cfg.seq_len), generator=torch.Generator().manual_seed(0)
    )
    assert torch.equal(stages[1](stages[0](tokens)), model(tokens))


def test_pp_layout_ranks_stage_major():
    """(pp, dp_replicate, dp_shard, tp) row-major: stage 0 is ranks 0..3 of 8."""
    cfg = load_config(
        None,
        [
            "scaling.num_workers=8",
            "parallel.strategy=fsdp",
            "parallel.pp=2",
            "parallel.tp=2",
            "data.global_batch_size=8",
            "data.micro_batch_size=2",
        ],
    )
    dims = ParallelDims.build(cfg.parallel, cfg.model, 8)
    assert (dims.pp, dims.dp_shard, dims.tp, dims.dp_size) == (2, 2, 2, 2)
    assert [dims.pp_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [dims.tp_rank(r) for r in range(8)] == [0, 1] * 4
    assert dims.mesh_shape == (2, 1, 2, 2)


BAD_PP = [
    (
        ["scaling.num_workers=2", "parallel.pp=2", "parallel.pp_schedule=zb"],
        r"parallel\.pp_schedule: 'zb' is not one of gpipe, 1f1b",
    ),
    (
        ["scaling.num_workers=2", "parallel.pp=2", "parallel.strategy=zero"],
        r"parallel\.pp: pipeline parallelism \(pp=2\) .*parallel\.strategy.*zero",
    ),
    (
        ["scaling.num_workers=4", "parallel.pp=4", "model.n_layers=3"],
        r"parallel\.pp: model\.n_layers=3 cannot fill pp=4 stages.*Choose pp <= 3",
    ),
    (
        [
            "scaling.num_workers=4",
            "parallel.pp=4",
            "data.global_batch_size=8",
            "data.micro_batch_size=4",
        ],
        r"data\.global_batch_size: 8 samples over 1 data-parallel ranks in micro-batches of 4 give "
        r"2 micro-batches per step, fewer than the pp=4 stages parallel\.pp_schedule=1f1b needs",
    ),
    (
        [
            "scaling.num_workers=4",
            "scaling.min_workers=1",
            "parallel.pp=2",
            "data.global_batch_size=8",
            "data.micro_batch_size=2",
        ],
        r"scaling\.min_workers: 1 is not a multiple of dp_replicate x tp x pp x ep = 1 x 1 x 2 x 1",
    ),
]


@pytest.mark.parametrize("overrides,message", BAD_PP, ids=[" ".join(o) for o, _ in BAD_PP])
def test_invalid_pipeline_layouts_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_gpipe_accepts_fewer_micro_batches_than_stages():
    cfg = load_config(
        None,
        [
            "scaling.num_workers=4",
            "parallel.pp=4",
            "data.global_batch_size=8",
            "data.micro_batch_size=4",
            "parallel.pp_schedule=gpipe",
        ],
    )
    assert cfg.parallel.pp == 4
