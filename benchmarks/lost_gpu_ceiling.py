"""How much of one lost GPU any replica shape can win back when every GPU holds two whole sequences.

    python -m benchmarks.lost_gpu_ceiling            # print the table
    python -m benchmarks.lost_gpu_ceiling --write    # also update BENCHMARKS.md

The case is issue 19's: llama2-7b on 256 A100-80GB at 512 x 4k, one GPU failed, where `benchmarks/failures.py`'s
plans (context parallelism searched) retain 0.79 of the surviving-compute limit for 1F1B-family schedules and
0.84 in the default plan's reported time. Healthy, resiplan's plan has every GPU train its two
sequences alone (tp 1, one microbatch of 2). After the loss, 255 GPUs hold 512 sequences, more than two each,
so by pigeonhole some replica of g GPUs takes at least 2g + 1 sequences, and the iteration lasts at least that
replica's time. Each row prices one replica shape taking that many sequences (rounded up as below), by
`/v1/estimate` on a uniform layout of such replicas over the same 256 GPUs (so ZeRO sharding and the gradient
sync are about the job's), and gives the retention no plan whose busiest replica has that shape can exceed:
healthy plan's iteration / that iteration x 256 / 255 (both simulated schedules, as plans report them).
Shapes: tp x cp within a node, pp 1 to 4 stages under 1F1B and ZB-H2 (as many replicas as the 256 GPUs hold; pp 3,
which does not divide the 32 layers, with the best split whose stages differ by at most 2 layers), no and selective
recompute, and every micro-batch size b that divides the batch of 512, up to 2g + 1: a plan has one micro-batch size,
so every replica takes a multiple of b sequences and the busiest one at least b x ceil((2g + 1) / b); each row keeps
the best b and recompute. Not covered: pipelines of more than 4 stages, interleaved schedules, resiplan's CP-SAT
schedules (an estimate names a fixed schedule; the plan's own beats ZB-H2 by 1-3% on this case), CP groups spanning
nodes, full recompute. Predicted times, not timings: the figures depend on the cost model only.
"""

from __future__ import annotations

import argparse
import itertools

from api.tasks.planning import estimate_for, plan_for
from benchmarks.report import write_section
from planner.errors import PlanningError
from wire.schemas import EstimateRequest, PlanRequest

NODES, GPUS_PER_NODE, GPU, MODEL, SEQ_LENGTH = 32, 8, "A100-80GB", "llama2-7b", 4096
GLOBAL_BATCH = 512
SEQUENCES_PER_GPU = 2  # 512 sequences on 256 GPUs
LAYERS = 32  # llama2-7b
SHAPES = [(tp, cp) for tp in (1, 2, 4, 8) for cp in (1, 2, 4, 8) if tp * cp <= GPUS_PER_NODE]
PIPELINES = [(1, "1f1b"), (2, "1f1b"), (2, "zb-h2"), (3, "1f1b"), (3, "zb-h2"), (4, "1f1b"), (4, "zb-h2")]


def _request(batch: int) -> dict:
    return {"cluster": {"num_nodes": NODES, "gpus_per_node": GPUS_PER_NODE, "gpu": GPU}, "model": MODEL,
            "training": {"global_batch_size": batch, "seq_length": SEQ_LENGTH}}


def layer_splits(pp: int) -> list[tuple[int, ...] | None]:
    """The even split (None) where pp divides the layers, else every split whose stages differ by at most 2
    layers: a rougher one only lengthens the slowest stage."""
    if LAYERS % pp == 0:
        return [None]
    low = LAYERS // pp - 1
    return [split for split in itertools.product(range(low, low + 4), repeat=pp)
            if sum(split) == LAYERS and max(split) - min(split) <= 2]


RECOMPUTE = ("none", "selective")  # full recomputes a whole forward: never faster where the others fit


def iteration_s(tp: int, cp: int, pp: int, schedule: str, micro_batch: int, sequences: int) -> tuple[float, str] | None:
    """Predicted iteration of 256 GPUs cut into as many replicas of tp x cp x pp GPUs as they hold, each taking
    `sequences`, with the best of `layer_splits` and `RECOMPUTE`, and that recompute; None where no layout fits."""
    dp = NODES * GPUS_PER_NODE // (tp * cp * pp)
    found = []
    for split, recompute in itertools.product(layer_splits(pp), RECOMPUTE):
        layout = {"tp": tp, "cp": cp, "pp": pp, "dp": dp, "micro_batch_size": micro_batch, "schedule": schedule,
                  "recompute": recompute}
        if split is not None:
            layout["layers_per_stage"] = list(split)
        body = {**_request(sequences * dp), "layout": layout}
        try:
            found.append((estimate_for(EstimateRequest.model_validate(body)).predicted.iteration_time_s, recompute))
        except PlanningError:
            continue
    return min(found, default=None)


def busiest_replica(tp: int, cp: int, pp: int, schedule: str,
                    least_sequences: int) -> tuple[float, int, int, str] | None:
    """The fastest (iteration s, micro-batch size, sequences, recompute) of a replica taking at least
    `least_sequences`: one micro-batch size runs the whole plan, so the count is the next multiple of it."""
    found = []
    for micro_batch in range(1, least_sequences + 1):
        if GLOBAL_BATCH % micro_batch:
            continue
        sequences = micro_batch * -(-least_sequences // micro_batch)
        priced = iteration_s(tp, cp, pp, schedule, micro_batch, sequences)
        if priced is not None:
            found.append((priced[0], micro_batch, sequences, priced[1]))
    return min(found, default=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    args = parser.parse_args()
    gpus = NODES * GPUS_PER_NODE
    healthy_s = plan_for(PlanRequest.model_validate(_request(GLOBAL_BATCH))).predicted.iteration_time_s
    rows, best = [], (0.0, "")
    for pp, schedule in PIPELINES:
        for tp, cp in SHAPES:
            group = tp * cp * pp
            loaded = busiest_replica(tp, cp, pp, schedule, SEQUENCES_PER_GPU * group + 1)
            if loaded is None:
                rows.append(f"| tp {tp} cp {cp} pp {pp} {schedule} | {group} | | | | no layout fits | |")
                continue
            loaded_s, micro_batch, sequences, recompute = loaded
            ceiling = healthy_s / loaded_s * gpus / (gpus - 1)
            best = max(best, (ceiling, f"tp {tp} cp {cp} pp {pp} {schedule}"))
            rows.append(f"| tp {tp} cp {cp} pp {pp} {schedule} | {group} | {sequences} | "
                        f"{micro_batch} | {recompute} | {loaded_s:.3f} | {ceiling:.3f} |")
            print(rows[-1], flush=True)
    body = (__doc__.split("\n\n", 2)[2].strip() + f"\n\nHealthy iteration {healthy_s:.3f} s. Highest ceiling: "
            f"{best[0]:.3f} ({best[1]}).\n\n"
            "| busiest replica | GPUs g | sequences | micro-batch | recompute | iteration s | retention ceiling |\n"
            "|---|---:|---:|---:|---|---:|---:|\n" + "\n".join(rows))
    print(body.rsplit("\n\n", 1)[0].rsplit("\n\n", 1)[1])
    if args.write:
        write_section("One lost GPU at two sequences per GPU", "python -m benchmarks.lost_gpu_ceiling --write", body)


if __name__ == "__main__":
    main()
