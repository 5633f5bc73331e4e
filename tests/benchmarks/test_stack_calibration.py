"""The fidelity report's per-stack calibration: each source's runs split in two, each half calibrated and the
other predicted, and a held-out run's measurement never reaches the fit that predicts it."""

from __future__ import annotations

from dataclasses import replace

import pytest

import benchmarks.modern_runs as modern_runs
from benchmarks.fidelity import stack_calibration_report, stack_folds
from cost_models.gpu_efficiency import builtin_efficiency

SOURCE = "flagperf-megatron-core-0.6"  # five runs: small enough to calibrate in a test


def _source_runs(source: str = SOURCE) -> list:
    return [run for run in modern_runs.load_modern_runs() if run.source_id == source]


def _rows(lines: list[str]) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines
            if line.startswith(f"| {SOURCE} ")]


@pytest.mark.parametrize("source", sorted({run.source_id for run in modern_runs.load_modern_runs()}))
def test_every_run_is_held_out_exactly_once_and_never_by_a_fold_that_fits_it(source):
    runs = _source_runs(source)
    folds = stack_folds(runs)
    held = [run.label for _, out in folds for run in out]
    assert sorted(held) == sorted(run.label for run in runs)
    for train, out in folds:
        assert not {run.label for run in train} & {run.label for run in out}


def test_a_held_out_measurement_moves_its_prediction_error_but_not_its_fold_fit(monkeypatch):
    runs = _source_runs()
    monkeypatch.setattr(modern_runs, "load_modern_runs", lambda: runs)
    before = _rows(stack_calibration_report(builtin_efficiency))
    first_held = stack_folds(runs)[0][1][0]
    doubled = [replace(run, published_iteration_s=2 * run.published_iteration_s) if run is first_held else run
               for run in runs]
    monkeypatch.setattr(modern_runs, "load_modern_runs", lambda: doubled)
    after = _rows(stack_calibration_report(builtin_efficiency))
    assert len(before) == len(after) == 2
    # Fold 1 holds the run out: its fitted parameters and fit error stay, its held-out error grows.
    assert before[0][4:6] == after[0][4:6]
    assert float(after[0][6].split("%")[0]) > float(before[0][6].split("%")[0]) + 5
    # Fold 2 calibrates on it: its fit moves.
    assert before[1][5] != after[1][5]


def test_a_source_of_one_run_is_predicted_uncalibrated(monkeypatch):
    single = _source_runs()[:1]
    monkeypatch.setattr(modern_runs, "load_modern_runs", lambda: single)
    [row] = _rows(stack_calibration_report(builtin_efficiency))
    run = single[0]
    error = abs(modern_runs.predict_iteration_s(run, builtin_efficiency(run.hardware.gpu)) / run.published_iteration_s - 1)
    assert row[3] == "-" and row[4] == "none (one run)"
    assert row[6] == f"{100 * error:.1f}% ({100 * error:.1f}%)"


def test_the_model_error_calibrations_shrink_by_is_what_the_published_stacks_measure():
    """planner.calibration.RUN_NOISE_LOG is a measurement, not a tuning knob: the published stacks' residuals under
    whole fits to all their runs. A cost model change that moves it makes this fail until the constant follows."""
    from benchmarks.calibration_transfer import priced_stacks, run_noise_log
    from planner.calibration import RUN_NOISE_LOG

    noise_log, runs, fitted = run_noise_log(priced_stacks())
    assert runs >= 70 and 0 < fitted < runs
    assert noise_log == pytest.approx(RUN_NOISE_LOG, abs=0.0015)
