"""Roles (devices doing the same work) and the work model that normalizes their compute times.

A packed microbatch of sequences l_1..l_n costs

    expected = linear * sum(l_i) + quadratic * sum(l_i ** 2)

per device of a role: projections and MLP are linear in tokens, attention is
quadratic in each sequence's own length (packed documents attend only within
themselves). The ratio quadratic / linear is physics, taken from the cost
model, never fitted to telemetry: per-layer FLOPs (`cost_models.flops`), each
GEMM weighted by the efficiency the cost model gives its width
(`cost_models.compute.gemm_efficiency`; attention runs at head_dim width, at
the GPU's `attention_fraction` and the plan's attention kernel), the causal
half a fused kernel skips, FlashAttention's 2.5x backward and the plan's
recomputation. Only the overall scale (ms per unit of work) is fitted,
per role and iteration, by the detector. The units are FLOPs at peak-relative
time; only ratios between microbatches of one role matter.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from cost_models.compute import (
    CAUSAL_EXECUTED_FRACTION,
    FA2_ATTENTION_TIME_FACTOR,
    FLASH_BACKWARD_TO_FORWARD,
    gemm_efficiency,
)
from cost_models.efficiency import EfficiencyParams, SoftwareConfig, fitted_efficiency
from cost_models.flops import (
    BACKWARD_TO_FORWARD,
    head_forward_flops,
    layer_attention_forward_flops,
    layer_projection_gemms,
)
from cost_models.model_spec import ModelSpec
from detector.telemetry import Microbatch


@dataclass(frozen=True)
class WorkModel:
    """Expected compute of one microbatch on one device of a role (arbitrary units)."""

    linear: float  # per token
    quadratic: float  # per squared sequence length

    def expected(self, microbatch: Microbatch) -> float:
        return self.expected_for(microbatch.tokens, microbatch.sum_squared_lengths)

    def expected_for(self, tokens: int, squared_lengths: int) -> float:
        """Of any number of microbatches, from their summed sequence lengths and squared lengths: the
        model is linear in both."""
        return self.linear * tokens + self.quadratic * squared_lengths

    @property
    def attention_ratio(self) -> float:
        """quadratic / linear: a sequence of length L costs (1 + ratio * L) x its tokens' linear work."""
        return self.quadratic / self.linear


def _projection_work_per_token(model: ModelSpec, tp: int, efficiency: EfficiencyParams | None) -> float:
    """QKV, output projection and the MLP GEMMs of one layer, forward, per token on one TP shard, as
    cost_models.compute times them (`layer_projection_gemms`)."""
    return sum(flops / (gemm_efficiency(width, efficiency) if efficiency else 1.0)
               for flops, width in layer_projection_gemms(model, 1, tp))


def layer_work_model(
    model: ModelSpec,
    tp: int,
    recompute: str,
    *,
    efficiency: EfficiencyParams | None = None,
    software: SoftwareConfig | None = None,
    efficiency_weighted: bool = True,
) -> WorkModel:
    """Forward + backward (+ recompute) work of one transformer layer on one GPU of its TP group."""
    efficiency = (efficiency or fitted_efficiency()) if efficiency_weighted else None
    software = software or SoftwareConfig()
    linear_passes = 1 + BACKWARD_TO_FORWARD + (1 if recompute == "full" else 0)
    linear = linear_passes * _projection_work_per_token(model, tp, efficiency)

    attention = layer_attention_forward_flops(model, 1, 1) / tp  # per squared length, full s x s matrix
    if software.flash_attention:
        attention *= CAUSAL_EXECUTED_FRACTION
        attention_passes = 1 + FLASH_BACKWARD_TO_FORWARD
    else:
        attention_passes = 1 + BACKWARD_TO_FORWARD
    attention_passes += 1 if recompute in ("selective", "full") else 0
    if efficiency is not None:
        attention /= gemm_efficiency(model.head_width, efficiency)
        if software.flash_attention:  # the fused kernel's speed as the cost model prices it (`compute.py`)
            kernel = FA2_ATTENTION_TIME_FACTOR if software.attention_kernel == "fa2" else 1.0
            attention *= kernel / efficiency.attention_fraction
    return WorkModel(linear=linear, quadratic=attention_passes * attention)


