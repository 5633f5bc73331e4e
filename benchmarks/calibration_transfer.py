"""How far a calibration of 1-3 measured runs carries to a stack's other runs (published data).

    python -m benchmarks.calibration_transfer            # print the table
    python -m benchmarks.calibration_transfer --write    # also update BENCHMARKS.md

The "cluster" is SC'21 Table 1 (Megatron-LM 2021, 32-3,072 A100s, 1.7B-1T parameters, its software
settings). The starting parameters are not the built-in fit (which has seen these runs) but a fit to
Korthikanti et al.'s runs alone, from the unfitted defaults: a model calibrated elsewhere. Every
subset of 1, 2 and 3 SC'21 runs is given to `planner.calibration.calibrate`, and the other runs are
predicted (simulated, as `/v1/estimate` answers) with the fitted parameters.
"""

from __future__ import annotations

import argparse
import itertools
import sys

from benchmarks.fidelity import CalibrationRun, _sc21_model_flops, load_runs
from cost_models.efficiency import EfficiencyParams
from planner.calibration import MeasuredRun, calibrate, predicted_s
from planner.devices import build_cluster_state
from planner.estimate import FixedLayout
from planner.problem import PlanningProblem

TARGET = 0.10


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
    start = calibrate([measured_run(r) for r in published if r.source == "korthikanti"], EfficiencyParams()).parameters
    before = [abs(predicted_s(run, start) / run.measured_s - 1) for run in sc21]
    lines = [f"Starting parameters (fitted to Korthikanti et al. only): "
             + ", ".join(f"{k} = {v:.4g}" for k, v in start.to_dict().items()),
             f"Uncalibrated on SC'21: mean |error| {100 * sum(before) / len(before):.1f}%, worst {100 * max(before):.1f}%.", "",
             "| runs calibrated on | subsets | every other run within 10% | median worst error | worst error (subset) |",
             "|---:|---:|---:|---:|---|"]
    for k in (1, 2, 3):
        results = sorted((max(transfer_errors(picks, sc21, start)), picks)
                         for picks in itertools.combinations(range(len(sc21)), k))
        within = sum(worst <= TARGET for worst, _ in results)
        worst, picks = results[-1]
        names = ", ".join(published[i].label for i in picks)
        lines.append(f"| {k} | {len(results)} | {within} ({100 * within / len(results):.0f}%) "
                     f"| {100 * results[len(results) // 2][0]:.1f}% | {100 * worst:.1f}% ({names}) |")
    text = "\n".join(lines)
    print(text)
    if args.write:
        from benchmarks.report import write_section
        write_section("Calibration from measured runs", "python -m benchmarks.calibration_transfer --write", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
