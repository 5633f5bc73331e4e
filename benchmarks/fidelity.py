"""Cost-model fidelity against published Megatron-LM runs (and the fit of its six parameters).

    python -m benchmarks.fidelity            # predict every calibration run, print errors
    python -m benchmarks.fidelity --fit      # refit EfficiencyParams, write the preset
    python -m benchmarks.fidelity --write    # also update BENCHMARKS.md

Calibration data (copied from ../shared/calibration, unchanged):
SC'21 Table 1 (TFLOP/s per GPU, full recompute) and Korthikanti et al.
iteration times (full recompute; sequence parallel + selective) and memory.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from cost_models.efficiency import (
    EFFICIENCY_BOUNDS,
    MEGATRON_2021,
    EfficiencyParams,
    SoftwareConfig,
    fitted_efficiency,
)
from cost_models.hardware import GIB, gpu_preset
from cost_models.iteration import estimate_iteration
from cost_models.layout import Hardware, ParallelShape, Workload
from cost_models.model_spec import ModelSpec
from cost_models.stage_costs import stage_cost_terms

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


@dataclass(frozen=True)
class HeldOutRun:
    """A published run never used in the fit, with modern software (flash attention, SP, overlapped DP)."""

    label: str
    source: str
    model: str
    gpu: str
    shape: ParallelShape
    seq_length: int
    layers_per_stage: tuple[int, ...]
    published_tflops_per_gpu: float


# Llama 3 paper (Meta, 2024), Table 4: 8,192 H100, TP 8, CP 1, PP 16, DP 64,
# sequence 8,192, 32 sequences per DP rank (16M tokens per batch), 430 TFLOP/s
# per GPU. Meta ran interleaved 1F1B with one layer fewer on the first and last
# stage; the chunking is not published, so this uses v = 1 with that split.
HELD_OUT = [
    HeldOutRun(
        label="llama3-405b, 8,192 x H100", source="Llama 3 paper, Table 4", model="llama3-405b", gpu="H100-SXM",
        shape=ParallelShape(tp=8, pp=16, dp=64, micro_batch_size=1, recompute="none"), seq_length=8192,
        layers_per_stage=(7,) + (8,) * 14 + (7,), published_tflops_per_gpu=430.0,
    ),
]


def predict_held_out(run: HeldOutRun, efficiency: EfficiencyParams) -> float:
    from cost_models.flops import iteration_model_flops
    from cost_models.model_spec import model_preset

    gpu = gpu_preset(run.gpu)
    model = model_preset(run.model)
    hardware = Hardware(gpu, 8, gpu.intra_node_bandwidth_gb_s, gpu.inter_node_bandwidth_gb_s)
    batch = run.shape.dp * run.shape.micro_batch_size * 32
    workload = Workload(model, run.seq_length, batch, zero_stage=1)
    terms = stage_cost_terms(workload, hardware, run.shape, efficiency, SoftwareConfig())
    iteration_s = estimate_iteration(terms, run.layers_per_stage).iteration_ms / 1e3
    return iteration_model_flops(model, run.seq_length, batch) / (iteration_s * run.shape.devices) / 1e12


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


def fit(runs: list[CalibrationRun], start: EfficiencyParams) -> EfficiencyParams:
    """Least squares on relative errors (both sources weighted equally) over log-parameters."""
    from scipy.optimize import minimize

    names = EfficiencyParams.field_names()
    bounds = EFFICIENCY_BOUNDS

    def params_of(x) -> EfficiencyParams:
        values = {n: min(max(math.exp(v), bounds[n][0]), bounds[n][1]) for n, v in zip(names, x)}
        return EfficiencyParams(**values)

    def loss(x) -> float:
        p = params_of(x)
        total = 0.0
        for source in ("sc21", "korthikanti"):
            errs = [(predict(r, p) / r.published - 1) ** 2 for r in runs if r.source == source]
            total += sum(errs) / len(errs)
        return total

    x0 = [math.log(getattr(start, n)) for n in names]
    result = minimize(loss, x0, method="Nelder-Mead", options={"maxiter": 4000, "xatol": 1e-4, "fatol": 1e-9})
    return params_of(result.x)


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fit", action="store_true", help="refit the efficiency parameters and save them")
    parser.add_argument("--write", action="store_true", help="write the table into BENCHMARKS.md")
    args = parser.parse_args(argv)
    runs = load_runs()
    efficiency = fitted_efficiency()
    if args.fit:
        efficiency = fit(runs, efficiency)
        FITTED_PATH.write_text(json.dumps({
            "doc": "Fitted by `python -m benchmarks.fidelity --fit` to benchmarks/calibration (SC'21 Table 1, Korthikanti et al.).",
            "params": {k: round(v, 5) for k, v in efficiency.to_dict().items()},
        }, indent=2) + "\n")
    sc21, kor = mape(runs, efficiency, "sc21"), mape(runs, efficiency, "korthikanti")
    report = [table(runs, efficiency), "",
              f"MAPE SC'21 TFLOP/s per GPU: {100 * sc21:.2f}% (target <= {100 * SC21_TARGET_MAPE:.0f}%)",
              f"MAPE Korthikanti iteration time: {100 * kor:.2f}% (target <= {100 * KORTHIKANTI_TARGET_MAPE:.0f}%)", "",
              "Fitted parameters: " + ", ".join(f"{k} = {v:.4g}" for k, v in efficiency.to_dict().items()), "",
              "| model | state GiB published | predicted | activations (SP + selective) GiB published | predicted |",
              "|---|---:|---:|---:|---:|"]
    for name, sp, sq, ap, aq in korthikanti_memory_rows():
        report.append(f"| {name} | {sp:.2f} | {sq:.2f} ({100 * (sq / sp - 1):+.1f}%) | {ap:.2f} | {aq:.2f} ({100 * (aq / ap - 1):+.1f}%) |")
    report += ["", "Held out (not fitted; modern software settings):", "",
               "| run | source | published TFLOP/s/GPU | predicted | error |", "|---|---|---:|---:|---:|"]
    for run in HELD_OUT:
        pred = predict_held_out(run, efficiency)
        report.append(f"| {run.label} | {run.source} | {run.published_tflops_per_gpu:.0f} | {pred:.0f} | "
                      f"{100 * (pred / run.published_tflops_per_gpu - 1):+.1f}% |")
    text = "\n".join(report)
    print(text)
    if args.write:
        from benchmarks.report import write_section
        write_section("Cost-model fidelity", "python -m benchmarks.fidelity --write", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
