"""Cost-model fidelity against published Megatron-LM runs (and the fit of its six parameters).

    python -m benchmarks.fidelity            # predict every calibration run, print errors
    python -m benchmarks.fidelity --fit      # refit EfficiencyParams, write the preset
    python -m benchmarks.fidelity --write    # also update BENCHMARKS.md
    python -m benchmarks.fidelity --joint-fit   # also what fitting half the 2023+ runs would do

Every run also prints the per-stack calibration (`stack_calibration_report`): each 2023+ source calibrated
on half its runs, as a user calibrates their stack, and the other half predicted.

Calibration data (copied from ../shared/calibration, unchanged):
SC'21 Table 1 (TFLOP/s per GPU, full recompute) and Korthikanti et al.
iteration times (full recompute; sequence parallel + selective) and memory.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from cost_models.efficiency import (
    CALIBRATION_BOUNDS,
    EFFICIENCY_BOUNDS,
    MEASURED_EFFICIENCY,
    MEGATRON_2021,
    EfficiencyParams,
    SoftwareConfig,
    HOPPER_FITTED,
    fitted_efficiency,
    fitted_hopper_params,
)
from cost_models.gpu_efficiency import efficiency_for_gpu, is_hopper_class
from cost_models.hardware import GIB, GpuSpec, gpu_preset
from cost_models.iteration import estimate_iteration
from cost_models.layout import Hardware, ParallelShape, Workload
from cost_models.model_spec import ModelSpec
from cost_models.stage_costs import stage_cost_terms
from planner.calibration_span import CalibrationSpan, extrapolations, joined_span, shard_reach

CALIBRATION_DIR = Path(__file__).with_name("calibration")
FITTED_PATH = Path(__file__).resolve().parent.parent / "cost_models" / "presets" / "fitted_efficiency.json"
SC21_TARGET_MAPE = 0.05
KORTHIKANTI_TARGET_MAPE = 0.10


@dataclass(frozen=True)
class CalibrationRun:
    source: str
    label: str
    workload: Workload
    hardware: Hardware
    shape: ParallelShape
    software: SoftwareConfig
    published: float  # TFLOP/s per GPU (sc21) or seconds per iteration (korthikanti)
    unit: str


def _gpt(name: str, layers: int, hidden: int, heads: int, vocab: int) -> ModelSpec:
    return ModelSpec(
        name=name, num_layers=layers, hidden_size=hidden, ffn_hidden_size=4 * hidden,
        num_attention_heads=heads, num_kv_heads=heads, vocab_size=vocab, swiglu=False, tied_embeddings=True,
    )


def _a100_hardware() -> Hardware:
    gpu = gpu_preset("A100-80GB")
    # 8 x 200 Gb/s HDR per node = 25 GB/s per GPU; NVSwitch 300 GB/s per GPU.
    return Hardware(gpu=gpu, gpus_per_node=8, intra_node_bandwidth_gb_s=300.0, inter_node_bandwidth_gb_s=25.0)


def load_runs(directory: Path = CALIBRATION_DIR) -> list[CalibrationRun]:
    runs: list[CalibrationRun] = []
    hardware = _a100_hardware()
    sc21 = json.loads((directory / "megatron_sc21_table1.json").read_text())
    cols = sc21["columns"]
    vocab = int(sc21["common"]["vocab_size"])
    seq = int(sc21["common"]["seq_length"])
    for values in sc21["rows"]:
        row = dict(zip(cols, values))
        layers, pp = row["layers"], row["pp"]
        per_virtual = row["layers_per_virtual_stage"]
        virtual = layers // (pp * per_virtual) if per_virtual else 1
        dp = row["gpus"] // (row["tp"] * pp)
        runs.append(CalibrationRun(
            source="sc21", label=f"{row['params_b']}B",
            workload=Workload(_gpt(f"gpt-{row['params_b']}b", layers, row["hidden"], row["heads"], vocab), seq, row["global_batch"], zero_stage=0),
            hardware=hardware,
            shape=ParallelShape(tp=row["tp"], pp=pp, dp=dp, micro_batch_size=row["micro_batch"], recompute="full",
                                schedule="interleaved" if virtual > 1 else "1f1b", virtual_stages=virtual),
            software=MEGATRON_2021, published=float(row["tflops_per_gpu"]), unit="TFLOP/s/GPU",
        ))
    kor = json.loads((directory / "korthikanti_table5.json").read_text())
    cols = kor["columns"]
    common = kor["common"]
    for values in kor["rows"]:
        row = dict(zip(cols, values))
        model = _gpt(f"gpt-{row['model']}", row["layers"], row["hidden"], row["heads"], int(common["vocab_size"]))
        virtual = row["virtual_stages"]
        for recompute, software, column in (
            ("full", MEGATRON_2021, "iteration_s_full_recompute"),
            ("selective", replace(MEGATRON_2021, sequence_parallel=True), "iteration_s_sequence_parallel_plus_selective"),
        ):
            runs.append(CalibrationRun(
                source="korthikanti", label=f"{row['model']} {recompute}",
                workload=Workload(model, int(common["seq_length"]), row["global_batch"], zero_stage=0),
                hardware=hardware,
                shape=ParallelShape(tp=row["tp"], pp=row["pp"], dp=1, micro_batch_size=row["micro_batch"], recompute=recompute,
                                    schedule="interleaved" if virtual > 1 else "1f1b", virtual_stages=virtual),
                software=software, published=float(row[column]), unit="s/iteration",
            ))
    return runs


def _sc21_model_flops(workload: Workload) -> float:
    """The paper's own count: 96 B s L h^2 (1 + s/(6h) + V/(16 L h))."""
    m = workload.model
    b, s, layers, h, v = workload.global_batch_size, workload.seq_length, m.num_layers, m.hidden_size, m.vocab_size
    return 96 * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))


