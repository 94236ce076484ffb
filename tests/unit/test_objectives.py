"""The training objectives (raytrain_ext.objectives): exact losses, exact masking, the
loop's normalisation invariant, and the driver's refusals.

Unit rung: no Ray; tiny models built here (a 2-layer GPT, a tiny Hugging Face Llama for
the TRL cross-check), never downloaded.
"""

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from raytrain_ext.config.schema import TrainConfig
from raytrain_ext.data.batch import Batch
from raytrain_ext.errors import InputError
from raytrain_ext.models.config import ModelConfig
from raytrain_ext.models.gpt import build_model
from raytrain_ext.objectives import (
    DPO,
    SFT,
    CausalLM,
    UserObjective,
    build_objective,
    check_objective,
    sequence_logps,
)
from raytrain_ext.objectives.config import ObjectiveConfig

VOCAB = 64
NOT_CALLABLE = 3  # objective.fn pointing here must be refused


def summed_nll(logits, batch):
    """A user loss: the plain summed next-token loss (objective.fn target of these tests)."""
    return torch.nn.functional.cross_entropy(
        logits.float().flatten(0, 1), batch.targets.flatten(), reduction="sum"
    )


def tiny_gpt(seed: int = 0):
    cfg = OmegaConf.merge(
        OmegaConf.structured(ModelConfig),
        {"n_layers": 2, "d_model": 32, "n_heads": 2, "vocab_size": VOCAB, "seq_len": 16},
    )
    return build_model(cfg, seed)


