"""Published 2023+ H100/H200 runs (`calibration/modern_runs.json`) as cost-model inputs.

Each run's published figure becomes seconds per iteration: TFLOP/s per GPU through the FLOP count the
source itself used (so a source that counts attention differently is not mis-read), tokens per second
per GPU through the batch, or the iteration time as published. Used by `benchmarks.fidelity`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from cost_models.efficiency import EfficiencyParams, SoftwareConfig
from cost_models.hardware import gpu_preset
from cost_models.iteration import estimate_iteration
from cost_models.layout import Hardware, ParallelShape, Workload
from cost_models.model_spec import ModelSpec, model_preset
from cost_models.stage_costs import stage_cost_terms

MODERN_RUNS_PATH = Path(__file__).with_name("calibration") / "modern_runs.json"
# KempnerForge's nodes hold 4 H200s (its report); every other source ran 8-GPU nodes.
GPUS_PER_NODE = {"kempnerforge-2026": 4}


@dataclass(frozen=True)
class ModernRun:
    source_id: str
    label: str
    workload: Workload
    hardware: Hardware
    shape: ParallelShape
    software: SoftwareConfig
    published_iteration_s: float
    precision: str = "bf16"
    layers_per_chunk: tuple[int, ...] | None = None  # uneven interleaved chunks, as /v1/estimate's layout takes them

    @property
    def tokens_per_s_per_gpu(self) -> float:
        w = self.workload
        return w.global_batch_size * w.seq_length / (self.published_iteration_s * self.shape.devices)


def _model(row: dict) -> ModelSpec:
    """The run's model: a resiplan preset where the row names one (`model_preset`: mixtures of experts, whose
    published shape the preset is), else the row's own shape fields."""
    if "model_preset" in row:
        return replace(model_preset(row["model_preset"]), name=row["model"])
    return ModelSpec(
        name=row["model"], num_layers=row["layers"], hidden_size=row["hidden"], ffn_hidden_size=row["ffn_hidden"],
        num_attention_heads=row["heads"], num_kv_heads=row["kv_heads"], vocab_size=row["vocab"],
        swiglu=row["swiglu"], tied_embeddings=row["tied_embeddings"],
    )


def source_flops_per_iteration(row: dict) -> float:
    """The FLOPs one iteration counts as in the source's own formula (`flops_formula` in the file)."""
    b, s, layers, h = row["global_batch"], row["seq_length"], row["layers"], row["hidden"]
    f, heads, groups, vocab = row["ffn_hidden"], row["heads"], row["kv_heads"], row["vocab"]
    if row["flops_formula"] == "megatron_2024":
        gated = 1.5 if row["swiglu"] else 1.0
        return 12 * b * s * layers * h * h * ((1 + groups / heads + s / h) + f / h * gated + vocab / (2 * layers * h))
    if row["flops_formula"] == "palm":
        head_dim = h // heads
        attention = h * (h + 2 * groups * head_dim) + h * h
        mlp = (3 if row["swiglu"] else 2) * h * f
        non_embedding = layers * (attention + mlp)
        return b * s * (6 * non_embedding + 12 * layers * h * s)
    raise ValueError(f"unknown flops_formula {row['flops_formula']!r}")


def published_iteration_s(row: dict) -> float:
    measured = row["measured"]
    if "iteration_s" in measured:
        return float(measured["iteration_s"])
    if "tokens_per_s_per_gpu" in measured:
        return row["global_batch"] * row["seq_length"] / (measured["tokens_per_s_per_gpu"] * row["gpus"])
    return source_flops_per_iteration(row) / (measured["tflops_per_gpu"] * 1e12 * row["gpus"])


