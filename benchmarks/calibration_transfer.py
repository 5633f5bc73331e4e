"""How far a calibration of 1-3 measured runs carries to a stack's other runs (published data).

    python -m benchmarks.calibration_transfer            # print the table
    python -m benchmarks.calibration_transfer --write    # also update BENCHMARKS.md

The "cluster" is SC'21 Table 1 (Megatron-LM 2021, 32-3,072 A100s, 1.7B-1T parameters, its software
settings). The starting parameters are not the built-in fit (which has seen these runs) but a fit to
Korthikanti et al.'s runs alone, from the unfitted defaults: a model calibrated elsewhere. Every
subset of 1, 2 and 3 SC'21 runs is given to `planner.calibration.calibrate`, and the other runs are
predicted (simulated, as `/v1/estimate` answers) with the fitted parameters.

The same is done per software stack of the published 2023+ H100/H200 runs (`calibration/modern_runs.json`)
that has at least two runs the model can price, starting from its GPU's built-in parameters: the A100 fit, with
Hopper's attention and FSDP overlap fractions, which `benchmarks.fidelity --fit` fits to half of these runs (so the
start has seen some).
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from dataclasses import dataclass

from benchmarks.fidelity import CalibrationRun, _sc21_model_flops, load_runs
from benchmarks.modern_runs import ModernRun, balanced_split, load_modern_runs
from cost_models.efficiency import EfficiencyParams
from cost_models.gpu_efficiency import builtin_efficiency
from planner.calibration import RUN_NOISE_LOG, MeasuredRun, calibrate, predicted_s
from planner.devices import build_cluster_state
from planner.errors import PlanningError
from planner.estimate import FixedLayout
from planner.problem import PlanningProblem

TARGET = 0.10
# A stack with many runs has too many subsets to calibrate on each (19 runs: 969 of 3); past this many,
# every n-th subset in lexicographic order is taken (deterministic), and the table says so.
MAX_SUBSETS = 100


def measured_run(run: CalibrationRun) -> MeasuredRun:
    """A published run as a calibration run: its layout on exactly its GPUs, its measured seconds."""
    shape, hardware = run.shape, run.hardware
    gpus = shape.tp * shape.pp * shape.dp
    problem = PlanningProblem(
        hardware=hardware, cluster=build_cluster_state(-(-gpus // hardware.gpus_per_node), hardware.gpus_per_node, [], []),
        workload=run.workload, model_name=run.label, micro_batch_size=shape.micro_batch_size, recompute=shape.recompute,
        precision="fp16", software=run.software, memory_reserve_gib=0.0,  # the published runs ran: they fit
    )
    layout = FixedLayout(tp=shape.tp, pp=shape.pp, micro_batch_size=shape.micro_batch_size,
                         virtual_stages=shape.virtual_stages, schedule=shape.schedule, recompute=shape.recompute,
                         layers_per_stage=None, dp=shape.dp)
    seconds = run.published if run.unit == "s/iteration" else _sc21_model_flops(run.workload) / (run.published * 1e12 * gpus)
    return MeasuredRun(problem, layout, seconds)


def measured_modern_run(run: ModernRun) -> MeasuredRun:
    """A published 2023+ run as a calibration run, with the software settings its source states."""
    shape, hardware = run.shape, run.hardware
    problem = PlanningProblem(
        hardware=hardware, cluster=build_cluster_state(-(-shape.devices // hardware.gpus_per_node), hardware.gpus_per_node,
                                                       [], []),
        workload=run.workload, model_name=run.label, micro_batch_size=shape.micro_batch_size, recompute=shape.recompute,
        precision=run.precision, software=run.software, memory_reserve_gib=0.0,
    )
    layers = run.workload.model.num_layers
    split = None if layers % shape.pp == 0 or run.layers_per_chunk is not None else tuple(balanced_split(layers, shape.pp))
    # Every degree the run states, as the fidelity report prices it (`benchmarks.modern_runs.predict_iteration_s`):
    # without cp a long-context run holds whole sequences and does not fit, without v its bubble is 1F1B's.
    layout = FixedLayout(tp=shape.tp, pp=shape.pp, micro_batch_size=shape.micro_batch_size, recompute=shape.recompute,
                         layers_per_stage=split, dp=shape.dp, virtual_stages=shape.virtual_stages,
                         schedule=shape.schedule, cp=shape.cp, ep=shape.ep, etp=shape.etp, dp_shard=shape.dp_shard,
                         layers_per_chunk=run.layers_per_chunk)
    return MeasuredRun(problem, layout, run.published_iteration_s)


def transfer_rows(runs: list[MeasuredRun], start: EfficiencyParams, labels: list[str]) -> list[str]:
    """Table rows: for 1, 2 and 3 runs calibrated on, over every such subset, the mean |error| on the other
    runs (the issue's per-stack MAPE), the same runs' mean |error| uncalibrated (does calibrating help?), and
    whether every other run is within 10%."""
    uncalibrated = [abs(predicted_s(run, start) / run.measured_s - 1) for run in runs]
    rows = []
    for k in (1, 2, 3):
        if k >= len(runs):
            break
        results, before = [], []
        every = list(itertools.combinations(range(len(runs)), k))
        stride = -(-len(every) // MAX_SUBSETS)
        for picks in every[::stride]:
            errors = transfer_errors(picks, runs, start)
            results.append((max(errors), sum(errors) / len(errors), picks))
            others = [error for i, error in enumerate(uncalibrated) if i not in picks]
            before.append(sum(others) / len(others))
        mapes = sorted(mape for _, mape, _ in results)
        before.sort()
        mape_within = sum(mape <= TARGET for mape in mapes)
        within = sum(worst <= TARGET for worst, _, _ in results)
        worst, _, picks = max(results)
        names = ", ".join(labels[i] for i in picks)
        counted = f"{len(results)}" if stride == 1 else f"{len(results)} of {len(every)} (one in {stride})"
        rows.append(f"| {k} | {counted} | {mape_within} ({100 * mape_within / len(results):.0f}%) "
                    f"| {100 * mapes[len(mapes) // 2]:.1f}% | {100 * before[len(before) // 2]:.1f}% "
                    f"| {within} ({100 * within / len(results):.0f}%) "
                    f"| {100 * worst:.1f}% ({names}) |")
    return rows


TABLE_HEAD = ["| runs calibrated on | subsets | MAPE on the others within 10% | median MAPE "
              "| the same runs uncalibrated: median MAPE | every other run within 10% | worst error (subset) |",
              "|---:|---:|---:|---:|---:|---:|---|"]


@dataclass(frozen=True)
class PricedStack:
    """One software stack's published runs that the model can price, from its GPU's built-in parameters."""

    name: str
    start: EfficiencyParams
    runs: list[MeasuredRun]
    published: list[ModernRun]  # the same runs, as published
    refused: list[str]  # runs the memory model says cannot fit, yet ran: reported, not priced


def priced_stacks() -> list[PricedStack]:
    by_stack: dict[str, list[ModernRun]] = {}
    for run in load_modern_runs():
        by_stack.setdefault(run.source_id, []).append(run)
    stacks = []
    for name, published in by_stack.items():
        start = builtin_efficiency(published[0].hardware.gpu)
        runs, kept, refused = [], [], []
        for published_run in published:
            run = measured_modern_run(published_run)
            try:
                predicted_s(run, start)
            except PlanningError as error:
                refused.append(f"{published_run.label}: {error}")
                continue
            runs.append(run)
            kept.append(published_run)
        stacks.append(PricedStack(name, start, runs, kept, refused))
    return stacks


def run_noise_log(stacks: list[PricedStack]) -> tuple[float, int, int]:
    """The cost model's error per run (standard deviation of log-time) on each stack of two or more runs fitted on
    all its runs, whole (no shrinkage): (sigma, runs, parameters fitted over all stacks)."""
    residuals: list[float] = []
    fitted = 0
    for stack in stacks:
        if len(stack.runs) < 2:
            continue
        whole = calibrate(stack.runs, stack.start, noise_log=0.0)
        residuals += [math.log(run.predicted_s / run.measured_s) for run in whole.runs]
        fitted += len(whole.fitted)
    return math.sqrt(sum(r * r for r in residuals) / (len(residuals) - fitted)), len(residuals), fitted


def modern_stack_report() -> list[str]:
    """Per stack of the 2023+ runs: uncalibrated error, then the transfer table; then the model's error per run."""
    stacks = priced_stacks()
    lines = []
    for stack in stacks:
        if stack.refused:
            lines += ["", f"{stack.name}: left out, not priceable: " + "; ".join(stack.refused)]
        if len(stack.runs) < 2:
            continue
        before = [abs(predicted_s(run, stack.start) / run.measured_s - 1) for run in stack.runs]
        lines += ["", f"{stack.name} ({len(stack.runs)} runs): uncalibrated mean |error| "
                  f"{100 * sum(before) / len(before):.1f}%, worst {100 * max(before):.1f}%.", ""] + TABLE_HEAD
        labels = [r.label.split(",")[0] + f" ({r.shape.devices} GPUs{', ' + r.precision if r.precision != 'bf16' else ''}"
                  f"{', async TP' if r.software.async_tp else ''})" for r in stack.published]
        lines += transfer_rows(stack.runs, stack.start, labels)
    noise_log, runs, fitted = run_noise_log(stacks)
    lines += ["", f"The cost model's own error per run on a stack fitted on all its runs (whole fits, no shrinkage): "
              f"{noise_log:.3f} in log-time ({runs} runs less {fitted} fitted parameters; "
              f"`planner.calibration.RUN_NOISE_LOG` is {RUN_NOISE_LOG})."]
    return lines


def transfer_errors(picks: tuple[int, ...], runs: list[MeasuredRun], start: EfficiencyParams) -> list[float]:
    """|error| of every run not in `picks`, predicted by a calibration on `picks`."""
    fit = calibrate([runs[i] for i in picks], start)
    return [abs(predicted_s(run, fit.parameters) / run.measured_s - 1) for i, run in enumerate(runs) if i not in picks]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="write the table into BENCHMARKS.md")
    args = parser.parse_args(argv)
    published = load_runs()
    sc21 = [measured_run(r) for r in published if r.source == "sc21"]
    # Taken whole (no shrinkage), as the built-in fit is: a model fitted elsewhere.
    start = calibrate([measured_run(r) for r in published if r.source == "korthikanti"], EfficiencyParams(),
                      noise_log=0.0).parameters
    before = [abs(predicted_s(run, start) / run.measured_s - 1) for run in sc21]
    lines = [f"Starting parameters (fitted to Korthikanti et al. only): "
             + ", ".join(f"{k} = {v:.4g}" for k, v in start.to_dict().items()),
             f"Uncalibrated on SC'21: mean |error| {100 * sum(before) / len(before):.1f}%, worst {100 * max(before):.1f}%.",
             ""] + TABLE_HEAD
    lines += transfer_rows(sc21, start, [r.label for r in published if r.source == "sc21"])
    lines += ["", "Published 2023+ H100/H200 runs, per software stack with at least 2 priceable runs, starting from "
              "their GPU's built-in parameters (the A100 fit, with Hopper's attention and FSDP overlap, fitted to half of these "
              "runs by `benchmarks.fidelity --fit`):"] + modern_stack_report()
    text = "\n".join(lines)
    print(text)
    if args.write:
        from benchmarks.report import write_section
        write_section("Calibration from measured runs", "python -m benchmarks.calibration_transfer --write", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
