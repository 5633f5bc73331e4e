"""Synthetic per-device telemetry for a plan: packed microbatches, noise, slowdowns and stops.

    from benchmarks.telemetry import TelemetryConfig, Slowdown, generate_telemetry
    windows = generate_telemetry(plan, model, TelemetryConfig(iterations=200, slowdowns=(Slowdown("3:5", 0.5, 100),)))

Each data-parallel replica draws its own microbatches every iteration; all
stages (and TP ranks) of a replica run the same ones. A microbatch is
`micro_batch_size` samples of `seq_length` tokens, each filled with documents
until full (the last one cut): many short documents (lognormal, median 512
tokens) and, with probability `long_fraction` per document, a long one
(lognormal around half the sequence length), as pretraining packs web text
with books and code.

True compute time comes from the cost model's execution time of the stage
(`cost_models.compute.layer_time` compute parts, plus the head on the last
stage and the embedding on the first, TP collectives excluded), which is
c0 + c1 * tokens + c2 * sum(length^2) per microbatch: it shares the detector's
shape but not its numbers (elementwise HBM traffic, per-layer launch overhead),
and `attention_error` scales c2 to model a cost model that misjudges attention;
`role_spread_sigma` scales each role's c1 and c2 by random factors (a job whose
stages the cost model misjudges, each its own way).
On top: a fixed per-device speed spread (lognormal, 2%: no two GPUs are
equal), a per device-iteration jitter (1%) and a per-microbatch noise (3%),
all multiplicative, all from one seeded `random.Random`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from cost_models.compute import embedding_time, head_time, layer_time
from cost_models.efficiency import SoftwareConfig
from cost_models.gpu_efficiency import builtin_efficiency
from cost_models.hardware import gpu_preset
from cost_models.model_spec import ModelSpec
from detector import Microbatch, TelemetryItem


@dataclass(frozen=True)
class LengthMix:
    """Document lengths packed into each sample (tokens)."""

    short_median: float = 512.0
    short_sigma: float = 1.0
    long_fraction: float = 0.15
    long_median_fraction: float = 0.5  # of seq_length
    long_sigma: float = 0.5
    min_length: int = 16


@dataclass(frozen=True)
class Slowdown:
    """`device` runs at `speed` x its healthy speed from iteration index `onset` on."""

    device: str
    speed: float
    onset: int


@dataclass(frozen=True)
class Stop:
    """`device` stops computing and heart-beating at iteration index `at`."""

    device: str
    at: int


@dataclass(frozen=True)
class TelemetryConfig:
    iterations: int
    seed: int = 0
    gpu: str = "H100-SXM"
    noise_sigma: float = 0.03  # per microbatch
    jitter_sigma: float = 0.01  # per device and iteration
    device_spread_sigma: float = 0.02  # per device, fixed
    attention_error: float = 1.0  # true attention cost / the cost model's
    role_spread_sigma: float = 0.0  # per role and job: its linear and attention costs each off by a lognormal factor
    lengths: LengthMix = field(default_factory=LengthMix)
    # (replica index, its own mix): data-parallel replicas read different shards, e.g. one of long books
    replica_lengths: tuple[tuple[int, LengthMix], ...] = ()
    slowdowns: tuple[Slowdown, ...] = ()
    stops: tuple[Stop, ...] = ()
    heartbeat_period_s: float = 2.0


@dataclass(frozen=True)
class RoleTruth:
    """True compute ms of one microbatch: c0 + c1 * tokens + c2 * sum(length^2)."""

    c0: float
    c1: float
    c2: float

    def ms(self, tokens: int, sum_squares: int) -> float:
        return self.c0 + self.c1 * tokens + self.c2 * sum_squares


def role_truth(
    model: ModelSpec, layers: tuple[int, int], tp: int, recompute: str, gpu_name: str, attention_error: float = 1.0
) -> RoleTruth:
    """The cost model's compute time of a stage as a quadratic in the sequence length (exact through 3 points)."""
    gpu = gpu_preset(gpu_name)
    efficiency = builtin_efficiency(gpu)  # as the service prices that GPU (`cost_models.gpu_efficiency`)
    software = SoftwareConfig()
    count = layers[1] - layers[0]

    def stage_ms(length: int) -> float:
        layer = layer_time(
            model, length, 1, tp, recompute, gpu, gpu.intra_node_bandwidth_gb_s, efficiency, software
        )
        total = count * (layer.forward_compute_ms + layer.backward_compute_ms)
        if layers[1] >= model.num_layers:
            head = head_time(model, length, 1, tp, gpu, efficiency)
            total += head.forward_compute_ms + head.backward_compute_ms
        if layers[0] == 0:
            embed = embedding_time(model, length, 1, tp, gpu, gpu.intra_node_bandwidth_gb_s, efficiency)
            total += embed.forward_compute_ms + embed.backward_compute_ms
        return total

    x1, x2, x3 = 1024, 2048, 4096
    f1, f2, f3 = stage_ms(x1), stage_ms(x2), stage_ms(x3)
    c2 = ((f3 - f2) / (x3 - x2) - (f2 - f1) / (x2 - x1)) / (x3 - x1)
    c1 = (f2 - f1) / (x2 - x1) - c2 * (x1 + x2)
    c0 = f1 - c1 * x1 - c2 * x1 * x1
    return RoleTruth(c0=c0, c1=c1, c2=c2 * attention_error)