def load_modern_runs(path: Path = MODERN_RUNS_PATH) -> list[ModernRun]:
    runs = []
    for row in json.loads(path.read_text())["runs"]:
        gpu = gpu_preset(row["gpu"])
        per_node = GPUS_PER_NODE.get(row["source_id"], 8)
        topology = row.get("nvlink_topology", "switch")
        if topology not in ("switch", "mesh"):
            raise ValueError(f"{row['model']}: nvlink_topology {topology!r} is neither 'switch' nor 'mesh'")
        hardware = Hardware(gpu, per_node, gpu.intra_node_bandwidth_gb_s, gpu.inter_node_bandwidth_gb_s,
                            nvlink_mesh=topology == "mesh")
        virtual = row["virtual_stages"]
        shape = ParallelShape(tp=row["tp"], pp=row["pp"], dp=row["dp"], micro_batch_size=row["micro_batch"],
                              recompute=row["recompute"], schedule="interleaved" if virtual > 1 else "1f1b",
                              virtual_stages=virtual, cp=row.get("cp", 1), ep=row.get("ep", 1), etp=row.get("etp"))
        if shape.devices != row["gpus"]:
            raise ValueError(f"{row['model']} on {row['gpus']} GPUs: tp x cp x pp x dp = {shape.devices}")
        workload = Workload(_model(row), row["seq_length"], row["global_batch"], zero_stage=row["zero_stage"])
        label = (f"{row['model']}, {row['gpus']} x {row['gpu']}, tp {row['tp']}"
                 + (f" cp {shape.cp}" if shape.cp > 1 else "") + f" pp {row['pp']} dp {row['dp']}"
                 + (f" ep {shape.ep}" if shape.ep > 1 else "") + (f" etp {shape.etp}" if shape.etp is not None else "")
                 + (f" v {virtual}" if virtual > 1 else "") + (f", {row['precision']}" if row["precision"] != "bf16" else "")
                 + (", async TP" if row["software"].get("async_tp") else ""))
        software = SoftwareConfig(**row["software"])
        chunks = (slot_chunks(workload.model.num_layers, shape.pp, virtual)
                  if row.get("embedding_and_loss_as_layers") else row.get("layers_per_chunk"))
        if chunks is not None and (len(chunks) != shape.pp * virtual or sum(chunks) != workload.model.num_layers):
            raise ValueError(f"{row['model']}: layers_per_chunk {chunks} is not {shape.pp * virtual} chunks of "
                             f"{workload.model.num_layers} layers")
        runs.append(ModernRun(row["source_id"], label, workload, hardware, shape, software, published_iteration_s(row),
                              row["precision"], None if chunks is None else tuple(chunks)))
    return runs


def slot_chunks(layers: int, stages: int, virtual_stages: int) -> tuple[int, ...]:
    """Megatron's split that counts the embedding and the loss as a layer each (--account-for-embedding-in-pipeline-split,
    --account-for-loss-in-pipeline-split): layers + 2 slots cut evenly into stages x virtual_stages model chunks, the
    first and the last chunk one layer short. Chunk c of stage s at c x stages + s."""
    chunks, slots = stages * virtual_stages, layers + 2
    if slots % chunks:
        raise ValueError(f"{layers} layers and 2 end slots do not cut into {chunks} equal chunks")
    split = [slots // chunks] * chunks
    split[0] -= 1
    split[-1] -= 1
    return tuple(split)


def stage_split(run: ModernRun) -> list[int]:
    """The run's layers per stage: its chunks' per stage, else Megatron's even split."""
    p = run.shape.pp
    if run.layers_per_chunk is not None:
        return [sum(run.layers_per_chunk[s::p]) for s in range(p)]
    return balanced_split(run.workload.model.num_layers, p)


def balanced_split(layers: int, stages: int) -> list[int]:
    """Megatron's even split; a remainder goes to the middle stages (the ends hold embedding and head)."""
    base, extra = divmod(layers, stages)
    split = [base] * stages
    order = sorted(range(stages), key=lambda i: (i in (0, stages - 1), i))
    for i in order[:extra]:
        split[i] += 1
    return split


def predict_iteration_s(run: ModernRun, efficiency: EfficiencyParams) -> float:
    """The bubble model's iteration time (`cost_models.iteration`) of the run's layout."""
    terms = stage_cost_terms(run.workload, run.hardware, run.shape, efficiency, run.software)
    return estimate_iteration(terms, stage_split(run)).iteration_ms / 1e3
