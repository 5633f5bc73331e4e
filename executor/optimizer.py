"""The executor's optimizers: plain SGD, and Adam over the optimizer intervals a rank owns.

Adam (Kingma & Ba, with bias correction; no weight decay) keeps its moments only for the
intervals of each tensor's TP dimension the rank owns (`executor.shards`): its whole TP slice
without ZeRO, its replica's share with ZeRO-1, as `planner.replan.holdings` lays them out. Each
rank updates the parameters it owns from the full reduced gradient; the owners of a unit then sum
their updates (zeros elsewhere) in one all-reduce, which hands every holder the whole new tensor,
and each keeps its slice. Moments are tensors shaped like the rank's local slice, NaN outside
what it owns, so state that no transfer delivered shows up at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

OPTIMIZERS = ("sgd", "adam")


@dataclass(frozen=True)
class AdamSettings:
    lr: float
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8


@dataclass
class Moments:
    """Adam's first and second moments of one tensor slice (NaN where not owned)."""

    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor

    @classmethod
    def unset(cls, like: torch.Tensor) -> Moments:
        return cls(torch.full_like(like, math.nan), torch.full_like(like, math.nan))

    @classmethod
    def zeros(cls, like: torch.Tensor) -> Moments:
        return cls(torch.zeros_like(like), torch.zeros_like(like))


@dataclass
class AdamState:
    settings: AdamSettings
    steps_done: int = 0  # the same on every rank: the count of optimizer steps of the whole job
    moments: dict[str, Moments] = field(default_factory=dict)


def adam_update(param: torch.Tensor, grad: torch.Tensor, moments_avg: torch.Tensor, moments_sq: torch.Tensor,
                step: int, settings: AdamSettings) -> None:
    """One Adam step in place on matching slices (step counts from 1)."""
    moments_avg.mul_(settings.beta1).add_(grad, alpha=1 - settings.beta1)
    moments_sq.mul_(settings.beta2).addcmul_(grad, grad, value=1 - settings.beta2)
    bias1 = 1 - settings.beta1 ** step
    bias2 = 1 - settings.beta2 ** step
    denominator = (moments_sq / bias2).sqrt_().add_(settings.eps)
    param.addcdiv_(moments_avg, denominator, value=-settings.lr / bias1)