def predict(run: CalibrationRun, efficiency: EfficiencyParams) -> float:
    terms = stage_cost_terms(run.workload, run.hardware, run.shape, efficiency, run.software)
    layers = run.workload.model.num_layers // run.shape.pp
    split = [layers] * run.shape.pp
    split[-1] += run.workload.model.num_layers - layers * run.shape.pp
    iteration_s = estimate_iteration(terms, split).iteration_ms / 1e3
    if run.source == "sc21":
        return _sc21_model_flops(run.workload) / (iteration_s * run.shape.devices) / 1e12
    return iteration_s


def mape(runs: list[CalibrationRun], efficiency: EfficiencyParams, source: str) -> float:
    errors = [abs(predict(r, efficiency) / r.published - 1) for r in runs if r.source == source]
    return sum(errors) / len(errors)


def korthikanti_memory_rows(directory: Path = CALIBRATION_DIR) -> list[tuple[str, float, float, float, float]]:
    """(model, published state GiB, predicted, published activations (SP+selective) GiB, predicted)."""
    from cost_models.memory import layer_activation_bytes, state_bytes_per_param

    kor = json.loads((directory / "korthikanti_table5.json").read_text())
    shapes = {row[0]: dict(zip(kor["columns"], row)) for row in kor["rows"]}
    out = []
    for model_name, state_gib, _none_gib, selective_gib in kor["memory_gib"]["rows"]:
        row = shapes[model_name]
        model = _gpt(model_name, row["layers"], row["hidden"], row["heads"], int(kor["common"]["vocab_size"]))
        tp, pp, v = row["tp"], row["pp"], row["virtual_stages"]
        params_per_gpu = model.num_layers * model.params_per_layer / (tp * pp)
        state = params_per_gpu * state_bytes_per_param(0, 1) / GIB
        software = replace(MEGATRON_2021, sequence_parallel=True)
        per_layer = layer_activation_bytes(model, int(kor["common"]["seq_length"]), row["micro_batch"], tp, "selective", software)
        # First stage of (interleaved) 1F1B holds L (1 + (p-1)/(p v)) layer-microbatches.
        interleave = 1 + (pp - 1) / (pp * v) if v > 1 else 1.0
        activations = per_layer * model.num_layers * interleave / GIB
        out.append((model_name, state_gib, state, selective_gib, activations))
    return out


