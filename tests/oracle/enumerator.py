"""An exhaustive oracle for the stock uniform space, written from the wire contract alone.

It builds requests and asks `/v1/estimate` (the cost model applied to one fully specified layout, no
search) for every uniform layout `allow_non_uniform: false` declares: every tp dividing the heads (at
most a node), every context-parallel size up to `options.max_context_parallel` (the estimate refuses
the ones the contract rules out), every expert-parallel size of a mixture of experts, every shard group
the README declares for ZeRO-2/3 (all replicas, or a node's), pp, dp, micro-batch size dividing the batch, recompute mode the planner may pick, allowed
handcrafted schedule (1F1B, GPipe, ZB-H1, ZB-H2, interleaved with every v) and stock layer split (first
and last stage free, middle stages equal). It imports no planner search code: only the wire schemas, the
service's estimate and plan entry points, and the planner's error type (what an impossible layout raises).
Healthy clusters only: there, where a replica's groups sit does not change its time, so the estimate's
own placement is not a choice the oracle leaves to the planner.
"""

from __future__ import annotations

import itertools
import random

from api.tasks.planning import estimate_for
from planner.errors import PlanningError
from wire.schemas import EstimateRequest

SINGLE_CHUNK = ("1f1b", "gpipe", "zb-h1", "zb-h2")
RECOMPUTE = ("none", "full")  # what `recompute: auto` searches with flash attention (selective stores the same)


