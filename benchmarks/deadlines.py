"""Does every answer keep its deadline? Cluster size x damage x time_limit_s -> client-observed answer time.

    python -m benchmarks.deadlines                 # HTTP on loopback, print the table
    python -m benchmarks.deadlines --write         # also update BENCHMARKS.md ("Deadlines")
    python -m benchmarks.deadlines --in-process    # api.tasks.planning.plan_for in this process, no HTTP
    python -m benchmarks.deadlines --max-gpus 4096 --limits 1

Starts the real service (`python -m cli serve`, one solver worker, its own database in a
temporary directory; see `benchmarks.load`) and sends one plan request at a time, each case once,
timing it from the first byte sent to the last byte of the answer received. An answer keeps its
deadline when it is a 200 with a plan and arrives within `time_limit_s` + 10% (the `limit` column;
`options.time_limit_s` counts from arrival, so the client also sees reading and validating the body,
which the server does before the deadline starts). A limit below the least the request takes
(`planner.deadline.least_time_limit_s`) is raised by the planner and said so in `solver.notes`: the
answer is then judged against the raised limit, which `solver.time_limit_s` reports.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.report import load_average

TOLERANCE = 0.10  # an answer may arrive this share past its limit
LIMITS_S = (1.0, 5.0, 10.0)

# GPUs -> (GPU, model, global batch, seq length): a workload that size of cluster trains.
WORKLOADS = {
    256: ("A100-80GB", "llama2-70b", 512, 4096),
    4_096: ("H100-SXM", "llama3-405b", 2048, 8192),
    32_768: ("H100-SXM", "llama3-405b", 8192, 8192),
    65_536: ("B200", "llama3-405b", 8192, 8192),
    131_072: ("H100-SXM", "llama3-405b", 16384, 8192),
}
GPUS_PER_NODE = 8


def _spread_speed(index: int) -> float:
    """Speeds in [0.5, 0.995] spread over the devices (many distinct ones, as telemetry reports)."""
    return round(0.5 + 0.005 * ((index * 7919) % 100), 3)


def damage(kind: str, nodes: int) -> tuple[list[str], list[dict]]:
    """(failed, slow) of a damage pattern on `nodes` nodes of 8 GPUs."""
    if kind == "healthy":
        return [], []
    if kind == "one failed GPU":
        return ["1:3"], []
    if kind == "every 7th node failed, every 5th slow":
        failed = [f"{n}:*" for n in range(0, nodes, 7)]
        slow = [{"device": f"{n}:{g}", "speed": 0.5} for n in range(0, nodes, 5) if n % 7
                for g in range(GPUS_PER_NODE)]
        return failed, slow
    if kind == "50,000 slow devices":
        return [], [{"device": f"{i // GPUS_PER_NODE}:{i % GPUS_PER_NODE}", "speed": _spread_speed(i)}
                    for i in range(min(50_000, nodes * GPUS_PER_NODE))]
    raise ValueError(f"unknown damage {kind!r}")


DAMAGES = ("healthy", "one failed GPU", "every 7th node failed, every 5th slow", "50,000 slow devices")


def request_for(gpus: int, kind: str, limit_s: float) -> dict:
    gpu, model, batch, seq = WORKLOADS[gpus]
    nodes = gpus // GPUS_PER_NODE
    failed, slow = damage(kind, nodes)
    return {
        "cluster": {"num_nodes": nodes, "gpus_per_node": GPUS_PER_NODE, "gpu": gpu},
        "failures": {"failed": failed, "slow": slow},
        "model": model,
        "training": {"global_batch_size": batch, "seq_length": seq},
        "options": {"time_limit_s": limit_s},
    }


def cases(max_gpus: int, limits: tuple[float, ...]) -> list[tuple[int, str, float]]:
    out = []
    for gpus in WORKLOADS:
        if gpus > max_gpus:
            continue
        for kind in DAMAGES:
            if kind == "50,000 slow devices" and gpus < 50_000:
                continue
            out.extend((gpus, kind, limit_s) for limit_s in limits)
    return out


@dataclass(frozen=True)
class Answer:
    gpus: int
    damage: str
    limit_s: float
    answer_s: float
    http_status: int
    solver: dict | None  # the plan's solver report, None without a plan
    answer_mb: float
    iteration_s: float | None
    detail: str = ""

    @property
    def applied_limit_s(self) -> float:
        """The limit the answer is judged against: the request's, or the planner's raised one."""
        if self.solver and self.solver.get("time_limit_s"):
            return max(self.limit_s, self.solver["time_limit_s"])
        return self.limit_s

    @property
    def kept(self) -> bool:
        return self.http_status == 200 and self.answer_s <= self.applied_limit_s * (1 + TOLERANCE)


def ask_http(http: httpx.Client, base_url: str, gpus: int, kind: str, limit_s: float) -> Answer:
    body = json.dumps(request_for(gpus, kind, limit_s)).encode()
    started = time.perf_counter()
    response = http.post(f"{base_url}/v1/plan", content=body, headers={"content-type": "application/json"})
    answer_s = time.perf_counter() - started
    return _answer(gpus, kind, limit_s, answer_s, response.status_code, response.content)


def ask_in_process(gpus: int, kind: str, limit_s: float) -> Answer:
    from api.tasks.planning import plan_for
    from planner.errors import PlanningError
    from wire.schemas import PlanRequest

    body = json.dumps(request_for(gpus, kind, limit_s)).encode()
    started = time.perf_counter()
    try:
        text = plan_for(PlanRequest.model_validate_json(body)).model_dump_json().encode()
        status = 200
    except PlanningError as error:
        text, status = json.dumps({"detail": str(error)}).encode(), 422
    return _answer(gpus, kind, limit_s, time.perf_counter() - started, status, text)


def _answer(gpus: int, kind: str, limit_s: float, answer_s: float, status: int, content: bytes) -> Answer:
    payload = json.loads(content) if content else {}
    if status != 200:
        return Answer(gpus, kind, limit_s, answer_s, status, None, len(content) / 1e6, None,
                      str(payload.get("detail", ""))[:120])
    return Answer(gpus, kind, limit_s, answer_s, status, payload["solver"], len(content) / 1e6,
                  payload["predicted"]["iteration_time_s"])


def run_http(selected: list[tuple[int, str, float]]) -> list[Answer]:
    from benchmarks.load import start_server, stop_server

    answers = []
    with tempfile.TemporaryDirectory(prefix="resiplan-deadlines-") as workdir:
        process, base_url, _log = start_server(Path(workdir), workers=1, queue_size=1)
        try:
            with httpx.Client(timeout=httpx.Timeout(120.0)) as http:
                ask_http(http, base_url, 256, "healthy", 1.0)  # warm the worker: imports, first CP-SAT model
                for gpus, kind, limit_s in selected:
                    answers.append(ask_http(http, base_url, gpus, kind, limit_s))
                    print(row(answers[-1]), flush=True)
        finally:
            stop_server(process)
    return answers


def run_in_process(selected: list[tuple[int, str, float]]) -> list[Answer]:
    ask_in_process(256, "healthy", 1.0)
    answers = []
    for gpus, kind, limit_s in selected:
        answers.append(ask_in_process(gpus, kind, limit_s))
        print(row(answers[-1]), flush=True)
    return answers


HEADER = ("| GPUs | damage | time_limit_s | answer s | answer / limit | kept (limit + 10%) | status | gap "
          "| iteration s | answer MB | what it gave up |")
RULE = "|---:|---|---:|---:|---:|---|---|---:|---:|---:|---|"


def row(answer: Answer) -> str:
    solver = answer.solver or {}
    limit = f"{answer.limit_s:g}"
    if answer.applied_limit_s > answer.limit_s:
        limit += f" (raised to {answer.applied_limit_s:.2f})"
    notes = "; ".join(_short_note(note) for note in solver.get("notes", [])) or "-"
    if answer.http_status != 200:
        notes = f"HTTP {answer.http_status}: {answer.detail}"
    return (f"| {answer.gpus:,} | {answer.damage} | {limit} | {answer.answer_s:.2f} "
            f"| {answer.answer_s / answer.applied_limit_s:.2f} | {'yes' if answer.kept else '**no**'} "
            f"| {solver.get('status', '-')} | {solver.get('gap', float('nan')):.3g} "
            f"| {answer.iteration_s if answer.iteration_s is not None else float('nan'):.3f} "
            f"| {answer.answer_mb:.1f} | {notes} |")


def _short_note(note: str) -> str:
    if note.startswith("replicas alike"):
        return "shared envelope timelines"
    if "raised to" in note:
        return "limit raised"
    if "when the planner started" in note:
        return "started late (hand-over to the solver)"
    if "past its time limit" in note:
        return "timelines overran"
    return note[:60]


def summary(answers: list[Answer]) -> str:
    kept = sum(answer.kept for answer in answers)
    worst = max(answers, key=lambda answer: answer.answer_s / answer.applied_limit_s)
    return (f"{kept} of {len(answers)} answers within time_limit_s + {TOLERANCE:.0%}; the latest, "
            f"{worst.gpus:,} GPUs ({worst.damage}) at {worst.limit_s:g} s, arrived at "
            f"{worst.answer_s / worst.applied_limit_s:.2f} x its limit.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="write the table to BENCHMARKS.md")
    parser.add_argument("--in-process", action="store_true", help="call plan_for in this process, no HTTP")
    parser.add_argument("--max-gpus", type=int, default=max(WORKLOADS))
    parser.add_argument("--limits", type=float, nargs="+", default=list(LIMITS_S))
    args = parser.parse_args(argv)
    selected = cases(args.max_gpus, tuple(args.limits))
    load_before = load_average()
    print(HEADER, RULE, sep="\n", flush=True)
    answers = run_in_process(selected) if args.in_process else run_http(selected)
    text = "\n".join([
        HEADER, RULE, *(row(answer) for answer in answers), "",
        summary(answers),
        "",
        (f"{'In process (`plan_for`, no HTTP)' if args.in_process else 'Over HTTP on loopback, one solver worker'}: "
         "answer s is from the first byte sent to the last received. Workloads: 256 x A100-80GB llama2-70b "
         "(batch 512, seq 4,096); 4,096 x H100 llama3-405b (2,048 x 8,192); 32,768 x H100 llama3-405b "
         "(8,192 x 8,192); 65,536 x B200 llama3-405b (8,192 x 8,192); 131,072 x H100 llama3-405b (16,384 x 8,192). Damage: `every 7th node failed, every "
         "5th slow` lists nodes 0, 7, 14, ... as failed and every GPU of nodes 5, 10, ... (not failed) at speed "
         "0.5; `50,000 slow devices` are GPUs 0..49,999 at speeds spread over 0.5-0.995. 'What it gave up' "
         f"is the plan's `solver.notes`. Machine {load_before} before the first case, {load_average()} after."),
    ])
    if args.write:
        from benchmarks.report import write_section

        command = "python -m benchmarks.deadlines --write" + (" --in-process" if args.in_process else "")
        write_section("Deadlines", command, text)
    print("", summary(answers), sep="\n")
    return 0 if all(answer.kept for answer in answers) else 1


if __name__ == "__main__":
    sys.exit(main())
