"""The user's model on gloo processes: a Hugging Face Llama (2 layers, hidden 64, 4 heads, 2 KV
heads, vocabulary 512) from pretrained weights under every layout, each against 2-rank DDP; a
pretrained model placed by a sharding strategy from a meta-device build; a Qwen2 from an inline
architecture under FSDP; the user's own nn.Module under FSDP; and a checkpoint of a sharded layout
exported to a directory ``from_pretrained`` loads.

Tolerances (every layout trains the same samples from the same weights; only the order of float32
additions differs, u = 2^-24 = 5.96e-8 the unit roundoff):

- ``LOSS_ATOL``.  A step's loss is the mean of N = 4 x 64 = 256 token losses, each at most
  ln(512) + 0.1 = 6.3 in these first steps.  Layouts add them in other orders (per micro-batch,
  then over 2 or 4 ranks or pipeline stages); a sum of N non-negative terms in any order is off
  by at most (N - 1) u sum(l), i.e. the mean by 255 x 5.96e-8 x 6.3 = 9.6e-5.  Under TP each
  token's logits also come from dot products over K <= 128 terms cut into tp partial sums: off
  by at most K u sum|x y| ~ 128 x 5.96e-8 x 1 = 7.6e-6 for logits of size ~1 (init std 0.02),
  which moves a token's log-softmax by at most twice that, 1.5e-5.  So the first step may differ
  by 1.1e-4; later steps add what the parameters drifted (below), and ``LOSS_ATOL = 2e-4``.
- parameters: ``ATOL_UNEVEN = 1e-4`` (tests/helpers/layouts.py, derived in
  multiprocess/test_training_math.py): AdamW's normalisation amplifies the summation noise only
  on gradients near ``eps``, far below one lr = 3e-3 update, so a wrong or missing gradient fails.
- a pretrained model placed by FSDP/TP holds the file's bytes exactly (a copy, no arithmetic);
  its logits equal ``transformers``' own within the TP summation bound above (``LOGITS_ATOL``).
"""

from __future__ import annotations

import pytest
import torch

from raytrain_ext.config import load_config, to_yaml
from raytrain_ext.data import GlobalSampler, open_token_dataset
from raytrain_ext.ops.export_hf import export_hf
from tests.helpers.dist import train_processes
from tests.helpers.hf_models import hf_overrides, place_from_files, probe_ids, save_tiny
from tests.helpers.layouts import ATOL_UNEVEN, max_param_diff

pytest.importorskip("transformers")

STEPS = [
    "run.max_steps=4",
    "data.global_batch_size=4",
    "data.micro_batch_size=2",
    "optim.warmup_steps=1",
]
LOSS_ATOL = 2e-4  # module doc: 9.6e-5 (loss sum) + 1.5e-5 (TP logits) at step 1, plus drift
LOGITS_ATOL = 2e-5  # module doc: K u sum|x y| = 7.6e-6 per logit, with room for two layers
FSDP = "parallel.strategy=fsdp"
SEQUENCE_PARALLEL = "parallel.sequence_parallel=true"
ONE_SAMPLE_MICRO_BATCHES = "data.micro_batch_size=1"  # 4 ranks share a global batch of 4


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def ddp(llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf-ddp")
    return train_processes(2, [*hf_overrides(llama_dir), *STEPS, "checkpoint.enabled=false"], tmp)


@pytest.mark.slow
def test_pretrained_weights_are_where_training_starts(llama_dir, ddp):
    """Step 1's loss (2 ranks, 2 micro-batches each) equals ``transformers``' own forward of
    the ``save_pretrained`` directory on step 1's global batch, within the summation bound of
    the module doc (``LOSS_ATOL``'s first-step share, 9.6e-5: same weights, same tokens, the
    256 token losses added in another order); both ranks hold the same model after every step."""
    from transformers import AutoModelForCausalLM

    cfg = load_config(None, [*hf_overrides(llama_dir), *STEPS])
    d = cfg.data
    data = open_token_dataset(d.path, cfg.model.seq_len)
    first = GlobalSampler(data.num_samples, d.global_batch_size, d.seed, d.shuffle)
    batch = data.batch(first.next_global_batch())
    model = AutoModelForCausalLM.from_pretrained(str(llama_dir)).eval()
    with torch.no_grad():
        logits = model(input_ids=batch.inputs).logits
    theirs = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.targets.flatten())
    assert ddp[0]["records"][0]["loss"] == pytest.approx(float(theirs), abs=1e-4)
    assert ddp[0]["result"]["params_sha256"] == ddp[1]["result"]["params_sha256"]
    assert ddp[0]["records"][-1]["loss"] < ddp[0]["records"][0]["loss"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "world,layout",
    [
        (4, [FSDP, "parallel.dp_replicate=2", ONE_SAMPLE_MICRO_BATCHES]),
        (2, [FSDP, "parallel.tp=2"]),
        (2, [FSDP, "parallel.tp=2", SEQUENCE_PARALLEL]),
        (4, [FSDP, "parallel.tp=2", SEQUENCE_PARALLEL, ONE_SAMPLE_MICRO_BATCHES]),
        (2, ["parallel.pp=2"]),
        (2, ["parallel.strategy=zero", "parallel.zero.stage=3"]),
    ],
    ids=["hsdp-2x2", "tp2", "tp2-sequence-parallel", "2d-fsdp2-x-tp2-sp", "pp2", "zero3"],
)
def test_every_layout_of_a_pretrained_llama_matches_ddp(llama_dir, ddp, tmp_path, world, layout):
    """Same parameters, loss curve and samples as DDP.  FSDP2's sharding runs in the HSDP
    (2 replicas x dp_shard=2) and 2-D (dp_shard=2 x tp=2) cases.  The FSDP layouts build the
    pretrained model on the meta device and load it after sharding; DDP, PP and ZeRO-3 build it
    whole on the CPU: the results are the same."""
    ranks = train_processes(
        world, [*hf_overrides(llama_dir), *STEPS, "checkpoint.enabled=false", *layout], tmp_path
    )
    assert max_param_diff(ranks[0]["params"], ddp[0]["params"]) < ATOL_UNEVEN
    losses = [r["loss"] for r in ranks[0]["records"]]
    assert losses == pytest.approx([r["loss"] for r in ddp[0]["records"]], abs=LOSS_ATOL)
    assert len({r["result"]["params_sha256"] for r in ranks}) == 1
    assert {r["result"]["samples_digest"] for r in ranks} == {ddp[0]["result"]["samples_digest"]}


