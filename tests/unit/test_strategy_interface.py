"""The strategy seam: one declared interface, and strategies that know a model only by its
spec (unit tests, then two gloo processes training a model that is not the GPT)."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from raytrain_ext.models import GPT_SPEC
from raytrain_ext.parallel.catalog import STRATEGY_CATALOG, load_class
from raytrain_ext.parallel.config import PipelineSchedule, StrategyName
from raytrain_ext.parallel.ddp import DDPStrategy
from raytrain_ext.parallel.fsdp import FSDPStrategy
from raytrain_ext.parallel.pp import SCHEDULES, PipelineStrategy
from raytrain_ext.parallel.strategy import DistContext, Strategy
from raytrain_ext.parallel.tp import apply_tensor_parallel
from raytrain_ext.parallel.zero import ZeroStrategy
from tests.helpers.toy import TOY_SPEC, PlainStrategy, Toy

PARALLEL = Path(__file__).resolve().parents[2] / "raytrain_ext" / "parallel"
GPT_MEMBERS = {"blocks", "tok_emb", "pos_emb", "ln_f", "lm_head", "attn", "ffn"}
GPT_MODULES = ("raytrain_ext.models.gpt",)
FSDP_OPTIONS = SimpleNamespace(activation_checkpointing=False, compile=False, cpu_offload=False)


def _names_of_the_gpt(path: Path) -> list:
    """Attribute reads of the GPT's members, except through the spec (``spec.blocks``),
    and imports of the GPT's modules; docstrings are not code and do not count."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in GPT_MEMBERS:
            if _spelled(node.value) != "spec":
                found.append(f"{path.name}:{node.lineno}: .{node.attr}")
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(GPT_MODULES):
            found.append(f"{path.name}:{node.lineno}: import {node.module}")
    return found


def _spelled(node: ast.expr) -> str:
    """The last name of ``spec`` or ``self.spec``."""
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def test_parallel_code_names_no_attribute_of_the_reference_gpt():
    """Strategies reach a model only through its spec, so any model family can plug in."""
    assert [hit for path in sorted(PARALLEL.glob("*.py")) for hit in _names_of_the_gpt(path)] == []


def test_the_base_class_declares_every_member_the_loop_and_checkpoints_use():
    strategy = PlainStrategy()
    model = Toy()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert strategy.prepare(model, optimizer, None) is model
    assert (strategy.runs_microbatches, strategy.owns_optimizer_state) == (False, False)
    assert (strategy.optimizer_foreach, strategy.native_checkpoint) == (True, False)
    assert strategy.take_kept_tokens() is None
    model_sd, optim_sd = strategy.state_dicts(model, optimizer)
    assert set(model_sd) == {name for name, _ in model.named_parameters()}
    with pytest.raises(NotImplementedError, match="'plain' does not run micro-batches"):
        strategy.forward_backward(model, [], 1.0, torch.no_grad)
    with pytest.raises(NotImplementedError, match="no checkpoint format of its own"):
        strategy.native_info()
    with pytest.raises(TypeError, match="abstract"):

        class Incomplete(Strategy):
            def wrap(self, model, ctx):
                return model

        Incomplete(None, TOY_SPEC)


def test_each_strategy_says_what_it_does_differently():
    cfg = SimpleNamespace(zero=SimpleNamespace(stage=2, native_checkpoint=True))
    assert isinstance(DDPStrategy(cfg, GPT_SPEC), Strategy)
    zero = ZeroStrategy(cfg, GPT_SPEC)
    assert (zero.owns_optimizer_state, zero.native_checkpoint) == (True, True)
    pipeline = PipelineStrategy(cfg, GPT_SPEC, DDPStrategy(cfg, GPT_SPEC))
    assert pipeline.runs_microbatches and pipeline.optimizer_foreach
    # DTensor parameters take the per-tensor optimizer step, in a pipeline stage too
    assert not FSDPStrategy(cfg, GPT_SPEC).optimizer_foreach
    assert not PipelineStrategy(cfg, GPT_SPEC, FSDPStrategy(cfg, GPT_SPEC)).optimizer_foreach


def test_a_layout_the_spec_cannot_cut_is_refused_naming_the_member_to_add():
    with pytest.raises(ValueError, match=r"parallel.tp > 1 needs ModelSpec.tp_block_plan.*'toy'"):
        apply_tensor_parallel(Toy(), TOY_SPEC, tp_mesh=None)
    ctx = DistContext(0, 1, 0, torch.device("cpu"), None)
    pipeline = PipelineStrategy(SimpleNamespace(), TOY_SPEC, DDPStrategy(None, TOY_SPEC))
    with pytest.raises(ValueError, match=r"parallel.pp > 1 needs ModelSpec.pipeline_stage"):
        pipeline.wrap(Toy(), ctx)


def test_every_allowed_strategy_and_schedule_has_an_implementation():
    """The enums of ``parallel/config.py`` are the allowed values; the tables follow them."""
    assert set(STRATEGY_CATALOG) == set(StrategyName)
    for name, caps in STRATEGY_CATALOG.items():
        for path in filter(None, (caps.implementation, caps.expert_parallel, caps.config_check)):
            assert load_class(path) is not None, path
        assert issubclass(load_class(caps.implementation), Strategy)
        assert load_class(caps.implementation).name == name
    assert set(SCHEDULES) == set(PipelineSchedule)
