"""planner.calibration: which parameters a set of measured runs determines, and how far a fit carries.

Two kinds of evidence. Synthetic: "measurements" are the model's own predictions under hidden
parameters, so the right answer is known. Published: SC'21's runs (benchmarks/fidelity.py's data),
calibrated from parameters fitted only to another paper's runs (Korthikanti et al.), predicting the
SC'21 runs the calibration did not see.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from benchmarks.calibration_transfer import measured_run, transfer_errors
from benchmarks.fidelity import load_runs
from cost_models.efficiency import EfficiencyParams, SoftwareConfig, fitted_efficiency
from planner.calibration import RUN_NOISE_LOG, MeasuredRun, calibrate, predicted_s
from planner.estimate import FixedLayout
from tests.planner.helpers import small_problem

START = fitted_efficiency()


def _run(layout: FixedLayout, truth: EfficiencyParams, **problem) -> MeasuredRun:
    run = MeasuredRun(small_problem(gpu=replace(small_problem().hardware.gpu, memory_gib=40.0), **problem), layout, 1.0)
    return replace(run, measured_s=predicted_s(run, truth))


def _layouts() -> list[tuple[FixedLayout, dict]]:
    return [
        (FixedLayout(tp=1, pp=2, micro_batch_size=1, virtual_stages=1, schedule="1f1b", recompute="none"), {}),
        (FixedLayout(tp=4, pp=1, micro_batch_size=2, virtual_stages=1, schedule="1f1b", recompute="none"), {}),
        (FixedLayout(tp=2, pp=2, micro_batch_size=1, virtual_stages=1, schedule="1f1b", recompute="full"),
         {"seq_length": 2048}),
        (FixedLayout(tp=1, pp=3, micro_batch_size=4, virtual_stages=1, schedule="1f1b", recompute="none"),
         {"global_batch": 32}),
    ]


def test_a_slower_gemm_is_found_and_carries_to_an_unseen_layout():
    truth = replace(START, gemm_peak_fraction=START.gemm_peak_fraction * 0.5)
    runs = [_run(layout, truth, **extra) for layout, extra in _layouts()]
    unseen = runs[3]
    # Uncalibrated, the unseen run is 26% off.
    assert abs(predicted_s(unseen, START) / unseen.measured_s - 1) > 0.2
    # The whole fit (no shrinkage) finds the truth: it reproduces its runs and predicts the unseen one.
    whole = calibrate(runs[:3], START, noise_log=0.0)
    assert "gemm_peak_fraction" in whole.fitted and whole.fit_weight == 1.0
    assert whole.fit_mape < 0.02 and whole.cross_validated_mape < whole.default_mape / 2
    assert predicted_s(unseen, whole.parameters) == pytest.approx(unseen.measured_s, rel=0.04)
    # The answer takes most of that move, not all (three runs could owe some of it to the model's own error),
    # and still carries most of the way to the unseen run.
    fit = calibrate(runs[:3], START)
    assert 0.5 < fit.fit_weight < 1.0
    assert abs(predicted_s(unseen, fit.parameters) / unseen.measured_s - 1) < 0.10


def _fsdp_run(truth: EfficiencyParams, nodes: int, gpus_per_node: int, seq_length: int = 512) -> MeasuredRun:
    """ZeRO-3 over every GPU (tp 1, pp 1), 4 sequences a replica: the wider, the more traffic per layer."""
    dp = nodes * gpus_per_node
    layout = FixedLayout(tp=1, pp=1, micro_batch_size=1, virtual_stages=1, schedule="1f1b", recompute="none", dp=dp)
    return _run(layout, truth, num_nodes=nodes, gpus_per_node=gpus_per_node, zero_stage=3, seq_length=seq_length,
                global_batch=4 * dp)


def test_a_stack_that_hides_little_of_its_fsdp_traffic_is_found_from_runs_at_several_widths():
    """FSDP runs on 2 to 16 GPUs of a stack hiding 30% of its per-layer collectives (the built-in A100 fit hides
    them all): the fit moves shard_overlap_fraction well down and carries to an unseen run."""
    truth = replace(START, shard_overlap_fraction=0.3)
    runs = [_fsdp_run(truth, nodes, gpus) for nodes, gpus in ((1, 2), (1, 4), (2, 4), (4, 4))]
    fit = calibrate(runs, START)
    assert "shard_overlap_fraction" in fit.fitted and fit.parameters.shard_overlap_fraction < 0.7
    unseen = _fsdp_run(truth, 2, 4, seq_length=1024)
    assert predicted_s(unseen, fit.parameters) == pytest.approx(unseen.measured_s, rel=0.05)
    whole = calibrate(runs, START, noise_log=0.0)
    assert predicted_s(unseen, whole.parameters) == pytest.approx(unseen.measured_s, rel=0.02)
    assert abs(predicted_s(unseen, START) / unseen.measured_s - 1) > 0.10


def test_a_fit_ending_where_every_fsdp_collective_hides_is_not_reported_at_a_bound():
    """shard_overlap_fraction 1 is the frameworks' design, not the edge of what the model can mean: a stack whose FSDP
    runs ask for it (here faster than even that prices them) is working as designed, so `at_bound` stays empty."""
    start = replace(START, shard_overlap_fraction=0.8)
    runs = [_fsdp_run(START, nodes, gpus) for nodes, gpus in ((1, 2), (1, 4), (2, 4), (4, 4))]
    fit = calibrate([replace(run, measured_s=run.measured_s * 0.9) for run in runs], start, noise_log=0.0)
    assert "shard_overlap_fraction" in fit.fitted and fit.parameters.shard_overlap_fraction == pytest.approx(1.0)
    assert fit.at_bound == ()


def test_scatter_within_the_models_own_error_moves_no_parameter():
    runs = [_run(layout, START, **extra) for layout, extra in _layouts()]
    factors = (1.08, 0.92, 1.08, 0.92)
    fit = calibrate([replace(run, measured_s=run.measured_s * f) for run, f in zip(runs, factors)], START)
    # measured = start's prediction x factor: the start is |1 / factor - 1| off on each
    assert fit.default_mape == pytest.approx(sum(abs(1 / f - 1) for f in factors) / len(factors), rel=1e-6)
    # 8% either way is what the cost model's own error per run (RUN_NOISE_LOG, 7.9%) looks like: a parameter
    # fitted to it would chase that error, so the answer keeps the start, and so does each leave-one-out fit.
    assert fit.fitted and fit.fit_weight == 0.0 and fit.parameters == START
    assert fit.cross_validated_mape == pytest.approx(fit.default_mape, rel=1e-4)
    assert RUN_NOISE_LOG > math.log(1.08)


def test_scatter_beyond_the_models_error_is_fitted_and_carries_worse_than_the_start():
    runs = [_run(layout, START, **extra) for layout, extra in _layouts()]
    factors = (1.4, 0.7, 1.4, 0.7)
    fit = calibrate([replace(run, measured_s=run.measured_s * f) for run, f in zip(runs, factors)], START)
    # Fits to three runs follow what look like real effects and predict the fourth worse than the start does.
    assert fit.cross_validated_mape > fit.default_mape


def _gemm_run(fraction: float) -> MeasuredRun:
    return _run(*_layouts()[0][:1], replace(START, gemm_peak_fraction=START.gemm_peak_fraction * fraction))


def test_one_run_determines_one_parameter_and_names_the_rest():
    run = _gemm_run(0.35)
    deviation = predicted_s(run, START) / run.measured_s - 1
    assert deviation < -0.2
    fit = calibrate([run], START)
    assert len(fit.fitted) == 1 and len(fit.unidentified) == len(EfficiencyParams.field_names()) - 1
    assert fit.cross_validated_mape is None
    # One run cannot tell the stack's parameters from the model's error on it: the answer moves most of the way
    # (1 - (noise / deviation)^2 of it), toward the run and not past it.
    error = fit.runs[0].predicted_s / fit.runs[0].measured_s - 1
    assert deviation < error < 0 and abs(error) < 0.2 * abs(deviation)
    assert 0.8 < fit.fit_weight < 0.95
    # Taken whole, the fit reproduces the run.
    whole = calibrate([run], START, noise_log=0.0)
    assert whole.runs[0].predicted_s == pytest.approx(whole.runs[0].measured_s, rel=0.01)
    # The same run twice is still one run's worth of parameters.
    twice = calibrate([run] * 2, START)
    assert len(twice.fitted) == 1


def test_one_run_within_the_models_own_error_moves_nothing():
    run = _gemm_run(0.7)
    assert abs(math.log(predicted_s(run, START) / run.measured_s)) < RUN_NOISE_LOG
    fit = calibrate([run], START)
    assert fit.fit_weight == 0.0 and fit.parameters == START


def test_the_share_taken_grows_with_how_far_one_run_is_from_the_start():
    weights = [calibrate([_gemm_run(fraction)], START).fit_weight for fraction in (0.5, 0.35, 0.25)]
    assert 0 < weights[0] < weights[1] < weights[2] < 1


def test_one_runs_share_is_james_steins_and_taken_in_log_parameter():
    """Computed here from the predictions alone: the whole fit moves the run's log-time by d; the answer takes
    1 - (sigma / d)^2 of that move, and each parameter start^(1 - w) x whole^w."""
    run = _gemm_run(0.35)
    whole = calibrate([run], START, noise_log=0.0).parameters
    moved = math.log(predicted_s(run, whole) / predicted_s(run, START))
    fit = calibrate([run], START)
    assert fit.fit_weight == pytest.approx(1 - (RUN_NOISE_LOG / moved) ** 2, abs=0.01)
    w = fit.fit_weight
    (name,) = fit.fitted
    assert getattr(whole, name) != getattr(START, name)
    expected = getattr(START, name) ** (1 - w) * getattr(whole, name) ** w
    assert getattr(fit.parameters, name) == pytest.approx(expected, rel=1e-9)


def test_a_fit_pinned_at_a_bound_is_reported_though_the_answer_sits_inside_it():
    """Runs 20x slower than any efficiency in range explains: the whole fit stops at the bounds, and the shrunk
    answer just inside them still says the runs asked for more than the parameters can mean."""
    runs = [_run(layout, START, **extra) for layout, extra in _layouts()[:3]]
    fit = calibrate([replace(run, measured_s=run.measured_s * 20) for run in runs], START)
    assert 0 < fit.fit_weight < 1 and fit.at_bound
    assert set(fit.at_bound) == set(calibrate([replace(run, measured_s=run.measured_s * 20) for run in runs], START,
                                              noise_log=0.0).at_bound)


def test_a_parameter_the_runs_do_not_move_is_not_fitted():
    # No run here crosses nodes: the network's efficiency cannot change any prediction.
    truth = replace(START, gemm_peak_fraction=START.gemm_peak_fraction * 0.85)
    runs = [_run(layout, truth, num_nodes=1, gpus_per_node=8, **extra) for layout, extra in _layouts()]
    fit = calibrate(runs, START)
    assert "network_fraction" in fit.unidentified
    assert fit.parameters.network_fraction == START.network_fraction


def _sequence_series(truth: EfficiencyParams, software: SoftwareConfig) -> list[MeasuredRun]:
    """One layout at 512, 2,048, 4,096 and 8,192 tokens per sequence: attention's share of the time grows
    with it."""
    layout = FixedLayout(tp=1, pp=2, micro_batch_size=1, virtual_stages=1, schedule="1f1b", recompute="full")
    runs = []
    for seq_length in (512, 2048, 4096, 8192):
        problem = replace(small_problem(gpu=replace(small_problem().hardware.gpu, memory_gib=40.0),
                                        seq_length=seq_length), software=software)
        run = MeasuredRun(problem, layout, 1.0)
        runs.append(replace(run, measured_s=predicted_s(run, truth)))
    return runs


def test_a_slower_attention_is_told_apart_from_slower_gemms_by_sequence_length():
    # A stack whose GEMMs run at 0.85 and whose attention at half the modelled kernel speed (torchtitan's
    # context-parallel SDPA of 2024 runs near that): runs at three sequence lengths separate the two (and the
    # tiny model's per-layer overhead, which shrinks against the work as sequences grow).
    truth = replace(START, gemm_peak_fraction=START.gemm_peak_fraction * 0.85, attention_fraction=0.5)
    short, shorter_middle, middle, long = _sequence_series(truth, SoftwareConfig())
    fit = calibrate([short, shorter_middle, long], START)
    assert {"gemm_peak_fraction", "attention_fraction"} <= set(fit.fitted)
    # The fit's prior (PRIOR_WEIGHT) and the shrinkage hold it short of the truth.
    assert 0.5 <= fit.parameters.attention_fraction < 0.7
    assert predicted_s(middle, fit.parameters) == pytest.approx(middle.measured_s, rel=0.02)
    assert abs(predicted_s(middle, START) / middle.measured_s - 1) > 0.3


def test_unfused_attention_leaves_the_attention_fraction_unidentified():
    # attention_fraction prices fused kernels only: runs without them cannot move it.
    unfused = SoftwareConfig(flash_attention=False)
    truth = replace(START, gemm_peak_fraction=START.gemm_peak_fraction * 0.85)
    fit = calibrate(_sequence_series(truth, unfused), START)
    assert "attention_fraction" in fit.unidentified and fit.parameters.attention_fraction == 1.0


@pytest.fixture(scope="module")
def sc21_from_another_paper():
    published = load_runs()
    start = calibrate([measured_run(r) for r in published if r.source == "korthikanti"], EfficiencyParams(),
                      noise_log=0.0).parameters
    return [measured_run(r) for r in published if r.source == "sc21"], start


@pytest.mark.parametrize("picks", [(0, 6), (0, 4, 8)], ids=["1.7B+145.6B", "1.7B+39.1B+529.6B"])
def test_two_or_three_published_runs_predict_the_others_within_ten_percent(sc21_from_another_paper, picks):
    runs, start = sc21_from_another_paper
    assert max(transfer_errors(picks, runs, start)) <= 0.10
