"""Small problems for planner tests."""

from __future__ import annotations

from cost_models.efficiency import SoftwareConfig, fitted_efficiency
from cost_models.hardware import GpuSpec
from cost_models.layout import Hardware, Workload
from cost_models.model_spec import ModelSpec
from planner.devices import build_cluster_state
from planner.problem import PlanningProblem

TINY_MODEL = ModelSpec(
    name="tiny", num_layers=6, hidden_size=512, ffn_hidden_size=1408, num_attention_heads=8, num_kv_heads=8,
    vocab_size=1000, swiglu=True, tied_embeddings=False,
)

# 3.3 GiB minus the 3 GiB memory reserve leaves ~0.3 GiB: the tiny model's 18-byte
# state (~0.36 GB) does not fit on one GPU, so memory pruning matters.
SMALL_GPU = GpuSpec("small", peak_tflops=100.0, memory_gib=3.3, hbm_bandwidth_gb_s=1000.0,
                    intra_node_bandwidth_gb_s=200.0, inter_node_bandwidth_gb_s=20.0)


def small_problem(
    num_nodes: int = 2,
    gpus_per_node: int = 4,
    failed: tuple[str, ...] = (),
    slow: tuple[tuple[str, float], ...] = (),
    global_batch: int = 8,
    seq_length: int = 512,
    model: ModelSpec = TINY_MODEL,
    gpu: GpuSpec = SMALL_GPU,
    stock_layouts_only: bool = False,
    micro_batch_size: int | None = None,
    recompute: str = "auto",
    zero_stage: int = 1,
) -> PlanningProblem:
    return PlanningProblem(
        hardware=Hardware(gpu, gpus_per_node, gpu.intra_node_bandwidth_gb_s, gpu.inter_node_bandwidth_gb_s),
        cluster=build_cluster_state(num_nodes, gpus_per_node, list(failed), list(slow)),
        workload=Workload(model, seq_length, global_batch, zero_stage),
        model_name=model.name,
        micro_batch_size=micro_batch_size,
        recompute=recompute,
        stock_layouts_only=stock_layouts_only,
        time_limit_s=30.0,
        random_seed=0,
        efficiency=fitted_efficiency(),
        software=SoftwareConfig(),
    )
