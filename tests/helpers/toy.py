"""A small model that is not the reference GPT, with its own ModelSpec: the strategies must
train it through the spec alone."""

from __future__ import annotations

import torch
import torch.nn as nn

from raytrain_ext.models import ModelSpec
from raytrain_ext.parallel.strategy import Strategy


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


class PlainStrategy(Strategy):
    """One process, no wrapper, only the abstract members: the reference a distributed run
    must match, and the smallest strategy the base class accepts."""

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