def _pinned(name: str) -> bool:
    """A parameter whose built-in range is one point (attention_fraction, shard_overlap_fraction): never fitted, it keeps its value."""
    low, high = EFFICIENCY_BOUNDS[name]
    return low == high


# Nelder-Mead's convergence tolerance on the log-parameters: 0.01%.
FIT_LOG_TOLERANCE = 1e-4


def fit(runs: list[CalibrationRun], start: EfficiencyParams, modern: list | None = None,
        held: dict[str, float] | None = None) -> EfficiencyParams:
    """Least squares on relative errors (each source weighted equally: SC'21, Korthikanti and, when given,
    the `modern` runs together) over log-parameters; the `held` ones (default: the measured link
    efficiencies, `MEASURED_EFFICIENCY`) keep their values."""
    from benchmarks.modern_runs import predict_iteration_s

    from scipy.optimize import minimize

    held = MEASURED_EFFICIENCY if held is None else held
    bounds = EFFICIENCY_BOUNDS
    names = [n for n in EfficiencyParams.field_names() if n not in held and not _pinned(n)]

    def params_of(x) -> EfficiencyParams:
        values = {n: min(max(math.exp(v), bounds[n][0]), bounds[n][1]) for n, v in zip(names, x)}
        return EfficiencyParams(**values, **held)

    def loss(x) -> float:
        p = params_of(x)
        total = 0.0
        for source in ("sc21", "korthikanti"):
            errs = [(predict(r, p) / r.published - 1) ** 2 for r in runs if r.source == source]
            total += sum(errs) / len(errs)
        if modern:
            total += sum((predict_iteration_s(r, p) / r.published_iteration_s - 1) ** 2 for r in modern) / len(modern)
        return total

    x0 = [math.log(getattr(start, n)) for n in names]
    result = minimize(loss, x0, method="Nelder-Mead", options={"maxiter": 4000, "xatol": FIT_LOG_TOLERANCE,
                                                                 "fatol": 1e-9})
    return params_of(result.x)


def settled(refit: EfficiencyParams, stored: EfficiencyParams) -> EfficiencyParams:
    """`stored` where `refit` (a fit started from it) moved no parameter by more than the fit's own tolerance:
    Nelder-Mead restarted from its answer wanders within that tolerance, and each rerun of `--fit` would otherwise
    rewrite the fifth digit and every plan priced with it."""
    moved = max(abs(math.log(getattr(refit, name) / getattr(stored, name))) for name in EfficiencyParams.field_names())
    return stored if moved <= FIT_LOG_TOLERANCE else refit


def table(runs: list[CalibrationRun], efficiency: EfficiencyParams) -> str:
    lines = ["| source | run | layout (tp, pp, dp, mbs, v, recompute) | published | predicted | error |",
             "|---|---|---|---:|---:|---:|"]
    for r in runs:
        s = r.shape
        pred = predict(r, efficiency)
        lines.append(
            f"| {r.source} | {r.label} | {s.tp}, {s.pp}, {s.dp}, {s.micro_batch_size}, {s.virtual_stages}, {s.recompute} "
            f"| {r.published:.2f} {r.unit} | {pred:.2f} | {100 * (pred / r.published - 1):+.1f}% |"
        )
    return "\n".join(lines)