@pytest.mark.slow
def test_a_sharded_pretrained_load_starts_on_meta_and_ends_with_the_files_weights(tmp_path):
    """No real storage before the wrap; afterwards every parameter is the file's (a tied
    ``lm_head`` is the embedding itself), the rotary buffers are the CPU build's, and the
    logits are ``transformers``' own.  A Qwen2 with a tied ``lm_head`` under TP=2 with sequence
    parallelism: the embedding and ``lm_head`` are both split, and must stay one parameter."""
    from transformers import AutoModelForCausalLM

    directory = save_tiny(tmp_path / "model", "qwen2", tie_word_embeddings=True)
    layout = [FSDP, "parallel.tp=2", SEQUENCE_PARALLEL]
    ranks = place_from_files(2, [*hf_overrides(directory), *layout], tmp_path / "out")
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        expected = reference(input_ids=probe_ids()).logits
    for rank in ranks:
        assert rank["built_on_meta"] and rank["tied"]
        assert rank["params"].keys() == dict(reference.named_parameters()).keys()
        for name, value in reference.named_parameters():
            assert torch.equal(rank["params"][name], value.detach()), name
        for name, value in reference.named_buffers():
            assert torch.equal(rank["buffers"][name], value), name
        torch.testing.assert_close(rank["logits"], expected, atol=LOGITS_ATOL, rtol=0)


@pytest.mark.slow
def test_fsdp_checkpoint_of_an_inline_qwen2_exports_to_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM

    inline = (
        "{model_type: qwen2, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, "
        "num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 256, "
        "max_position_embeddings: 128, tie_word_embeddings: true}"
    )
    run = tmp_path / "run"
    overrides = [
        "model.source=hf",
        f"model.hf.config={inline}",
        "model.seq_len=64",
        *STEPS,
        FSDP,
        "checkpoint.every_steps=4",
        f"checkpoint.dir={run / 'checkpoints'}",
    ]
    ranks = train_processes(2, overrides, tmp_path / "out")
    (run / "config.yaml").write_text(to_yaml(load_config(None, overrides)))  # as runs keep it
    info = export_hf(str(run), tmp_path / "hf", max_shard_size="100KB")
    assert info["step"] == 4 and (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    trained = ranks[0]["params"]
    for name, value in exported.named_parameters():
        torch.testing.assert_close(value.detach(), trained[name], msg=name)


@pytest.mark.slow
def test_the_users_own_module_trains_under_fsdp_wrapped_by_its_block_class(tmp_path):
    ranks = train_processes(
        2,
        [
            "model.source=python",
            "model.factory=tests.helpers.user_models:build_tiny_lm",
            "model.block_class=TinyBlock",
            FSDP,
            *STEPS,
            "checkpoint.enabled=false",
        ],
        tmp_path,
    )
    losses = [r["loss"] for r in ranks[0]["records"]]
    assert losses[-1] < losses[0]
    assert ranks[0]["result"]["params_sha256"] == ranks[1]["result"]["params_sha256"]
    assert {n.split(".")[0] for n in ranks[0]["params"]} == {"embed", "stack", "out"}