def _stock_splits(total: int, parts: int):
    """Layer splits stock Megatron-LM, DeepSpeed and torchtitan run, which is what `allow_non_uniform: false`
    declares: positive counts summing to `total`, every middle stage (neither first nor last) equal."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        split = [bounds[i + 1] - bounds[i] for i in range(parts)]
        if len(set(split[1:-1])) <= 1:
            yield split


# A GPU whose 5 GiB (3 GiB of it the default memory reserve) holds few layers: memory decides the layout.
SMALL_GPU = {"name": "small-5g", "peak_tflops": 100.0, "memory_gib": 5.0}
HANDCRAFTED = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2"]


def instance(rng: random.Random) -> dict:
    """A small healthy cluster and model: 1-2 nodes of 4 or 8 GPUs, 3-7 layers (GQA or not), an awkward
    batch (primes included), and either every handcrafted schedule or the stock default ones."""
    heads = rng.choice([4, 8, 16])
    kv = rng.choice([h for h in (1, 2, 4, 8, 16) if heads % h == 0])
    model = {"num_layers": rng.randint(3, 7), "hidden_size": heads * 128, "ffn_hidden_size": heads * 128 * 3,
             "num_attention_heads": heads, "num_kv_heads": kv, "vocab_size": 32000}
    options = {"allow_non_uniform": False}
    if rng.random() < 0.7:
        options["schedules"] = HANDCRAFTED
    return {"cluster": {"num_nodes": rng.choice([1, 2]), "gpus_per_node": rng.choice([4, 8]),
                        "gpu": rng.choice(["A100-40GB", "A100-80GB", "H100-SXM", SMALL_GPU])},
            "model": model,
            "training": {"global_batch_size": rng.choice([3, 4, 6, 8, 11, 12, 16]), "seq_length": 2048},
            "options": options}


def with_failures(rng: random.Random, body: dict) -> dict:
    """`body` with 0-2 of its GPUs failed or slow (speeds 0.3-0.9)."""
    cluster = body["cluster"]
    devices = [f"{node}:{gpu}" for node in range(cluster["num_nodes"]) for gpu in range(cluster["gpus_per_node"])]
    failures: dict[str, list] = {"failed": [], "slow": []}
    for device in rng.sample(devices, rng.randint(0, 2)):
        if rng.random() < 0.4:
            failures["failed"].append(device)
        else:
            failures["slow"].append({"device": device, "speed": round(rng.uniform(0.3, 0.9), 2)})
    return {**body, "failures": failures}


def allowed_schedules(body: dict) -> list[str]:
    """The schedules the request allows: its list, or what stock frameworks run (API.md)."""
    return body["options"].get("schedules") or ["gpipe", "1f1b", "interleaved"]


# The Options schema: unless told otherwise the search may use up to 32 context-parallel ranks on sequences of
# 16,384 tokens or more, none on shorter ones.
def max_context_parallel(body: dict) -> int:
    given = body["options"].get("max_context_parallel")
    if given is not None:
        return given
    return 32 if body["training"]["seq_length"] >= 16384 else 1



def _expert_layouts(model: dict, tp: int, dp: int, cp: int) -> list[tuple[int, int | None]]:
    """API.md's `layout.ep` and `layout.etp` as the README declares the search: a mixture of experts' routed
    experts split over ep GPUs, each expert whole over its TP group (etp omitted) or, with tp > 1, on one GPU
    (etp 1); ep divides the experts and is a multiple of tp / etp; its ep x etp / tp TP groups divide a
    replica's cp, or are whole replicas whose count divides dp. A dense model has neither."""
    experts = model.get("num_experts", 0)
    if not experts:
        return [(1, None)]
    out = []
    for etp in sorted({tp, 1}, reverse=True):
        for ep in range(1, experts + 1):
            if experts % ep or ep % (tp // etp):
                continue
            groups = ep * etp // tp
            if cp % groups == 0 or (groups % cp == 0 and dp % (groups // cp) == 0):
                out.append((ep, None if etp == tp else etp))
    return out


def _shard_groups(body: dict, tp: int, cp: int, dp: int) -> list[int | None]:
    """`layout.dp_shard` as the README declares the search: every replica (None) and, for ZeRO-2/3 unless
    `options.allow_hybrid_sharding` is false, the replicas of one node (the most that divide both dp and
    the stage groups a node holds, when that is neither 1 nor dp)."""
    zero = body["training"].get("zero_stage", 1)
    if zero not in (2, 3) or body["options"].get("allow_hybrid_sharding") is False:
        return [None]
    per_node = body["cluster"]["gpus_per_node"] // (tp * cp)
    node = max((k for k in range(1, dp + 1) if dp % k == 0 and per_node % k == 0), default=1)
    return [None, node] if 1 < node < dp else [None]


def _layouts(body: dict):
    model, cluster = body["model"], body["cluster"]
    layers, batch = model["num_layers"], body["training"]["global_batch_size"]
    gpus = cluster["num_nodes"] * cluster["gpus_per_node"]
    allowed = allowed_schedules(body)
    max_cp = max_context_parallel(body)
    for tp, cp in itertools.product(range(1, cluster["gpus_per_node"] + 1), range(1, max_cp + 1)):
        if model["num_attention_heads"] % tp or model["num_kv_heads"] % tp or tp * cp > gpus:
            continue
        for pp in range(1, layers + 1):
            for dp in range(1, gpus // (tp * cp * pp) + 1):
                for mbs in (m for m in range(1, batch + 1) if batch % (m * dp) == 0):
                    microbatches = batch // (mbs * dp)
                    for recompute, (ep, etp), shard in itertools.product(RECOMPUTE, _expert_layouts(model, tp, dp, cp),
                                                                          _shard_groups(body, tp, cp, dp)):
                        base = {"tp": tp, "cp": cp, "pp": pp, "dp": dp, "micro_batch_size": mbs, "recompute": recompute}
                        if etp is not None:
                            base["etp"] = etp
                        if ep > 1:
                            span = ep * (etp or tp) // tp  # TP groups of one EP group
                            if shard is not None and (shard * cp) % span:
                                continue  # hybrid sharding is declared with each EP group inside a shard group
                            base["ep"] = ep
                        if shard is not None:
                            base["dp_shard"] = shard
                        for split in _stock_splits(layers, pp):
                            for schedule in SINGLE_CHUNK if pp > 1 else ("1f1b",):
                                if schedule in allowed or pp == 1:
                                    yield {**base, "schedule": schedule, "layers_per_stage": split}
                        for v in range(2, 9):
                            if ("interleaved" in allowed and pp > 1 and layers % (pp * v) == 0
                                    and microbatches % pp == 0):
                                yield {**base, "schedule": "interleaved", "virtual_stages": v}


def oracle_best(body: dict) -> tuple[float, dict | None]:
    best: tuple[float, dict | None] = (float("inf"), None)
    for layout in _layouts(body):
        try:
            time_s = estimate_for(EstimateRequest.model_validate({**body, "layout": layout})).predicted.iteration_time_s
        except PlanningError:
            continue
        if time_s < best[0]:
            best = (time_s, layout)
    return best


