"""The expert-parallel all-to-all the planner prices against Megatron-Core's published H100 latencies.

    python -m benchmarks.ep_dispatch            # print the table
    python -m benchmarks.ep_dispatch --write    # also update BENCHMARKS.md

NVIDIA's Megatron-Core MoE report (arXiv 2603.07685, Table 7) times one dispatch and one combine of
DeepSeek-V3-sized tokens (hidden 7168, 4,096 tokens a GPU, 256 experts) on H100 nodes of 8, at EP 8 to 64,
with Megatron's all-to-all dispatcher and with HybridEP (the flex dispatcher's token-based kernels). The planner
prices each as `cost_models.expert_parallel.all_to_all_ms` with the H100's built-in link efficiencies (NCCL's
measured `nvlink_fraction` and `network_fraction`): bandwidth only, the same price for a dispatch and a combine.
The figures are the cost model's and the paper's, not timings of this machine.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from benchmarks.report import write_section
from cost_models.efficiency import ALL_TO_ALL, FLEX
from cost_models.expert_parallel import all_to_all_ms
from cost_models.gpu_efficiency import builtin_efficiency
from cost_models.hardware import gpu_preset
from cost_models.model_spec import ModelSpec

TABLE = Path(__file__).resolve().parent / "calibration" / "megatron_core_moe_table7.json"
DISPATCHERS = {"all-to-all": ALL_TO_ALL, "hybridep": FLEX}


@dataclass(frozen=True)
class Comparison:
    dispatcher: str  # the table's name
    phase: str  # dispatch or combine
    ep: int
    published_us: float
    priced_us: float

    @property
    def ratio(self) -> float:
        """Published over priced: above 1 where the kernels took longer than the links' bandwidth allows."""
        return self.published_us / self.priced_us


def comparisons(table: Path = TABLE) -> list[Comparison]:
    data = json.loads(table.read_text())
    setting, assumed = data["setting"], data["assumed"]
    if assumed["bytes_per_element"] != 2:
        raise ValueError("the planner prices routed tokens in bf16 (2 bytes)")
    gpu = gpu_preset(setting["gpu"])
    efficiency = builtin_efficiency(gpu)
    # One MoE layer of the table's shape: only its hidden size, experts and top-k enter the all-to-all.
    layer = ModelSpec("table7-moe-layer", num_layers=1, hidden_size=setting["hidden_size"], ffn_hidden_size=2048,
                      num_attention_heads=128, num_kv_heads=128, vocab_size=129280, swiglu=True,
                      tied_embeddings=False, num_experts=setting["num_experts"],
                      experts_per_token=assumed["experts_per_token"])
    out = []
    for dispatcher, phase, ep, latency_us in data["rows"]:
        priced_ms = all_to_all_ms(layer, setting["tokens_per_gpu"], 1, ep, setting["gpus_per_node"],
                                  gpu.intra_node_bandwidth_gb_s * efficiency.nvlink_fraction,
                                  gpu.inter_node_bandwidth_gb_s * efficiency.network_fraction,
                                  DISPATCHERS[dispatcher])
        out.append(Comparison(dispatcher, phase, ep, float(latency_us), 1e3 * priced_ms))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    args = parser.parse_args()
    rows = comparisons()
    lines = ["| dispatcher | EP | priced µs | dispatch µs published (ratio) | combine µs published (ratio) |",
             "|---|---:|---:|---:|---:|"]
    for dispatcher in DISPATCHERS:
        for ep in sorted({r.ep for r in rows if r.dispatcher == dispatcher}):
            pair = {r.phase: r for r in rows if r.dispatcher == dispatcher and r.ep == ep}
            lines.append(f"| {dispatcher} | {ep} | {pair['dispatch'].priced_us:,.0f} "
                         f"| {pair['dispatch'].published_us:,.0f} ({pair['dispatch'].ratio:.2f}) "
                         f"| {pair['combine'].published_us:,.0f} ({pair['combine'].ratio:.2f}) |")
    for dispatcher in DISPATCHERS:
        ratios = [r.ratio for r in rows if r.dispatcher == dispatcher]
        lines.append(f"\n{dispatcher}: published / priced {min(ratios):.2f}-{max(ratios):.2f}.")
    body = "\n".join([
        "Megatron-Core's MoE report (arXiv 2603.07685v2, Table 7) against `cost_models.expert_parallel.all_to_all_ms` "
        "on H100 nodes of 8 with the built-in link efficiencies (`benchmarks/calibration/megatron_core_moe_table7.json`: "
        "hidden 7168, 4,096 tokens a GPU, 256 experts; top-8 and bf16 tokens assumed, the table does not say). The "
        "planner prices a dispatch and a combine alike, from bandwidth alone; a ratio above 1: the kernels took longer.",
        "", *lines])
    print(body)
    if args.write:
        write_section("Expert-parallel all-to-all against Megatron-Core's Table 7", "python -m benchmarks.ep_dispatch --write",
                      body)


if __name__ == "__main__":
    main()