def modern_table(efficiency_for: Callable[[GpuSpec], EfficiencyParams], fitted: frozenset[str] = frozenset()) -> list[str]:
    """Each 2023+ run's published and predicted seconds per iteration (and tokens/s per GPU), priced with its GPU's
    parameters (`efficiency_for`), and whether Hopper's parameters were fitted on it (`fitted`: labels); then
    the mean |error| of the fitted and the held-out runs, per source, over all, and per feature (`run_feature`:
    FP8, ZeRO-2, ZeRO-3 / FSDP reported apart)."""
    from benchmarks.modern_runs import load_modern_runs, predict_iteration_s

    lines = ["| source | run | mbs, recompute | published s (tokens/s/GPU) | predicted s | error | attention fraction |",
             "|---|---|---|---:|---:|---:|---|"]
    errors: dict[str, list[float]] = {}
    by_feature: dict[str, list[float]] = {}
    by_role: dict[str, list[float]] = {}
    for run in load_modern_runs():
        predicted = predict_iteration_s(run, efficiency_for(run.hardware.gpu))
        error = predicted / run.published_iteration_s - 1
        role = "fitted" if run.label in fitted else "held out"
        errors.setdefault(run.source_id, []).append(abs(error))
        by_feature.setdefault(run_feature(run), []).append(abs(error))
        by_role.setdefault(role, []).append(abs(error))
        if role == "held out" and run_feature(run) != "moe":
            by_role.setdefault("held out, dense", []).append(abs(error))
        lines.append(f"| {run.source_id} | {run.label} | {run.shape.micro_batch_size}, {run.shape.recompute} "
                     f"| {run.published_iteration_s:.3f} ({run.tokens_per_s_per_gpu:,.0f}) | {predicted:.3f} "
                     f"| {100 * error:+.1f}% | {role} |")
    every = [e for source in errors.values() for e in source]
    lines += ["", "Mean |error| of the runs Hopper's parameters are fitted on and of the others: " + "; ".join(
        f"{role} {_mean_text(by_role.get(role, []))}" for role in ("fitted", "held out", "held out, dense")) + "."]
    lines += ["Mean |error| per source: " + "; ".join(
        f"{source} {100 * sum(e) / len(e):.1f}% ({len(e)} runs)" for source, e in errors.items())
        + f"; all {100 * sum(every) / len(every):.1f}% ({len(every)} runs)."]
    lines += ["Per feature: " + "; ".join(
        f"{feature} {100 * sum(e) / len(e):.1f}% ({len(e)} runs)" for feature, e in sorted(by_feature.items()))
        + "."]
    return lines


def run_feature(run) -> str:
    """What a modern run exercises beyond the BF16 ZeRO-0/1 baseline, for the per-feature errors."""
    if run.workload.model.is_moe:
        return "moe"
    if run.shape.cp > 1:
        return "cp"
    if run.precision == "fp8":
        return "fp8"
    if run.workload.zero_stage >= 2:
        return f"zero-{run.workload.zero_stage}"
    return "bf16"


def modern_split() -> tuple[list, list]:
    """(fitted, held out): the dense 2023+ runs on Hopper-class GPUs, each source's sorted by GPU count and taken
    alternately, the first to the fit. Mixtures of experts are in neither: their error (the per-feature line)
    comes from work the parameters do not price (token permutation, routing, grouped GEMMs, overlapped
    dispatch), which a fit would smear over the dense runs."""
    from benchmarks.modern_runs import load_modern_runs

    by_source: dict[str, list] = {}
    for run in load_modern_runs():
        if run_feature(run) != "moe" and is_hopper_class(run.hardware.gpu):
            by_source.setdefault(run.source_id, []).append(run)
    train, held = [], []
    for source_runs in by_source.values():
        for i, run in enumerate(sorted(source_runs, key=lambda r: (r.shape.devices, r.label))):
            (train if i % 2 == 0 else held).append(run)
    return train, held


def fit_hopper_params(base: EfficiencyParams, runs: list) -> dict[str, float]:
    """Hopper's `HOPPER_FITTED` (attention and FSDP overlap), the other parameters `base`'s: least squares on
    relative errors over their logs, each source weighted equally, as `fit` weighs its sources, within a user
    calibration's ranges. Nelder-Mead from the middle of the ranges: the overlap's price has a kink where a layer's
    collectives stop hiding, which a gradient method would stall on."""
    from benchmarks.modern_runs import predict_iteration_s

    from scipy.optimize import minimize

    by_source: dict[str, list] = {}
    for run in runs:
        by_source.setdefault(run.source_id, []).append(run)
    bounds = [tuple(math.log(edge) for edge in CALIBRATION_BOUNDS[name]) for name in HOPPER_FITTED]

    def params_of(logs) -> EfficiencyParams:
        return replace(base, **{name: math.exp(x) for name, x in zip(HOPPER_FITTED, logs)})

    def loss(logs) -> float:
        params = params_of(logs)
        return sum(sum((predict_iteration_s(r, params) / r.published_iteration_s - 1) ** 2 for r in rs) / len(rs)
                   for rs in by_source.values())

    middle = [(low + high) / 2 for low, high in bounds]
    result = minimize(loss, middle, method="Nelder-Mead", bounds=bounds,
                      options={"xatol": FIT_LOG_TOLERANCE, "fatol": 1e-10, "maxiter": 400})
    return {name: math.exp(x) for name, x in zip(HOPPER_FITTED, result.x)}