def role_work_model(
    model: ModelSpec,
    layers: tuple[int, int],
    tp: int,
    recompute: str,
    *,
    efficiency: EfficiencyParams | None = None,
    software: SoftwareConfig | None = None,
    efficiency_weighted: bool = True,
) -> WorkModel:
    """A stage's layers, plus the vocabulary head (linear in tokens) on the stage ending the model."""
    layer = layer_work_model(
        model, tp, recompute, efficiency=efficiency, software=software, efficiency_weighted=efficiency_weighted
    )
    count = max(1, layers[1] - layers[0])
    linear = count * layer.linear
    if layers[1] >= model.num_layers:
        vocab_shard = model.vocab_size / tp
        head = head_forward_flops(model, 1, 1) / tp
        if efficiency_weighted:
            head /= gemm_efficiency(min(model.hidden_size, vocab_shard), efficiency or fitted_efficiency())
        linear += (1 + BACKWARD_TO_FORWARD) * head
    return WorkModel(linear=linear, quadratic=count * layer.quadratic)


@dataclass(frozen=True)
class Role:
    """Devices doing the same work: stages with the same layer range and TP degree, across replicas."""

    layers: tuple[int, int]
    tp: int
    devices: tuple[str, ...]
    work: WorkModel

    @property
    def label(self) -> str:
        return f"layers [{self.layers[0]}, {self.layers[1]}) tp {self.tp}"


@dataclass(frozen=True)
class DetectionLayout:
    """The plan as the detector sees it: every stage device and its role."""

    roles: tuple[Role, ...]
    role_of: Mapping[str, int] = field(compare=False, repr=False)

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(device for role in self.roles for device in role.devices)


def layout_from_stages(
    model: ModelSpec,
    stages: Iterable[tuple[tuple[int, int], int, Iterable[str]]],
    recompute: str = "selective",
    *,
    efficiency: EfficiencyParams | None = None,
    software: SoftwareConfig | None = None,
    efficiency_weighted: bool = True,
) -> DetectionLayout:
    """Group (layers, tp, devices) stages into roles keyed by (layers, tp), first-seen order."""
    members: dict[tuple[tuple[int, int], int], list[str]] = {}
    seen: set[str] = set()
    for layers, tp, devices in stages:
        key = ((int(layers[0]), int(layers[1])), int(tp))
        for device in devices:
            if device in seen:
                raise ValueError(f"device {device} is in two stages")
            seen.add(device)
            members.setdefault(key, []).append(device)
    roles = tuple(
        Role(
            layers=layers,
            tp=tp,
            devices=tuple(devices),
            work=role_work_model(model, layers, tp, recompute, efficiency=efficiency, software=software,
                                 efficiency_weighted=efficiency_weighted),
        )
        for (layers, tp), devices in members.items()
    )
    role_of = {device: index for index, role in enumerate(roles) for device in role.devices}
    return DetectionLayout(roles=roles, role_of=role_of)


class _Stage(Protocol):
    layers: Sequence[int]
    tp: int
    devices: Sequence[str]


class _Replica(Protocol):
    stages: Sequence[_Stage]


class PlanStages(Protocol):
    """What the detector reads of API.md's Plan (wire.schemas.Plan, which the detector does not import):
    replicas[*].stages[*].{layers, tp, devices} and recompute."""

    replicas: Sequence[_Replica]
    recompute: str


def layout_from_plan(plan: PlanStages, model: ModelSpec, *, efficiency: EfficiencyParams | None = None,
                     software: SoftwareConfig | None = None, efficiency_weighted: bool = True) -> DetectionLayout:
    """The roles of a plan's devices (see `layout_from_stages`), their work priced with `efficiency` (default: the
    A100 fit) and `software` (default: fused attention), as the plan was."""
    stages = [(stage.layers, stage.tp, stage.devices) for replica in plan.replicas for stage in replica.stages]
    recompute = getattr(plan, "recompute", None) or "selective"
    return layout_from_stages(model, stages, recompute, efficiency=efficiency, software=software,
                              efficiency_weighted=efficiency_weighted)
