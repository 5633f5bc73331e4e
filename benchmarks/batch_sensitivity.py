"""Why small models retain less: retention against the global batch, one failed or slow GPU.

    python -m benchmarks.batch_sensitivity            # print the table
    python -m benchmarks.batch_sensitivity --write    # also update BENCHMARKS.md

A 7B or 13B model runs best on 256 A100s as pure data parallelism, a few
whole sequences per GPU. A lost GPU's share (1/256 of the batch) cannot be
spread in pieces smaller than a sequence, so some replica takes one more
sequence than the rest, or the layout moves to bigger, less efficient
replicas (TP or PP) whose per-sequence time is finer. The more sequences
per GPU, the smaller that step: retention should climb toward 1 with the
global batch (with pure data parallelism, one more sequence on k per GPU
costs a factor k / (k + 1), and an odd count forces micro-batch size 1).

Same setup as `benchmarks.failures` (32 x 8 A100-80GB, seq 4,096, GPU 1 of
node 1 failed or at speed 0.5); every figure is resiplan's cost model.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.failures import (
    Setup,
    request_for,
    solve,
    surviving_fraction,
    tokens_per_s,
)
from wire.convert import to_problem
from wire.schemas import PlanRequest

MODELS = ("llama2-7b", "llama2-13b")
GLOBAL_BATCHES = (512, 1024, 2048, 4096)
DAMAGED_GPU = "1:1"
GPUS = 256


def retention(setup: Setup, healthy_tps: float, failed: tuple[str, ...], slow: tuple[tuple[str, float], ...]) -> float:
    request = request_for(setup, failed, slow)
    ours = tokens_per_s(setup, solve(request)["iteration_ms"])
    limit = healthy_tps * surviving_fraction(to_problem(PlanRequest.model_validate(request)))
    return ours / limit


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args(argv)
    lines = ["| model | global batch | sequences per GPU | retention, 1 failed | retention, 1 slow x0.5 |",
             "|---|---:|---:|---:|---:|"]
    print("\n".join(lines), flush=True)
    for model in MODELS:
        for batch in GLOBAL_BATCHES:
            setup = Setup(GPUS // 8, "A100-80GB", model, batch, 4096)
            healthy_tps = tokens_per_s(setup, solve(request_for(setup))["iteration_ms"])
            failed = retention(setup, healthy_tps, (DAMAGED_GPU,), ())
            slow = retention(setup, healthy_tps, (), ((DAMAGED_GPU, 0.5),))
            lines.append(f"| {model} | {batch:,} | {batch / GPUS:g} | {failed:.3f} | {slow:.3f} |")
            print(lines[-1], flush=True)
    if args.write:
        from benchmarks.report import write_section

        text = "\n".join([
            "Retention (resiplan / surviving-compute limit) against the global batch; see the module docstring "
            "for why it climbs with sequences per GPU.", "", *lines,
        ])
        write_section("Retention and global batch", "python -m benchmarks.batch_sensitivity --write", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