def pack_sample(rng: random.Random, seq_length: int, mix: LengthMix) -> list[int]:
    """Documents filling one sample of seq_length tokens; the last is cut to fit."""
    lengths: list[int] = []
    remaining = seq_length
    long_mu = math.log(max(mix.min_length, mix.long_median_fraction * seq_length))
    short_mu = math.log(mix.short_median)
    while remaining > 0:
        if rng.random() < mix.long_fraction:
            length = rng.lognormvariate(long_mu, mix.long_sigma)
        else:
            length = rng.lognormvariate(short_mu, mix.short_sigma)
        length = min(remaining, max(mix.min_length, round(length)))
        lengths.append(length)
        remaining -= length
    return lengths


def generate_telemetry(plan: Any, model: ModelSpec, config: TelemetryConfig) -> list[list[TelemetryItem]]:
    """Telemetry items per iteration (iteration numbers 0..iterations-1) for every stage device of `plan`.

    `plan` is API.md's Plan (wire.schemas.Plan or anything with the same fields).
    """
    rng = random.Random(config.seed)
    seq_length = plan.seq_length
    micro_batch_size = plan.micro_batch_size
    recompute = plan.recompute or "selective"
    iteration_s = plan.predicted.iteration_time_s
    truths: dict[tuple[tuple[int, int], int], RoleTruth] = {}
    for replica in plan.replicas:
        for stage in replica.stages:
            key = (tuple(stage.layers), stage.tp)
            if key not in truths:
                truth = role_truth(model, key[0], stage.tp, recompute, config.gpu, config.attention_error)
                if config.role_spread_sigma > 0:  # drawn only then: other configs keep their random sequence
                    truth = RoleTruth(truth.c0, truth.c1 * math.exp(rng.gauss(0.0, config.role_spread_sigma)),
                                      truth.c2 * math.exp(rng.gauss(0.0, config.role_spread_sigma)))
                truths[key] = truth
    devices = [device for replica in plan.replicas for stage in replica.stages for device in stage.devices]
    intrinsic = {device: math.exp(rng.gauss(0.0, config.device_spread_sigma)) for device in devices}
    slow = {slowdown.device: slowdown for slowdown in config.slowdowns}
    stops = {stop.device: stop.at for stop in config.stops}
    unknown = (set(slow) | set(stops)) - set(devices)
    if unknown:
        raise ValueError(f"slowdowns/stops name devices not in the plan: {sorted(unknown)}")

    windows: list[list[TelemetryItem]] = []
    for iteration in range(config.iterations):
        items: list[TelemetryItem] = []
        mixes = dict(config.replica_lengths)
        for index, replica in enumerate(plan.replicas):
            packs = []
            for _ in range(replica.num_microbatches):
                lengths: list[int] = []
                for _ in range(micro_batch_size):
                    lengths.extend(pack_sample(rng, seq_length, mixes.get(index, config.lengths)))
                packs.append((tuple(lengths), sum(lengths), sum(length * length for length in lengths)))
            for stage in replica.stages:
                truth = truths[(tuple(stage.layers), stage.tp)]
                base_ms = [truth.ms(tokens, squares) for _, tokens, squares in packs]
                for device in stage.devices:
                    stopped_at = stops.get(device)
                    if stopped_at is not None and iteration >= stopped_at:
                        age = (iteration - stopped_at + 1) * iteration_s + rng.uniform(0.0, config.heartbeat_period_s)
                        items.append(TelemetryItem(device, iteration, (), age))
                        continue
                    factor = intrinsic[device] * math.exp(rng.gauss(0.0, config.jitter_sigma))
                    slowdown = slow.get(device)
                    if slowdown is not None and iteration >= slowdown.onset:
                        factor /= slowdown.speed
                    microbatches = tuple(
                        Microbatch(lengths, ms * factor * math.exp(rng.gauss(0.0, config.noise_sigma)))
                        for (lengths, _, _), ms in zip(packs, base_ms, strict=True)
                    )
                    heartbeat = rng.uniform(0.0, config.heartbeat_period_s)
                    items.append(TelemetryItem(device, iteration, microbatches, heartbeat))
        windows.append(items)
    return windows


def to_wire(items: list[TelemetryItem]) -> list[dict[str, Any]]:
    """Items as API.md's JSON telemetry."""
    return [
        {
            "device": item.device,
            "iteration": item.iteration,
            "microbatches": [
                {"seq_lengths": list(mb.seq_lengths), "compute_ms": round(mb.compute_ms, 4)} for mb in item.microbatches
            ],
            "last_heartbeat_s_ago": round(item.last_heartbeat_s_ago, 3),
        }
        for item in items
    ]