def _hopper_text(hopper: dict[str, float]) -> str:
    return ", ".join(f"{name} {value:.4g}" for name, value in hopper.items())


def swapped_halves_report(base: EfficiencyParams, fitted_runs: list, held_runs: list) -> list[str]:
    """How much the held-out error owes to which half was held out: Hopper's parameters fitted to each half
    in turn (the stored fit is the first), the other half predicted; together every dense run predicted once by a
    fit that never saw it."""
    from benchmarks.modern_runs import predict_iteration_s

    def errors(hopper: dict[str, float], runs: list) -> list[float]:
        params = replace(base, **hopper)
        return [abs(predict_iteration_s(r, params) / r.published_iteration_s - 1) for r in runs]

    first, second = fit_hopper_params(base, fitted_runs), fit_hopper_params(base, held_runs)
    on_held, on_fitted = errors(first, held_runs), errors(second, fitted_runs)
    return [f"Both ways: fitted to the `fitted` half, Hopper's parameters are {_hopper_text(first)} and the held-out "
            f"dense runs are off by {_mean_text(on_held)}; fitted to the held-out half instead, {_hopper_text(second)}, "
            f"and the `fitted` half is off by {_mean_text(on_fitted)}; every dense run predicted by a fit that never "
            f"saw it: {_mean_text(on_held + on_fitted)}."]


def joint_fit_report(runs: list[CalibrationRun], start: EfficiencyParams) -> list[str]:
    """What fitting the 2023+ runs too, with parameters shared with A100, would do: fit on the A100 runs and the
    runs `modern_split` fits on, report the rest as held out. Nothing is saved."""
    from benchmarks.modern_runs import predict_iteration_s

    train, held = modern_split()
    params = fit(runs, start, train)

    def mean_error(chosen: list) -> float:
        return sum(abs(predict_iteration_s(r, params) / r.published_iteration_s - 1) for r in chosen) / len(chosen)

    at_bound = [n for n, (lo, hi) in EFFICIENCY_BOUNDS.items() if not _pinned(n) and (
        math.isclose(getattr(params, n), lo) or math.isclose(getattr(params, n), hi))]
    # attention_fraction is a stack's, not the hardware's: one value over every stack's runs would mean nothing.
    return ["Joint fit, one parameter set for A100 and Hopper (A100 runs + the fitted half above; not saved): "
            + ", ".join(f"{k} = {v:.4g}" for k, v in params.to_dict().items() if not _pinned(k))
            + "; held: " + ", ".join(f"{k} = {v:.4g}" for k, v in params.to_dict().items() if _pinned(k)),
            f"At a bound: {', '.join(at_bound) or 'none'}. SC'21 {100 * mape(runs, params, 'sc21'):.2f}%, "
            f"Korthikanti {100 * mape(runs, params, 'korthikanti'):.2f}%, 2023+ fitted {100 * mean_error(train):.1f}% "
            f"({len(train)} runs), held out {100 * mean_error(held):.1f}% ({len(held)} runs)."]


@dataclass(frozen=True)
class PublishedRun:
    """A 2023+ run as `planner.calibration.calibrate` takes it: priced like the fidelity table (`predict_iteration_s`,
    the bubble model of the exact published layout, with no memory check: the runs ran)."""

    run: object  # benchmarks.modern_runs.ModernRun
    measured_s: float