def chat_batch(rows: int = 2, seq: int = 12, seed: int = 1) -> Batch:
    """Token rows whose first ``3 + r`` targets are prompt (weight 0), then response
    (weight 1), then, in odd rows, two padding targets (weight 0)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (rows, seq + 1), generator=g)
    weights = torch.zeros(rows, seq)
    for r in range(rows):
        end = seq - 2 if r % 2 else seq
        weights[r, 3 + r : end] = 1.0
    return Batch(inputs=tokens[:, :-1], targets=tokens[:, 1:], weights=weights)


# 1. SFT: prompt tokens send no gradient and their targets do not matter


def test_sft_prompt_positions_get_exactly_zero_gradient_and_their_targets_do_not_matter():
    model, batch = tiny_gpt(), chat_batch()
    logits = model(batch.inputs)
    logits.retain_grad()
    first = SFT().loss(logits, batch).loss_sum
    first.backward()
    prompt = batch.weights == 0
    assert bool((logits.grad[prompt] == 0.0).all())
    assert bool((logits.grad[~prompt].abs().sum(-1) > 0).all())  # responses do get gradient
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}

    changed_targets = batch.targets.clone()
    changed_targets[prompt] = (changed_targets[prompt] + 7) % VOCAB
    assert not torch.equal(changed_targets, batch.targets)
    changed = Batch(batch.inputs, changed_targets, batch.weights)
    model.zero_grad(set_to_none=True)
    second = SFT().loss(model(changed.inputs), changed).loss_sum
    second.backward()
    # bit-identical: compare the raw bits, so even a -0.0/+0.0 difference would fail
    assert first.view(torch.int64).item() == second.view(torch.int64).item()
    for name, p in model.named_parameters():
        assert torch.equal(p.grad.view(torch.int32), grads[name].view(torch.int32)), name


# 2. SFT: the masked loss by hand


def test_sft_loss_equals_the_masked_nll_written_out_by_hand():
    g = torch.Generator().manual_seed(5)
    vocab, seq = 5, 4
    logits = torch.randn(2, seq, vocab, generator=g) * 3
    targets = torch.tensor([[1, 4, 0, 2], [3, 3, 1, 0]])
    weights = torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0]])
    batch = Batch(inputs=torch.zeros_like(targets), targets=targets, weights=weights)

    by_hand = 0.0  # float64: -log softmax(logits)[target] over the response positions only
    for r, t in [(0, 2), (0, 3), (1, 1), (1, 2)]:
        row = logits[r, t].tolist()
        log_normaliser = math.log(sum(math.exp(x) for x in row))
        by_hand += log_normaliser - row[targets[r, t]]

    terms = SFT().loss(logits, batch)
    assert SFT().units(batch) == 4.0
    assert terms.metrics == {}
    # float32 log-softmax is within a few ulps (~1.2e-7 relative) of the exact value per
    # token; four tokens summed in float64 stay well inside 1e-6 relative
    assert terms.loss_sum.item() == pytest.approx(by_hand, rel=1e-6)


def test_sft_refuses_a_batch_without_weights():
    batch = chat_batch()
    unweighted = Batch(batch.inputs, batch.targets)
    with pytest.raises(InputError, match=r"objective.name=sft needs data.format=chat"):
        SFT().units(unweighted)
    with pytest.raises(InputError, match=r"objective.name=sft needs data.format=chat"):
        SFT().loss(torch.zeros(2, 12, VOCAB), unweighted)


# 3. DPO against TRL's own computation


def preference_records(pairs: int, length: int, seed: int):
    """``2 * pairs`` rows (chosen then rejected) sharing each record's prompt; the
    completion mask (TRL's) is 1 on response tokens, 0 on prompt and right padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (2 * pairs, length), generator=g)
    completion = torch.zeros(2 * pairs, length, dtype=torch.long)
    for i in range(pairs):
        prompt = 2 + i
        ids[pairs + i, :prompt] = ids[i, :prompt]
        completion[i, prompt : length - i] = 1  # chosen: shorter with every record
        completion[pairs + i, prompt : length - 1] = 1
    return ids, completion


def our_batch(ids, completion, pairs: int) -> Batch:
    """Our layout of TRL's rows: targets are the ids shifted by one, weighted by the
    completion mask of the target token."""
    return Batch(
        inputs=ids[:, :-1], targets=ids[:, 1:], weights=completion[:, 1:].float(), pairs=pairs
    )


def trl_dpo_loss(policy, ids, completion, reference_logps, beta, loss_type, smoothing):
    """``trl.DPOTrainer._compute_loss`` called unbound on an object that holds exactly
    the attributes it reads with precomputed reference log-probs (TRL 1.x); returns the
    loss (mean over pairs) and the metrics TRL logged."""
    from trl.trainer.dpo_trainer import DPOTrainer

    identity = lambda x: x  # noqa: E731  (one process: gathering returns the tensor)
    trainer = SimpleNamespace(
        model=policy,
        accelerator=SimpleNamespace(
            device=ids.device, gather=identity, gather_for_metrics=identity
        ),
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=[loss_type],
        loss_weights=[1.0],
        beta=beta,
        label_smoothing=smoothing,
        use_weighting=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    pairs = ids.shape[0] // 2
    inputs = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "completion_mask": completion,
        "ref_chosen_logps": reference_logps[:pairs],
        "ref_rejected_logps": reference_logps[pairs:],
    }
    loss = DPOTrainer._compute_loss(trainer, policy, inputs, return_outputs=False)
    return loss, {k: v[-1] for k, v in trainer._metrics["train"].items()}


def tiny_llama(seed: int):
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from tests.helpers.hf_models import tiny_config

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    return model


def test_dpo_loss_metrics_and_gradients_equal_trl():
    pairs, beta = 4, 0.5
    ids, completion = preference_records(pairs, length=10, seed=2)
    batch = our_batch(ids, completion, pairs)
    policy, reference = tiny_llama(seed=0), tiny_llama(seed=1)
    with torch.no_grad():
        reference_logps = sequence_logps(reference(input_ids=batch.inputs).logits, batch)
        labels = ids.masked_fill(completion == 0, -100)
        trl_reference = reference(input_ids=ids, labels=labels, fused_lm_head=True).log_probs
    # our sequence log-prob is TRL's (float32, chunked vs full log-softmax: 1e-5 relative)
    torch.testing.assert_close(reference_logps, trl_reference.sum(1), rtol=1e-5, atol=1e-5)

    objective = DPO(beta=beta)
    assert objective.units(batch) == pairs and objective.uses_reference
    terms = objective.loss(policy(input_ids=batch.inputs).logits, batch, reference_logps)
    (terms.loss_sum / pairs).backward()
    ours = {name: p.grad.clone() for name, p in policy.named_parameters()}
    policy.zero_grad(set_to_none=True)
    trl_loss, logged = trl_dpo_loss(policy, ids, completion, reference_logps, beta, "sigmoid", 0.0)
    trl_loss.backward()

    # TRL averages over pairs, we sum: the same float32 values, summed in another order
    assert (terms.loss_sum / pairs).item() == pytest.approx(trl_loss.item(), rel=1e-5)
    for name, p in policy.named_parameters():
        torch.testing.assert_close(ours[name], p.grad, rtol=1e-4, atol=1e-7, msg=name)
    assert set(terms.metrics) == set(DPO.metric_names)
    assert terms.metrics["accuracy"].item() == round(logged["rewards/accuracies"] * pairs)
    for ours_key, trl_key in [
        ("reward_margin", "rewards/margins"),
        ("chosen_reward", "rewards/chosen"),
        ("rejected_reward", "rewards/rejected"),
    ]:
        assert terms.metrics[ours_key].item() / pairs == pytest.approx(logged[trl_key], abs=1e-5)
    assert 0 < terms.metrics["accuracy"].item() < pairs  # the batch exercises both outcomes


def test_dpo_label_smoothing_is_trls_conservative_form():
    """TRL 1.x's ``sigmoid`` loss no longer applies ``label_smoothing``; its cDPO expression
    ``-(1-ls) logsigmoid(beta d) - ls logsigmoid(-beta d)`` survives in the ``aot`` loss,
    where ``d`` is the sorted policy log-ratio minus the sorted reference log-ratio. With a
    single pair sorting is the identity and ``d`` is DPO's ``h``, so each pair is checked
    on its own against TRL ``aot``; and against the formula written out here."""
    pairs, beta, smoothing = 3, 0.7, 0.2
    ids, completion = preference_records(pairs, length=10, seed=4)
    policy, reference = tiny_llama(seed=0), tiny_llama(seed=1)
    objective = DPO(beta=beta, label_smoothing=smoothing)
    with torch.no_grad():
        for i in range(pairs):
            rows = torch.tensor([i, pairs + i])
            batch = our_batch(ids[rows], completion[rows], pairs=1)
            reference_logps = sequence_logps(reference(input_ids=batch.inputs).logits, batch)
            policy_logps = sequence_logps(policy(input_ids=batch.inputs).logits, batch)
            terms = objective.loss(policy(input_ids=batch.inputs).logits, batch, reference_logps)
            trl_loss, _ = trl_dpo_loss(
                policy, ids[rows], completion[rows], reference_logps, beta, "aot", smoothing
            )
            assert terms.loss_sum.item() == pytest.approx(trl_loss.item(), rel=1e-5)
            h = float(
                (policy_logps[0] - reference_logps[0]) - (policy_logps[1] - reference_logps[1])
            )
            log_sigmoid = lambda x: -math.log1p(math.exp(-x))  # noqa: E731
            by_hand = -(1 - smoothing) * log_sigmoid(beta * h) - smoothing * log_sigmoid(-beta * h)
            assert terms.loss_sum.item() == pytest.approx(by_hand, rel=1e-5)


def test_dpo_refuses_a_batch_without_pairs_or_reference():
    batch = chat_batch()
    with pytest.raises(ValueError, match=r"DPO needs a preference batch"):
        DPO(0.1).loss(torch.zeros(2, 12, VOCAB), batch, torch.zeros(2))
    paired = Batch(batch.inputs, batch.targets, batch.weights, pairs=1)
    with pytest.raises(ValueError, match=r"DPO needs reference_logps of shape \(2,\); got None"):
        DPO(0.1).loss(torch.zeros(2, 12, VOCAB), paired)


# 4. The loop's normalisation: sum(loss_sum) / global units is split-independent


def micro_batches(batch: Batch, sizes):
    start = 0
    for size in sizes:
        rows = slice(start, start + size)
        weights = None if batch.weights is None else batch.weights[rows]
        yield Batch(batch.inputs[rows], batch.targets[rows], weights)
        start += size


@pytest.mark.parametrize("objective", [CausalLM(), SFT()], ids=["causal_lm", "sft"])
def test_summed_loss_over_global_units_does_not_depend_on_the_micro_batch_split(objective):
    model = tiny_gpt()
    batch = chat_batch(rows=6, seq=12, seed=3)
    if objective.name == "causal_lm":
        batch = Batch(batch.inputs, batch.targets)
    with torch.no_grad():
        whole = objective.loss(model(batch.inputs), batch).loss_sum.item() / objective.units(batch)
        for sizes in ([1] * 6, [2, 4], [5, 1]):
            parts = list(micro_batches(batch, sizes))
            global_units = sum(objective.units(part) for part in parts)
            assert global_units == objective.units(batch)
            sums = [objective.loss(model(part.inputs), part).loss_sum.item() for part in parts]
            assert sum(sums) / global_units == pytest.approx(whole, rel=1e-6)
            if objective.name == "sft":  # a mean of per-micro-batch means is not the same
                means = [s / objective.units(part) for s, part in zip(sums, parts, strict=True)]
                assert abs(sum(means) / len(means) - whole) > 1e-4


def test_user_objective_sums_the_users_loss_over_target_weight():
    batch = chat_batch()
    logits = tiny_gpt()(batch.inputs)
    objective = build_objective(
        OmegaConf.structured(
            ObjectiveConfig(name="user", fn="tests.unit.test_objectives:summed_nll")
        ),
        "tokens",
    )
    assert isinstance(objective, UserObjective)
    assert objective.units(batch) == float(batch.weights.sum())
    assert torch.equal(objective.loss(logits, batch).loss_sum, summed_nll(logits, batch))
    mean = UserObjective(lambda logits, batch: logits.sum(-1), label="per_row")
    with pytest.raises(
        InputError, match=r"objective.fn: per_row returned \(2, 12\); it must return"
    ):
        mean.loss(logits, batch)


# 5. build_objective / check_objective


def train_cfg(**overrides):
    cfg = OmegaConf.structured(TrainConfig)
    return OmegaConf.merge(cfg, OmegaConf.from_dotlist([f"{k}={v}" for k, v in overrides.items()]))


@pytest.mark.parametrize(
    "overrides, objective_type",
    [
        ({}, CausalLM),
        ({"data.format": "text"}, CausalLM),
        ({"objective.name": "sft", "data.format": "chat"}, SFT),
        ({"objective.name": "dpo", "data.format": "preference"}, DPO),
        (
            {"objective.name": "user", "objective.fn": "tests.unit.test_objectives:summed_nll"},
            UserObjective,
        ),
        # without objective.name: the format's objective, or user when a loss is named
        ({"data.format": "chat"}, SFT),
        ({"data.format": "preference"}, DPO),
        ({"objective.fn": "tests.unit.test_objectives:summed_nll"}, UserObjective),
        ({"data.format": "chat", "objective.name": "causal_lm"}, None),
    ],
)
def test_accepted_choices_build_their_objective(overrides, objective_type):
    """An explicit objective.name wins over the format's default (the last case is
    refused: causal_lm does not train on chat records)."""
    cfg = train_cfg(**overrides)
    if objective_type is None:
        with pytest.raises(InputError, match="objective.name=causal_lm does not train on"):
            check_objective(cfg)
        return
    check_objective(cfg)
    assert type(build_objective(cfg.objective, cfg.data.format)) is objective_type


def test_dpo_is_built_with_its_beta_and_label_smoothing():
    cfg = train_cfg(
        **{"objective.name": "dpo", "objective.dpo.beta": 0.3, "objective.dpo.label_smoothing": 0.1}
    )
    objective = build_objective(cfg.objective, cfg.data.format)
    assert (objective.beta, objective.label_smoothing) == (0.3, 0.1)


def test_a_loss_fn_from_python_makes_the_objective_user():
    cfg = train_cfg()
    check_objective(cfg, loss_fn=summed_nll)
    objective = build_objective(cfg.objective, cfg.data.format, loss_fn=summed_nll)
    assert isinstance(objective, UserObjective) and objective.fn is summed_nll


@pytest.mark.parametrize(
    "overrides, loss_fn, message",
    [
        (
            {"objective.name": "sft"},
            None,
            r"objective.name=sft needs data.format=chat \(prompt/response examples whose "
            r"prompt tokens are masked out of the loss\); got data.format=tokens",
        ),
        (
            {"objective.name": "dpo", "data.format": "text"},
            None,
            r"objective.name=dpo needs data.format=preference .*got data.format=text",
        ),
        (
            {"data.format": "chat", "objective.name": "causal_lm"},
            None,
            r"objective.name=causal_lm does not train on data.format=chat: that format needs "
            r"objective.name=sft .*trains on data.format=tokens or text",
        ),
        (
            {"data.format": "preference", "objective.name": "causal_lm"},
            None,
            r"data.format=preference: that format needs objective.name=dpo",
        ),
        (
            {"objective.name": "sft", "data.format": "preference"},
            None,
            r"objective.name=sft does not train on data.format=preference: .* needs "
            r"objective.name=dpo",
        ),
        (
            {"objective.name": "user"},
            None,
            r"objective.fn: objective.name=user needs objective.fn=pkg.module:loss, or the loss "
            r"passed from Python",
        ),
        (
            {
                "objective.fn": "tests.unit.test_objectives:summed_nll",
                "objective.name": "causal_lm",
            },
            None,
            r"objective.fn: set to '.*' but objective.name=causal_lm; set objective.name=user",
        ),
        (
            {"objective.name": "dpo", "data.format": "preference", "parallel.pp": 2},
            None,
            r"parallel.pp: objective.name=dpo is not supported with pipeline parallelism yet",
        ),
        (
            {"objective.name": "sft", "data.format": "chat", "parallel.pp": 2},
            None,
            r"parallel.pp: objective.name=sft is not supported",
        ),
        (
            {"parallel.pp": 2},
            summed_nll,
            r"parallel.pp: objective.name=user \(the loss_fn given from Python\) is not supported",
        ),
        (
            {"data.format": "preference"},
            summed_nll,
            r"data.format: a user objective averages over target tokens, but preference data",
        ),
        (
            {"objective.name": "user", "objective.fn": "no_colon"},
            None,
            r"objective.fn: 'no_colon' is not 'pkg.module:name'",
        ),
        (
            {"objective.name": "user", "objective.fn": "no_such_pkg.losses:loss"},
            None,
            r"objective.fn: cannot import no_such_pkg.losses",
        ),
        (
            {"objective.name": "user", "objective.fn": "tests.unit.test_objectives:nothing"},
            None,
            r"objective.fn: tests.unit.test_objectives has no 'nothing'",
        ),
        (
            {"objective.name": "user", "objective.fn": "tests.unit.test_objectives:NOT_CALLABLE"},
            None,
            r"objective.fn: tests.unit.test_objectives:NOT_CALLABLE is not callable \(an object of "
            r"type 'int'\); name a function",
        ),
        (
            {"objective.fn": "tests.unit.test_objectives:summed_nll"},
            summed_nll,
            r"objective.fn: set to '.*' and a loss_fn was also given from Python",
        ),
        (
            {"objective.name": "sft", "data.format": "chat"},
            summed_nll,
            r"objective.name: a loss_fn given from Python makes the objective 'user', but "
            r"objective.name=sft",
        ),
        ({}, "not a function", r"loss_fn: 'not a function' is not callable"),
    ],
)
def test_refused_choices_name_the_key_and_the_fix(overrides, loss_fn, message):
    cfg = train_cfg(**overrides)
    with pytest.raises(InputError, match=message):
        check_objective(cfg, loss_fn=loss_fn)


def test_build_objective_refuses_what_check_objective_refuses():
    cfg = train_cfg(**{"objective.name": "user"})
    with pytest.raises(InputError, match=r"objective.fn: objective.name=user needs"):
        build_objective(cfg.objective, cfg.data.format)
    cfg = train_cfg(**{"objective.name": "user", "objective.fn": "no_such_pkg.losses:loss"})
    with pytest.raises(InputError, match=r"objective.fn: cannot import no_such_pkg.losses"):
        build_objective(cfg.objective, cfg.data.format)
