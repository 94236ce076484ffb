"""The strategy seam: one declared interface, and strategies that know a model only by its
spec (unit tests, then two gloo processes training a model that is not the GPT)."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from raytrain_ext.config.choices import PipelineSchedule, StrategyName
from raytrain_ext.models import GPT_SPEC, ModelSpec
from raytrain_ext.parallel.ddp import DDPStrategy
from raytrain_ext.parallel.fsdp import FSDPStrategy
from raytrain_ext.parallel.pp import SCHEDULES, PipelineStrategy
from raytrain_ext.parallel.registry import STRATEGIES
from raytrain_ext.parallel.strategy import DistContext, Strategy
from raytrain_ext.parallel.tp import apply_tensor_parallel
from raytrain_ext.parallel.zero import ZeroStrategy
from raytrain_ext.worker.dist_env import destroy_distributed, free_port
from tests.dist_helpers import init_local_rank, spawn_ranks

PARALLEL = Path(__file__).resolve().parents[1] / "raytrain_ext" / "parallel"
GPT_MEMBERS = {"blocks", "tok_emb", "pos_emb", "ln_f", "lm_head", "attn", "ffn"}
GPT_MODULES = ("raytrain_ext.models.gpt",)
FSDP_OPTIONS = SimpleNamespace(activation_checkpointing=False, compile=False, cpu_offload=False)


class Toy(nn.Module):
    """Not a GPT: its repeated blocks are ``layers``, its output is a regression."""

    def __init__(self, width: int = 8, depth: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def build_toy(model_cfg, seed: int) -> Toy:
    torch.manual_seed(seed)
    return Toy()


TOY_SPEC = ModelSpec(name="toy", build=build_toy, blocks=lambda m: list(m.layers))


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
    class Minimal(Strategy):
        name = "minimal"

        def wrap(self, model, ctx):
            return model

        def accumulate(self, wrapped, sync):
            return torch.no_grad()

        def clip_grad_norm(self, wrapped, max_norm):
            return torch.zeros(())

        def unwrap(self, wrapped):
            return wrapped

        def full_parameters(self, wrapped):
            return dict(wrapped.named_parameters())

    strategy = Minimal(None, TOY_SPEC)
    model = Toy()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert strategy.prepare(model, optimizer, None) is model
    assert (strategy.runs_microbatches, strategy.owns_optimizer_state) == (False, False)
    assert (strategy.optimizer_foreach, strategy.native_checkpoint) == (True, False)
    assert strategy.take_kept_tokens() is None
    model_sd, optim_sd = strategy.state_dicts(model, optimizer)
    assert set(model_sd) == {name for name, _ in model.named_parameters()}
    with pytest.raises(NotImplementedError, match="'minimal' does not run micro-batches"):
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


def test_a_layout_the_spec_cannot_cut_is_refused_naming_the_member_to_add():
    with pytest.raises(ValueError, match=r"parallel.tp > 1 needs ModelSpec.tp_block_plan.*'toy'"):
        apply_tensor_parallel(Toy(), TOY_SPEC, tp_mesh=None)
    ctx = DistContext(0, 1, 0, torch.device("cpu"), None)
    pipeline = PipelineStrategy(SimpleNamespace(), TOY_SPEC, DDPStrategy(None, TOY_SPEC))
    with pytest.raises(ValueError, match=r"parallel.pp > 1 needs ModelSpec.pipeline_stage"):
        pipeline.wrap(Toy(), ctx)


def _train(strategy: Strategy, ctx: DistContext, steps: int = 3) -> dict:
    """SGD on a fixed regression, each rank its half of every batch (DDP's split)."""
    model = strategy.wrap(TOY_SPEC.build(None, 5), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(0)
    for _ in range(steps):
        inputs, targets = torch.randn(4, 8, generator=data), torch.randn(4, 1, generator=data)
        share = slice(2 * ctx.rank, 2 * ctx.rank + 2) if ctx.world_size == 2 else slice(None)
        with strategy.accumulate(model, sync=True):
            loss = ((model(inputs[share]) - targets[share]) ** 2).mean()
            strategy.backward(model, loss)
        strategy.clip_grad_norm(model, 0.0)
        strategy.step(model, optimizer)
        strategy.zero_grad(model, optimizer)
    return {name: p.clone() for name, p in strategy.full_parameters(model).items()}


def _rank(rank: int, world: int, port: int, out_dir: str) -> None:
    device = init_local_rank(rank, world, port)
    try:
        ctx = DistContext(rank, world, rank, device, None)
        results = {
            "ddp": _train(DDPStrategy(None, TOY_SPEC), ctx),
            "fsdp": _train(FSDPStrategy(FSDP_OPTIONS, TOY_SPEC), ctx),
        }
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        destroy_distributed()


def test_ddp_and_fsdp_train_a_model_of_another_family_through_its_spec(tmp_path):
    """Two gloo ranks, each half of every batch: the same parameters as one process
    training on whole batches (gradients averaged), under DDP and FSDP alike."""
    spawn_ranks(_rank, (2, free_port("127.0.0.1"), str(tmp_path)), 2)
    single = SimpleNamespace(rank=0, world_size=1)
    reference = _train(_Plain(), single)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        for name in ("ddp", "fsdp"):
            assert set(results[name]) == set(reference)
            for key, value in reference.items():
                torch.testing.assert_close(results[name][key], value, msg=f"{name} {key}")


class _Plain(Strategy):
    """One process, no wrapper: the reference the two ranks must match."""

    name = "plain"

    def __init__(self):
        super().__init__(None, TOY_SPEC)

    def wrap(self, model, ctx):
        return model

    def accumulate(self, wrapped, sync):
        return torch.enable_grad()

    def clip_grad_norm(self, wrapped, max_norm):
        return torch.zeros(())

    def unwrap(self, wrapped):
        return wrapped

    def full_parameters(self, wrapped):
        return {name: p.detach() for name, p in wrapped.named_parameters()}


def test_every_allowed_strategy_and_schedule_has_an_implementation():
    """The enums of ``config/choices.py`` are the allowed values; the tables follow them."""
    assert set(STRATEGIES) == set(StrategyName)
    assert set(SCHEDULES) == set(PipelineSchedule)