def _published_s(published: PublishedRun, efficiency: EfficiencyParams) -> float:
    from benchmarks.modern_runs import predict_iteration_s

    return predict_iteration_s(published.run, efficiency)


def run_span(run) -> CalibrationSpan:
    """A 2023+ run's span, as a calibration on it would cover (`planner.calibration_span`)."""
    shape, workload = run.shape, run.workload
    reach = shard_reach(workload.zero_stage, shape.dp_shard or shape.dp, shape.tp, shape.cp, run.hardware.gpus_per_node)
    return CalibrationSpan.of(run.hardware, run.precision, (shape.tp,), (shape.cp,), shape.ep,
                              workload.model.total_params, shape.micro_batch_size * workload.seq_length, reach)


def stack_folds(runs: list) -> list[tuple[list, list]]:
    """Two folds of one source's runs: sorted by GPU count, alternate runs on each side, each side fitted once
    and predicting the other. A source of one run has nothing to calibrate on: one fold that fits nothing."""
    ordered = sorted(runs, key=lambda r: (r.shape.devices, r.label))
    evens, odds = ordered[0::2], ordered[1::2]
    return [([], evens)] if not odds else [(evens, odds), (odds, evens)]


def stack_calibration_report(start_for: Callable[[GpuSpec], EfficiencyParams]) -> list[str]:
    """Each 2023+ source (a software stack) calibrated as a user would (`planner.calibration.calibrate`, what POST
    /v1/calibrations runs, from its GPU's built-in parameters, `start_for`) on half its runs and predicting the
    other half, both ways. Fit errors are the calibrated runs', held-out errors the others'; a source of one run
    is predicted uncalibrated."""
    from benchmarks.modern_runs import load_modern_runs
    from planner.calibration import calibrate

    by_source: dict[str, list] = {}
    for run in load_modern_runs():
        by_source.setdefault(run.source_id, []).append(run)
    lines = ["| source | runs | fold | calibrated on (GPUs) | parameters fitted | fit MAPE | held-out MAPE (worst) |",
             "|---|---:|---:|---|---|---:|---:|"]
    fitted_errors: list[float] = []
    held_errors: list[float] = []
    inside: list[float] = []  # held-out errors of runs inside their fold's calibrated span
    outside: list[float] = []
    parallel_outside: list[float] = []  # of those outside, runs whose CP or EP degree the fold's runs lack
    sharding_outside: list[float] = []  # of those outside, runs sharding ZeRO-2/3 where the fold's runs did not
    for source, runs in by_source.items():
        start = start_for(runs[0].hardware.gpu)
        for k, (train, held) in enumerate(stack_folds(runs), start=1):
            parameters, names, fit_errors = start, "none (one run)", []
            if train:
                fit = calibrate([PublishedRun(r, r.published_iteration_s) for r in train], start,
                                fast=_published_s, exact=_published_s)
                parameters = fit.parameters
                names = ", ".join(n + (" (at a bound)" if n in fit.at_bound else "") for n in fit.fitted) or "none"
                fit_errors = [abs(e.error) for e in fit.runs]
            errors = [abs(_published_s(PublishedRun(r, 0.0), parameters) / r.published_iteration_s - 1) for r in held]
            covered = joined_span(run_span(r) for r in train)
            if covered is not None:
                for r, error in zip(held, errors):
                    named = extrapolations(covered, run_span(r))
                    (outside if named else inside).append(error)
                    if any(line.startswith(("cp ", "ep ")) for line in named):
                        parallel_outside.append(error)
                    if any(line.startswith("ZeRO-2/3 sharding") for line in named):
                        sharding_outside.append(error)
            fitted_errors += fit_errors
            held_errors += errors
            fit_text = f"{100 * sum(fit_errors) / len(fit_errors):.1f}%" if fit_errors else "-"
            lines.append(f"| {source} | {len(runs)} | {k} | {', '.join(f'{r.shape.devices:,}' for r in train) or '-'} "
                         f"| {names} | {fit_text} | {100 * sum(errors) / len(errors):.1f}% ({100 * max(errors):.1f}%) |")
    fit_mape = f"{100 * sum(fitted_errors) / len(fitted_errors):.1f}%" if fitted_errors else "-"
    lines += ["", f"Calibrated per stack: fit MAPE {fit_mape} ({len(fitted_errors)} run fits), held-out MAPE "
              f"{100 * sum(held_errors) / len(held_errors):.1f}% ({len(held_errors)} predictions: each run once).",
              "Held-out runs inside their fold's calibrated span (GPU, NVLink topology, precision, TP, CP and EP "
              "degrees, model size, tokens per microbatch, where ZeRO-2/3 shards: `planner.calibration_span`): "
              f"{_mean_text(inside)}; "
              "outside it, which a plan "
              f"reports as `predicted.calibration_extrapolates`: {_mean_text(outside)}; of those, with a CP or EP "
              f"degree outside the calibrated runs': {_mean_text(parallel_outside)}"
              + (f", {100 * min(parallel_outside):.0f}-{100 * max(parallel_outside):.0f}%" if parallel_outside else "")
              + f"; with ZeRO-2/3 sharding over links the calibrated runs' did not shard over: {_mean_text(sharding_outside)}"
              + (f", {100 * min(sharding_outside):.0f}-{100 * max(sharding_outside):.0f}%." if sharding_outside else ".")]
    return lines


