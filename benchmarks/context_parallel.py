"""What context parallelism buys: the best stock plan with and without it, against NeMo's published table.

    python -m benchmarks.context_parallel            # print the table
    python -m benchmarks.context_parallel --write    # also update BENCHMARKS.md

NVIDIA NeMo's long-sequence performance page (docs/source/performance/performance_long_sequence.md, Llama2-7B
FP8 on DGX-H100, NeMo 24.03) trains 4M tokens per step on as many GPUs as the sequence has k-tokens and
compares the best layout with CP against the best without. Each row here is planned the same two ways
(`options.max_context_parallel` 32 and 1, stock layouts), plus Llama 3's 128k phase for llama3-405b on 1,024
H100s. Predicted times, not timings: the figures do not depend on the machine.
"""

from __future__ import annotations

import argparse

from benchmarks.planning import plan_or_none
from benchmarks.report import write_section

# (label, nodes, model, global batch, seq, precision, NeMo's published speedup or None)
CASES = [
    ("32 x H100, llama2-7b, 128 x 32k", 4, "llama2-7b", 128, 32768, "fp8", 1.03),
    ("64 x H100, llama2-7b, 64 x 64k", 8, "llama2-7b", 64, 65536, "fp8", 1.07),
    ("128 x H100, llama2-7b, 32 x 128k", 16, "llama2-7b", 32, 131072, "fp8", 1.31),
    ("256 x H100, llama2-7b, 16 x 256k", 32, "llama2-7b", 16, 262144, "fp8", 1.40),
    ("512 x H100, llama2-7b, 8 x 512k", 64, "llama2-7b", 8, 524288, "fp8", 5.28),
    ("1,024 x H100, llama2-7b, 4 x 1M", 128, "llama2-7b", 4, 1048576, "fp8", 20.23),
    ("1,024 x H100, llama3-405b, 64 x 128k", 128, "llama3-405b", 64, 131072, "bf16", None),
]


def _plan(nodes: int, model: str, batch: int, seq: int, precision: str, max_cp: int):
    body = {"cluster": {"num_nodes": nodes, "gpus_per_node": 8, "gpu": "H100-SXM"}, "model": model,
            "training": {"global_batch_size": batch, "seq_length": seq, "precision": precision},
            "options": {"allow_non_uniform": False, "time_limit_s": 30, "max_context_parallel": max_cp}}
    return plan_or_none(body)


def _cell(plan) -> str:
    if plan is None:
        return "no layout fits"
    stages = plan.replicas[0].stages
    return (f"{plan.predicted.iteration_time_s:.3f} s (tp {stages[0].tp} cp {stages[0].cp} pp {len(stages)} "
            f"dp {len(plan.replicas)}, {plan.recompute}; {max(s.memory_gib for s in stages):.0f} GiB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    args = parser.parse_args()
    rows = []
    for label, *case, published in CASES:
        without, with_cp = _plan(*case, 1), _plan(*case, 32)
        speedup = (without.predicted.iteration_time_s / with_cp.predicted.iteration_time_s
                   if without is not None and with_cp is not None else None)
        rows.append(f"| {label} | {_cell(without)} | {_cell(with_cp)} | "
                    f"{'-' if speedup is None else f'{speedup:.2f}'} | {'-' if published is None else published} |")
        print(rows[-1], flush=True)
    body = ("Best stock plan without context parallelism (`max_context_parallel` 1) and with it (up to 32), "
            "predicted iteration time, layout and largest stage memory; the speedup, and NeMo's published speedup "
            "of its best CP layout over its best without (Llama2-7B FP8 on DGX-H100, "
            "docs/source/performance/performance_long_sequence.md). Without CP the longest sequences fit only "
            "with the widest TP and long pipelines of one microbatch; with it every GPU keeps a few thousand "
            "tokens and the key/value exchange hides under attention.\n\n"
            "| case | without CP | with CP | speedup | NeMo published |\n|---|---|---|---:|---:|\n" + "\n".join(rows))
    if args.write:
        write_section("Context parallelism", "python -m benchmarks.context_parallel --write", body)


if __name__ == "__main__":
    main()
