"""What a calibration's runs cover, and where a plan priced with it goes beyond them.

A calibration fits a handful of efficiency parameters to a few measured runs. Inside the kinds of layout those
runs exercised, the fitted parameters predict the stack's other runs well; outside them they extrapolate, and the
published runs show by how much (`python -m benchmarks.fidelity`, "Calibrated per stack", each stack calibrated
on half its runs, 2026-12-06 18:23 UTC: a held-out run inside its calibration's span was predicted to 7.4% on
average, one outside to 5.6%, and the eight whose CP or EP degree lay outside the calibrated runs' to 5.7%, 1-10%
(5.9% and 6.8%, 1-14%, before Megatron's EP overlap was priced block by block); 6.6%, 6.6% and 6.7% before
calibrations shrank toward the built-in parameters; before Hopper's attention fraction was fitted, 12.2% outside
and 19%, 10-33%, for those eight). A plan priced with a
calibration names every way it leaves the span (`predicted.calibration_extrapolates`), so that a user knows which
of their numbers to trust less.

The span's dimensions are what the parameters stand in for: the GPU (its kernels' efficiencies), how its node's
GPUs are linked (`cluster.nvlink_topology`: a fitted NVLink fraction measured through a switch says little about
peer links, and the other way round), the precision (FP8 GEMMs), the TP, CP and EP degrees (the links the
parameters price), the model's size (GEMM widths, per-layer overheads), the tokens one microbatch holds
(kernel efficiency, overhead per microbatch), and where ZeRO-2/3's per-layer collectives run, inside a node or
across nodes (`shard_reach`: what a fitted `shard_overlap_fraction` was measured over; it moves little of a
one-node run's time, whose collectives ride NVLink, and much of a multi-node one's).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from cost_models.layout import Hardware
from cost_models.sharded_dp import shards_every_microbatch
from planner.calibration import MeasuredCompute, MeasuredRun
from planner.devices import slot_inventory
from planner.estimate_replicas import ReplicaLayout

# `shard_reach`'s words. No per-layer collectives: ZeRO-0/1, or a shard group of one TP group.
UNSHARDED = "none"
SHARDED_IN_NODE = "within a node"
SHARDED_ACROSS_NODES = "across nodes"


def nvlink_topology(hardware: Hardware) -> str:
    """`cluster.nvlink_topology`'s word for how `hardware`'s node links its GPUs."""
    return "mesh" if hardware.nvlink_mesh else "switch"


def shard_reach(zero_stage: int, shard_replicas: int, tp: int, cp: int, gpus_per_node: int) -> str:
    """Where ZeRO-2/3's per-layer collectives run: over the shard group's TP groups, `shard_replicas` replicas' CP
    ranks (`cost_models.stage_costs.StageCostTerms`), consecutive, so inside one node while they fit."""
    ranks = shard_replicas * cp
    if not shards_every_microbatch(zero_stage) or ranks <= 1:
        return UNSHARDED
    return SHARDED_IN_NODE if ranks * tp <= gpus_per_node else SHARDED_ACROSS_NODES


@dataclass(frozen=True)
class CalibrationSpan:
    gpus: frozenset[str]
    nvlink_topologies: frozenset[str]
    precisions: frozenset[str]
    tp: tuple[int, int]  # (least, most)
    cp: tuple[int, int]
    ep: tuple[int, int]
    parameters: tuple[int, int]  # the model's, all experts counted
    microbatch_tokens: tuple[int, int]
    shard_reaches: frozenset[str] = frozenset({UNSHARDED})  # `shard_reach` of each run

    @classmethod
    def of(cls, hardware: Hardware, precision: str, tps: Iterable[int], cps: Iterable[int], ep: int, parameters: int,
           microbatch_tokens: int, reach: str = UNSHARDED) -> CalibrationSpan:
        """One run's (or one plan's) span: its stages' TP and CP degrees, the rest single values."""
        tps, cps = tuple(tps), tuple(cps)
        return cls(frozenset({hardware.gpu.name}), frozenset({nvlink_topology(hardware)}), frozenset({precision}),
                   (min(tps), max(tps)), (min(cps), max(cps)), (ep, ep), (parameters, parameters),
                   (microbatch_tokens, microbatch_tokens), frozenset({reach}))

    def joined(self, other: CalibrationSpan) -> CalibrationSpan:
        def both(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
            return min(a[0], b[0]), max(a[1], b[1])

        return CalibrationSpan(self.gpus | other.gpus, self.nvlink_topologies | other.nvlink_topologies,
                               self.precisions | other.precisions, both(self.tp, other.tp),
                               both(self.cp, other.cp), both(self.ep, other.ep),
                               both(self.parameters, other.parameters),
                               both(self.microbatch_tokens, other.microbatch_tokens),
                               self.shard_reaches | other.shard_reaches)


def joined_span(spans: Iterable[CalibrationSpan]) -> CalibrationSpan | None:
    out: CalibrationSpan | None = None
    for span in spans:
        out = span if out is None else out.joined(span)
    return out


def _range(values: tuple[int, int], scale: float = 1.0, unit: str = "") -> str:
    low, high = (f"{v / scale:,.3g}{unit}" if scale != 1.0 else f"{v:,}" for v in values)
    return low if values[0] == values[1] else f"{low}-{high}"


def extrapolations(covered: CalibrationSpan, plan: CalibrationSpan) -> list[str]:
    """Each way `plan` goes beyond what the calibration's runs `covered`, in words; empty when it stays inside."""
    out = []
    for name, seen, wanted in (("GPU", covered.gpus, plan.gpus),
                               ("NVLink topology", covered.nvlink_topologies, plan.nvlink_topologies),
                               ("precision", covered.precisions, plan.precisions)):
        if not wanted <= seen:
            out.append(f"{name} {', '.join(sorted(wanted - seen))}: the calibration's runs used {', '.join(sorted(seen))}")
    for name, seen, wanted, scale, unit in (
        ("tp", covered.tp, plan.tp, 1.0, ""), ("cp", covered.cp, plan.cp, 1.0, ""), ("ep", covered.ep, plan.ep, 1.0, ""),
        ("model parameters", covered.parameters, plan.parameters, 1e9, "B"),
        ("tokens per microbatch", covered.microbatch_tokens, plan.microbatch_tokens, 1.0, ""),
    ):
        if wanted[0] < seen[0] or wanted[1] > seen[1]:
            out.append(f"{name} {_range(wanted, scale, unit)}: the calibration's runs span {_range(seen, scale, unit)}")
    # A plan without per-layer collectives does not use shard_overlap_fraction, whatever the runs measured it over.
    if not plan.shard_reaches - {UNSHARDED} <= covered.shard_reaches:
        seen = sorted(covered.shard_reaches - {UNSHARDED})
        out.append(f"ZeRO-2/3 sharding {', '.join(sorted(plan.shard_reaches - covered.shard_reaches))}: the "
                   f"calibration's runs sharded {' and '.join(seen) if seen else 'nothing per layer'}")
    return out


def measured_span(run: MeasuredRun | MeasuredCompute) -> CalibrationSpan:
    """What one calibration run covers: its layout's stages (a measured role: its stage shape, compute alone)."""
    problem = run.problem
    reach = UNSHARDED
    if isinstance(run, MeasuredCompute):
        shape = run.shape
        tps, cps, ep, micro_batch = (shape.tp,), (shape.cp,), shape.ep, shape.micro_batch_size
    elif isinstance(run.layout, ReplicaLayout):  # ZeRO-0/1 alone: ZeRO-2/3 run equal replicas
        tps = tuple(len(stage.devices) for replica in run.layout.replicas for stage in replica.stages)
        cps, ep, micro_batch = (1,), 1, run.layout.micro_batch_size
    else:
        layout = run.layout
        tps, cps, ep, micro_batch = (layout.tp,), (layout.cp,), layout.ep, layout.micro_batch_size
        dp = layout.dp if layout.dp is not None else slot_inventory(problem.cluster, layout.group_size).total // layout.pp
        zero_stage = problem.workload.zero_stage
        reach = shard_reach(zero_stage, layout.shape_dp_shard(dp, zero_stage) or dp, layout.tp, layout.cp,
                            problem.hardware.gpus_per_node)
    workload = problem.workload
    return CalibrationSpan.of(problem.hardware, problem.precision, tps, cps, ep, workload.model.total_params,
                              micro_batch * workload.seq_length, reach)