def _mean_text(errors: list[float]) -> str:
    return f"{100 * sum(errors) / len(errors):.1f}% ({len(errors)} runs)" if errors else "none"


def profile_report(runs: list[CalibrationRun], start: EfficiencyParams, name: str, points: int = 5) -> list[str]:
    """How well the A100 runs pin `name` down: refit the other fitted parameters with `name` held at `points`
    values across its range, and print both sources' MAPE at each."""
    low, high = EFFICIENCY_BOUNDS[name]
    lines = [f"Profile of {name} (the other fitted parameters refitted at each value):", "",
             f"| {name} | SC'21 MAPE | Korthikanti MAPE |", "|---:|---:|---:|"]
    for i in range(points):
        value = low + (high - low) * i / (points - 1)
        held = {**{k: v for k, v in MEASURED_EFFICIENCY.items() if k != name}, name: value}
        params = fit(runs, replace(start, **held), held=held)
        lines.append(f"| {value:.4g} | {100 * mape(runs, params, 'sc21'):.2f}% | "
                     f"{100 * mape(runs, params, 'korthikanti'):.2f}% |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fit", action="store_true", help="refit the efficiency parameters and save them")
    parser.add_argument("--write", action="store_true", help="write the table into BENCHMARKS.md")
    parser.add_argument("--joint-fit", action="store_true",
                        help="also report a fit that includes half of the 2023+ runs (not saved)")
    parser.add_argument("--profile", choices=[n for n in EfficiencyParams.field_names() if not _pinned(n)],
                        help="only report how well the A100 runs determine this parameter")
    args = parser.parse_args(argv)
    runs = load_runs()
    efficiency = fitted_efficiency()
    hopper = fitted_hopper_params() or None
    if args.profile:
        print("\n".join(profile_report(runs, efficiency, args.profile)))
        return 0
    fitted_runs, held_runs = modern_split()
    if args.fit:
        efficiency = settled(fit(runs, efficiency), efficiency)
        hopper = {name: round(value, 4) for name, value in fit_hopper_params(efficiency, fitted_runs).items()}
        FITTED_PATH.write_text(json.dumps({
            "doc": "Fitted by `python -m benchmarks.fidelity --fit` to benchmarks/calibration (SC'21 Table 1, Korthikanti "
                   "et al.), but for " + " and ".join(MEASURED_EFFICIENCY) + ": NCCL's published measurements "
                   "(cost_models.efficiency.MEASURED_EFFICIENCY), and attention_fraction and shard_overlap_fraction, "
                   "held at 1: those runs price no fused attention and shard nothing per layer.",
            "params": {k: round(v, 5) for k, v in efficiency.to_dict().items()},
            "hopper": {
                "doc": "attention_fraction and shard_overlap_fraction of GPUs with FP8 tensor cores "
                       "(cost_models.gpu_efficiency), the other "
                       "parameters the A100 fit's: fitted by the same command to the dense published 2023+ H100/H200 "
                       "runs (benchmarks/calibration/modern_runs.json) that benchmarks.fidelity.modern_split fits on, "
                       "every other run of each source by GPU count; the rest are held out.",
                **hopper,
            },
        }, indent=2) + "\n")
    efficiency_for = partial(efficiency_for_gpu, base=efficiency, hopper=hopper)
    sc21, kor = mape(runs, efficiency, "sc21"), mape(runs, efficiency, "korthikanti")
    report = [table(runs, efficiency), "",
              f"MAPE SC'21 TFLOP/s per GPU: {100 * sc21:.2f}% (target <= {100 * SC21_TARGET_MAPE:.0f}%)",
              f"MAPE Korthikanti iteration time: {100 * kor:.2f}% (target <= {100 * KORTHIKANTI_TARGET_MAPE:.0f}%)", "",
              "Fitted parameters: " + ", ".join(f"{k} = {v:.4g}" for k, v in efficiency.to_dict().items()
                                                if k not in MEASURED_EFFICIENCY and not _pinned(k))
              + "; measured (NCCL's published figures, not fitted): "
              + ", ".join(f"{k} = {v:.4g}" for k, v in MEASURED_EFFICIENCY.items())
              + "; held (the A100 runs price no fused attention and shard nothing per layer): "
              + ", ".join(f"{k} = {v:.4g}" for k, v in efficiency.to_dict().items() if _pinned(k))
              + (f" (on GPUs with FP8 tensor cores: {_hopper_text(hopper)}, fitted below)" if hopper else ""), "",
              "| model | state GiB published | predicted | activations (SP + selective) GiB published | predicted |",
              "|---|---:|---:|---:|---:|"]
    for name, sp, sq, ap, aq in korthikanti_memory_rows():
        report.append(f"| {name} | {sp:.2f} | {sq:.2f} ({100 * (sq / sp - 1):+.1f}%) | {ap:.2f} | {aq:.2f} ({100 * (aq / ap - 1):+.1f}%) |")
    report += ["", "Published 2023+ BF16 and FP8 runs on H100/H200 (`calibration/modern_runs.json`), priced with their "
               "GPU's built-in parameters (`cost_models.gpu_efficiency`): the A100 fit above but for the attention "
               "fraction and the share of FSDP's per-layer traffic that hides under compute, "
               + (f"Hopper's {_hopper_text(hopper)} against the A100 fit's held "
                  f"{_hopper_text({name: getattr(efficiency, name) for name in hopper})}, "
                  f"fitted to the {len(fitted_runs)} dense runs marked `fitted` (`modern_split`: every other run of each "
                  f"source by GPU count); the other {len(held_runs)} dense runs and the mixtures of experts "
                  "(Megatron-Bridge's DGX-H100 MoE rows whose layout resiplan can express, priced with resiplan's "
                  "presets) are held out, never fitted:" if hopper
                  else "not fitted: every run held out:"), ""]
    report += modern_table(efficiency_for, frozenset(run.label for run in fitted_runs) if hopper else frozenset())
    if hopper:
        report += swapped_halves_report(efficiency, fitted_runs, held_runs)
    report += ["", "Calibrated per stack: each source's runs sorted by GPU count and split alternately in two; each half "
               "calibrated as a user calibrates their stack (`planner.calibration.calibrate`, POST /v1/calibrations' "
               "fit, from its GPU's built-in parameters above), and the other half predicted:", ""]
    report += stack_calibration_report(efficiency_for)
    if args.joint_fit:
        report += [""] + joint_fit_report(runs, efficiency)
    text = "\n".join(report)
    print(text)
    if args.write:
        from benchmarks.report import write_section
        write_section("Cost-model fidelity", "python -m benchmarks.fidelity --write" + (" --joint-fit" if args.joint_fit else ""),
                      text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
