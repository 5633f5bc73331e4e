"""Reference executor: train a small GPT on CPU/gloo exactly as a (possibly non-uniform) plan lays it out.

    torchrun --nproc-per-node W -m executor.torch_executor --plan PLAN.json \
        [--steps N] [--seed S] [--lr LR] [--slow-rank R --slow-factor F] [--telemetry OUT.jsonl] \
        [--layers L] [--hidden H] [--ffn F] [--vocab V] [--seq S] [--out-dir DIR]

(or, installed as the `resiplan-train` console script, `torchrun --nproc-per-node W
--no-python resiplan-train --plan PLAN.json ...`).

W is the number of devices the plan uses (every stage's devices). It runs what
the plan says and nothing else, so a non-uniform plan (replicas with different
TP degrees, layer splits or microbatch counts) trains to the same numbers as
one process training the whole batch: the point is to show that such plans are
executable and correct, not to be fast.

Rank mapping. Rank i runs the i-th used device in sorted order, sorting
`"<node>:<gpu>"` numerically by (node, gpu): with used devices 0:0, 1:0, 1:1
rank 0 is 0:0, rank 1 is 1:0 and rank 2 is 1:1. Ranks beyond W (a larger world)
only join the collective group creation and then idle.

Process groups (gloo, all created by every rank in the same order):
  * TP group per stage with tp > 1: the stage's ranks. Its lowest rank is the
    stage's *leader*; the others are *followers*.
  * PP group per replica: the leaders of its stages. PyTorch's pipelining
    runtime runs on it, so only leaders send activations between stages.
  * Gradient-sync group per distinct set of leaders holding the same layer in
    every replica (layers with the same set share the group).

Model. A llama-style decoder built from `plan.architecture` (RMSNorm, RoPE,
GQA attention, SwiGLU or GELU MLP, untied embedding and LM head, mean token
cross-entropy). Every parameter is initialised from a generator seeded by
(seed, parameter name), where the name carries the layer index
(`layers.7.wq.weight`), so every replica and every sharding starts from the
same full weights. A plan for a big model is shrunk (see `model_config`):
`--hidden/--ffn/--vocab/--seq/--layers` override it; the head counts are kept,
so the plan's TP degrees still divide them. `tied_embeddings` is ignored: the
executor (and its reference) always unties.

Model chunks. Replica r with p stages and the plan's v = virtual_stages runs
p * v chunks; chunk c of stage s is PyTorch's virtual stage c * p + s (looped
placement, as in adapters/torch_csv.py). Stage s's layer count (its `layers`
range) is split into v near-equal runs, earlier chunks taking the remainder,
and the runs are laid out in virtual-stage order; with v = 1 chunk 0 holds
exactly `layers`. The embedding is on virtual stage 0, final norm + LM head +
loss on the last.

Tensor parallelism is PyTorch's: each chunk is `parallelize_module`d on a
DeviceMesh built from the stage's TP group (q/k/v and gate/up projections
ColwiseParallel, out and down projections RowwiseParallel, the embedding
vocab-parallel RowwiseParallel, the LM head ColwiseParallel gathering its
logits); norms are replicated. The attention and MLP inputs become replicated
DTensors once per sublayer (PrepareModuleInput), so projections sharing an
input add their partial input gradients locally: one all-reduce per sublayer
forward and one backward, as in Megatron-LM.

A stage's TP degree may differ from its neighbours' (the planner does that),
so TP ranks cannot each run their own pipeline lane. Instead the leader alone
is a `PipelineStage` driven by `_PipelineScheduleRuntime`, which loads the
replica's torch-csv export (rows reordered to the PP group's rank order, since
a stage's leader need not have a lower rank than the next stage's). Its chunk
is wrapped so that forward first broadcasts the chunk input to the TP group,
and backward first broadcasts the output gradient (an autograd function on the
chunk output). Each follower replays the same CSV row: for `F` it receives the
input and runs its shard of the chunk, for `B`, `I` and `W` it calls the same
`torch.distributed.pipelining._backward` functions the stage calls (with the
same first-stage special cases), so every DTensor collective inside the chunk
happens in the same order on all TP ranks.

Gradient synchronisation, after each step's schedule, for every sync unit
(the embedding, each layer, the final norm + head) in one global order, which
keeps the overlapping groups deadlock-free:
  1. every rank holding the unit gathers its gradients to full tensors (one
     all-gather of all its shards over the TP group; replicated norms are
     already full);
  2. the leaders of the replicas holding the unit all-reduce the flattened
     full gradients, each contributing its sum of microbatch mean-loss
     gradients times `micro_batch_size / global_batch_size`: that is its
     replica's mean gradient weighted by the replica's share
     `num_microbatches * micro_batch_size / global_batch_size` of the global
     batch, so the sum is the full-batch mean gradient whatever the TP
     degrees, layer splits and microbatch counts;
  3. the leader broadcasts the result to its TP group and every rank keeps
     its own shard (`distribute_tensor` without communication).
Then plain SGD. `grad_weighting="uniform"` averages replicas equally instead
(wrong for unequal microbatch counts: the tests' negative control).

Telemetry. Each rank times each compute op it runs (F, B, I, W, recorded by
microbatch; waits for pipeline receives are outside the op), so a
microbatch's `compute_ms` is the sum over the rank's ops and chunks for it.
TP collectives are inside the ops, so a stage waits for its slowest TP member.
`--slow-rank R --slow-factor F` makes rank R sleep (F - 1) times each op's
measured time after the op (spinning the last 2 ms, as a plain sleep wakes
late on a busy host), and report the op's time including the sleep.
Rank 0 writes one JSON line per device and iteration in API.md's `/v1/detect`
telemetry item format; sequences are not packed, so `seq_lengths` is the
sequence length once per sequence of the microbatch.

A plan using one device also runs without torchrun.

PyTorch's pipelining runtime is private API (`_PipelineScheduleRuntime`,
`_load_csv`, `_backward`) and may move; this is written against torch 2.13.
"""

from __future__ import annotations

import argparse
import csv
import io
import itertools
import json
import math
import os
import re
import sys
import tempfile
import time
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from adapters import torch_csv
from wire.schemas import Plan

GRAD_WEIGHTINGS = ("batch-share", "uniform")

# ---------------------------------------------------------------------------------------------------------------
# Model


@dataclass(frozen=True)
class ModelConfig:
    num_layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    swiglu: bool
    seq_len: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def model_config(plan: Plan, *, layers: int | None = None, hidden: int | None = None, ffn: int | None = None,
                 vocab: int | None = None, seq: int | None = None) -> ModelConfig:
    """The executor's model: the plan's architecture, shrunk where it would not train on a CPU.

    Without overrides: a hidden size above 256 becomes `heads * max(2, 2 * (32 // heads))`
    (head dim 2..64, even for RoPE) with ffn twice that, a vocabulary above 1024 becomes 256,
    a sequence above 128 tokens becomes 32. Layer count and head counts stay as planned.
    """
    arch = plan.architecture
    if arch is None:
        raise ValueError("the plan carries no architecture; plan it again with this resiplan version")
    heads = arch.num_attention_heads
    kv = arch.num_kv_heads or heads
    if hidden is None:
        hidden = arch.hidden_size if arch.hidden_size <= 256 else heads * max(2, 2 * (32 // heads))
        if ffn is None:
            ffn = arch.ffn_hidden_size if arch.hidden_size <= 256 else 2 * hidden
    if ffn is None:
        ffn = 2 * hidden
    if vocab is None:
        vocab = arch.vocab_size if arch.vocab_size <= 1024 else 256
    plan_seq = plan.seq_length or 32
    if seq is None:
        seq = plan_seq if plan_seq <= 128 else 32
    if hidden % heads:
        raise ValueError(f"hidden size {hidden} is not a multiple of the {heads} attention heads")
    return ModelConfig(layers or arch.num_layers, hidden, ffn, heads, kv, vocab, arch.swiglu, seq)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rope(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding on (batch, heads, seq, head_dim); per head, so TP-local."""
    seq, dim = x.shape[-2], x.shape[-1]
    if dim % 2:
        return x
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    cos, sin = angles.cos(), angles.sin()
    first, second = x[..., : dim // 2], x[..., dim // 2 :]
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


class Attention(nn.Module):
    """Causal GQA self-attention. Head counts come from the projection widths, so a TP shard runs its own heads."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        kv_width = cfg.kv_heads * cfg.head_dim
        self.wq = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.wk = nn.Linear(cfg.hidden, kv_width, bias=False)
        self.wv = nn.Linear(cfg.hidden, kv_width, bias=False)
        self.wo = nn.Linear(cfg.hidden, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[0], x.shape[1]
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = _rope(q), _rope(k)
        group = q.shape[1] // k.shape[1]  # local q heads per local kv head (TP keeps the ratio)
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class Mlp(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.swiglu = cfg.swiglu
        self.w1 = nn.Linear(cfg.hidden, cfg.ffn, bias=False)  # gate (SwiGLU) or up (GELU)
        if cfg.swiglu:
            self.w3 = nn.Linear(cfg.hidden, cfg.ffn, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn, cfg.hidden, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x) if self.swiglu else F.gelu(self.w1(x)))


class Block(nn.Module):
    """One pre-norm decoder layer."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden)
        self.mlp = Mlp(cfg)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.attn_norm(h))
        return h + self.mlp(self.mlp_norm(h))


class Chunk(nn.Module):
    """A run of consecutive layers, with the embedding if it starts the model and norm + head if it ends it.

    Parameter names are global (`layers.5.wq.weight`), so a chunk's state is a slice of the whole model's.
    """

    def __init__(self, cfg: ModelConfig, layers: Iterable[int], has_embed: bool, has_head: bool, seed: int):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden) if has_embed else None
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in layers})
        self.norm = RMSNorm(cfg.hidden) if has_head else None
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False) if has_head else None
        init_parameters(self, seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        for block in self.layers.values():
            h = block(h)
        if self.head is not None:
            h = self.head(self.norm(h))
        return h if h is not x else x.clone()  # a chunk left without layers still hands on a new tensor


def init_parameters(module: nn.Module, seed: int) -> None:
    """Deterministic per parameter name: the same full tensor whichever chunk or rank builds it."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            generator = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**62)
            std = 0.02 / math.sqrt(2) if name.endswith(("wo.weight", "w2.weight")) else 0.02
            param.copy_(torch.randn(param.shape, generator=generator) * std)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


def global_batch(cfg: ModelConfig, batch_size: int, step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets, (batch_size, seq_len) each: random tokens, the same on every rank."""
    generator = torch.Generator().manual_seed(seed * 7_919 + step + 1)
    tokens = torch.randint(0, cfg.vocab, (batch_size, cfg.seq_len + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def tp_plan(chunk: Chunk, swiglu: bool) -> dict[str, Any]:
    """Megatron's layout in DTensor terms.

    The attention and MLP inputs become replicated DTensors once (PrepareModuleInput), so the
    column-parallel projections that share an input sum their partial input gradients locally and
    the backward needs one all-reduce per sublayer, like the forward's one after the row-parallel
    projection.
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
    )

    def shared_input() -> PrepareModuleInput:
        return PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                                  use_local_output=False)

    plan: dict[str, Any] = {}
    if chunk.embed is not None:
        plan["embed"] = RowwiseParallel(input_layouts=Replicate())  # vocab-parallel
    for i in chunk.layers:
        plan[f"layers.{i}.attn"] = shared_input()
        for name in ("wq", "wk", "wv"):
            plan[f"layers.{i}.attn.{name}"] = ColwiseParallel()
        plan[f"layers.{i}.attn.wo"] = RowwiseParallel()
        plan[f"layers.{i}.mlp"] = shared_input()
        for name in ("w1", *(("w3",) if swiglu else ())):
            plan[f"layers.{i}.mlp.{name}"] = ColwiseParallel()
        plan[f"layers.{i}.mlp.w2"] = RowwiseParallel()
    if chunk.head is not None:
        plan["head"] = ColwiseParallel(output_layouts=Replicate())
    return plan


def reference_train(cfg: ModelConfig, global_batch_size: int, steps: int, seed: int, lr: float
                    ) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process, the whole batch: (per-step losses, initial params, final params)."""
    model = Chunk(cfg, range(cfg.num_layers), True, True, seed)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    losses = []
    for step in range(steps):
        inputs, targets = global_batch(cfg, global_batch_size, step, seed)
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(p.grad, alpha=lr)
    return losses, initial, {name: p.detach().clone() for name, p in model.named_parameters()}


# ---------------------------------------------------------------------------------------------------------------
# Layout: ranks, stages, chunks


def device_key(device: str) -> tuple[int, int]:
    node, gpu = device.split(":")
    return int(node), int(gpu)


@dataclass
class StagePlace:
    replica: int  # index into Layout.replicas
    stage: int
    ranks: list[int]  # the stage's ranks, in the order of its devices; TP shard i is on the i-th lowest
    virtuals: list[int]  # PyTorch stage indices of its chunks
    layer_count: int

    @property
    def leader(self) -> int:
        return min(self.ranks)

    @property
    def tp(self) -> int:
        return len(self.ranks)


@dataclass
class Part:
    """One model chunk of one replica: PyTorch's virtual stage `virtual`."""

    replica: int
    stage: int
    chunk: int
    virtual: int
    layers: range
    has_embed: bool
    has_head: bool


@dataclass
class ReplicaPlace:
    plan_id: int
    num_microbatches: int
    stages: list[StagePlace]
    parts: list[Part]  # in virtual-stage order
    first_sequence: int  # its slice of the global batch starts here

    @property
    def leaders(self) -> list[int]:
        return [stage.leader for stage in self.stages]


@dataclass
class Layout:
    devices: list[str]  # rank -> device
    replicas: list[ReplicaPlace]
    virtual_stages: int
    micro_batch_size: int
    global_batch_size: int
    num_layers: int
    stage_of_rank: dict[int, StagePlace] = field(default_factory=dict)

    @property
    def world(self) -> int:
        return len(self.devices)


def _remap_bounds(bounds: list[int], old: int, new: int) -> list[int]:
    if old == new:
        return bounds
    mapped = [round(b * new / old) for b in bounds]
    if all(a < b for a, b in itertools.pairwise(mapped)):
        return mapped
    raise ValueError(f"cannot shrink the plan's {old} layers to {new}: a stage would hold no layer ({mapped})")


def chunk_sizes(count: int, v: int) -> list[int]:
    return [count // v + (1 if c < count % v else 0) for c in range(v)]


def build_layout(plan: Plan, num_layers: int | None = None) -> Layout:
    devices = sorted({d for r in plan.replicas for s in r.stages for d in s.devices}, key=device_key)
    rank_of = {device: rank for rank, device in enumerate(devices)}
    v = plan.virtual_stages
    plan_layers = plan.replicas[0].stages[-1].layers[1]
    num_layers = num_layers or plan_layers
    layout_replicas: list[ReplicaPlace] = []
    first_sequence = 0
    for index, replica in enumerate(sorted(plan.replicas, key=lambda r: r.id)):
        bounds = [replica.stages[0].layers[0]] + [stage.layers[1] for stage in replica.stages]
        if bounds[0] != 0 or bounds[-1] != plan_layers or any(
            s.layers[0] != prev.layers[1] for prev, s in itertools.pairwise(replica.stages)
        ):
            raise ValueError(f"replica {replica.id}: stages do not cover layers [0, {plan_layers}) contiguously")
        bounds = _remap_bounds(bounds, plan_layers, num_layers)
        p = len(replica.stages)
        stages = [
            StagePlace(index, s, [rank_of[d] for d in stage.devices], [c * p + s for c in range(v)],
                       bounds[s + 1] - bounds[s])
            for s, stage in enumerate(replica.stages)
        ]
        parts: list[Part] = []
        first = 0
        for virtual in range(p * v):
            s, c = virtual % p, virtual // p
            size = chunk_sizes(stages[s].layer_count, v)[c]
            parts.append(Part(index, s, c, virtual, range(first, first + size), virtual == 0, virtual == p * v - 1))
            first += size
        layout_replicas.append(ReplicaPlace(replica.id, replica.num_microbatches, stages, parts, first_sequence))
        first_sequence += replica.num_microbatches * plan.micro_batch_size
    gbs = plan.global_batch_size or first_sequence
    if gbs != first_sequence:
        raise ValueError(f"microbatches x micro_batch_size = {first_sequence} sequences, plan says {gbs}")
    layout = Layout(devices, layout_replicas, v, plan.micro_batch_size, gbs, num_layers)
    for replica in layout_replicas:
        for stage in replica.stages:
            for rank in stage.ranks:
                layout.stage_of_rank[rank] = stage
    return layout


def sync_units(cfg: ModelConfig) -> list[str]:
    """Gradient-sync units in their one global order: the embedding, each layer, the norm + head."""
    return ["embed", *(f"layers.{i}" for i in range(cfg.num_layers)), "head"]


def _unit_of(param_name: str) -> str:
    if param_name.startswith("layers."):
        return ".".join(param_name.split(".")[:2])
    return "embed" if param_name.startswith("embed.") else "head"


def _part_holds(part: Part, unit: str) -> bool:
    if unit == "embed":
        return part.has_embed
    if unit == "head":
        return part.has_head
    return int(unit.split(".")[1]) in part.layers


# ---------------------------------------------------------------------------------------------------------------
# The TP-group protocol around a chunk: input broadcast before forward, output-grad broadcast in backward


class _BroadcastGrad(torch.autograd.Function):
    """Identity forward; backward replaces the gradient by the leader's (followers pass a placeholder)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, group: dist.ProcessGroup, src: int) -> torch.Tensor:
        ctx.group, ctx.src = group, src
        return y.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.broadcast(grad, src=ctx.src, group=ctx.group)
        return grad, None, None


class LeaderChunk(nn.Module):
    """The leader's PipelineStage module: shares its input with the TP group, then runs its shard."""

    def __init__(self, chunk: Chunk, group: dist.ProcessGroup, leader: int):
        super().__init__()
        self.chunk = chunk
        self.group, self.leader = group, leader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dist.broadcast(x.detach().contiguous(), src=self.leader, group=self.group)
        return _BroadcastGrad.apply(self.chunk(x), self.group, self.leader)


_ACTION = re.compile(r"^(\d+)([FBIW])(\d+)$")


class Follower:
    """A non-leader TP rank of a stage: replays the stage's CSV row, mirroring the leader's PipelineStage calls."""

    def __init__(self, chunks: dict[int, Chunk], num_stages: int, group: dist.ProcessGroup, leader: int,
                 input_shape: Callable[[int], tuple[tuple[int, ...], torch.dtype]], timer: OpTimer):
        self.chunks, self.num_stages = chunks, num_stages
        self.group, self.leader = group, leader
        self.input_shape = input_shape
        self.timer = timer
        self.actions: list[tuple[int, str, int]] = []

    def load_row(self, row: list[str]) -> None:
        self.actions = []
        for cell in row:
            match = _ACTION.match(cell)
            if not match:
                raise ValueError(f"unexpected action {cell!r}")
            self.actions.append((int(match.group(1)), match.group(2), int(match.group(3))))

    def step(self) -> None:
        from torch.distributed.pipelining._backward import (
            stage_backward,
            stage_backward_input,
            stage_backward_weight,
        )

        cache: dict[tuple[int, int], tuple[torch.Tensor, list[torch.Tensor]]] = {}
        deferred: dict[tuple[int, int], Any] = {}
        for virtual, kind, mb in self.actions:
            chunk = self.chunks[virtual]
            start = time.perf_counter()
            if kind == "F":
                shape, dtype = self.input_shape(virtual)
                x = torch.empty(shape, dtype=dtype)
                dist.broadcast(x, src=self.leader, group=self.group)
                if virtual != 0:
                    x.requires_grad_(True)
                y = _BroadcastGrad.apply(chunk(x), self.group, self.leader)
                cache[(virtual, mb)] = (y, [x])
            else:
                key = (virtual, mb)
                if kind in "BI":
                    y, inputs = cache.pop(key)
                    grads = [torch.zeros_like(y)]  # replaced by the leader's in _BroadcastGrad.backward
                    if kind == "B":
                        stage_backward([y], grads, inputs)
                    elif virtual != 0:  # PipelineStage skips I on stage 0 and runs the whole backward at W
                        _, groups = stage_backward_input([y], grads, inputs, chunk.parameters())
                        deferred[key] = ("weight", groups)
                    else:
                        deferred[key] = ("full", ([y], grads, inputs))
                else:  # W
                    how, state = deferred.pop(key)
                    if how == "weight":
                        stage_backward_weight(chunk.parameters(), state)
                    else:
                        stage_backward(*state)
            self.timer.record(mb, start)
        if cache or deferred:
            raise RuntimeError(f"follower left work undone: {sorted(cache)} {sorted(deferred)}")


# ---------------------------------------------------------------------------------------------------------------
# Timing


def _sleep_until(deadline: float) -> None:
    """Sleep, then spin the last 2 ms: a plain sleep on a busy host wakes up late, inflating the slowdown."""
    while (left := deadline - time.perf_counter()) > 0.002:
        time.sleep(left - 0.002)
    while time.perf_counter() < deadline:
        pass


class OpTimer:
    """Per-microbatch compute time of one rank; optionally slowed by sleeping (factor - 1) x each op."""

    def __init__(self, slow_factor: float = 1.0):
        self.slow_factor = slow_factor
        self.ms: dict[int, float] = defaultdict(float)

    def record(self, microbatch: int, start: float) -> None:
        if self.slow_factor > 1.0:
            _sleep_until(start + self.slow_factor * (time.perf_counter() - start))
        self.ms[microbatch] += (time.perf_counter() - start) * 1000.0

    def wrap(self, fn: Callable) -> Callable:
        def timed(microbatch: int, *args, **kwargs):
            start = time.perf_counter()
            result = fn(microbatch, *args, **kwargs)
            self.record(microbatch, start)
            return result

        return timed

    def take(self) -> dict[int, float]:
        ms, self.ms = dict(self.ms), defaultdict(float)
        return ms


# ---------------------------------------------------------------------------------------------------------------
# The distributed run


@dataclass
class Options:
    steps: int = 3
    seed: int = 0
    lr: float = 0.1
    slow_rank: int | None = None
    slow_factor: float = 1.0
    grad_weighting: str = "batch-share"
    layers: int | None = None
    hidden: int | None = None
    ffn: int | None = None
    vocab: int | None = None
    seq: int | None = None


@dataclass
class RankResult:
    rank: int
    device: str | None
    losses: list[float]  # global per-step loss (every rank of the plan has it)
    params: dict[str, torch.Tensor]  # full final tensors of the chunks this rank leads
    replica: int | None  # plan replica id
    telemetry: list[dict[str, Any]]  # this rank's /v1/detect items, one per step


@dataclass
class _Groups:
    plan: dist.ProcessGroup | None
    tp: dict[tuple[int, int], dist.ProcessGroup]  # (replica index, stage) -> group, tp > 1 only
    pp: dict[int, dist.ProcessGroup]  # replica index -> leaders' group
    sync: dict[tuple[int, ...], dist.ProcessGroup]  # sorted leader ranks -> group


def _new_groups(layout: Layout, units: list[str]) -> tuple[_Groups, dict[str, tuple[int, ...]]]:
    """Every group, created by every rank of the world in the same order."""
    world = dist.get_world_size()
    plan_group = None if world == layout.world else dist.new_group(list(range(layout.world)))
    tp = {}
    for i, replica in enumerate(layout.replicas):
        for stage in replica.stages:
            if stage.tp > 1:
                tp[(i, stage.stage)] = dist.new_group(sorted(stage.ranks))
    pp = {i: dist.new_group(sorted(replica.leaders)) for i, replica in enumerate(layout.replicas)}
    holders = {}
    for unit in units:
        ranks = []
        for replica in layout.replicas:
            part = next(part for part in replica.parts if _part_holds(part, unit))
            ranks.append(replica.stages[part.stage].leader)
        holders[unit] = tuple(sorted(ranks))
    sync = {ranks: dist.new_group(list(ranks)) for ranks in sorted(set(holders.values())) if len(ranks) > 1}
    return _Groups(plan_group, tp, pp, sync), holders


def _csv_rows(plan: Plan, replica_id: int) -> list[list[str]]:
    return list(csv.reader(io.StringIO(torch_csv.render(plan, replica_id))))


def run(plan: Plan, options: Options) -> RankResult:
    """This rank's part of training `plan` for `options.steps` steps. The process group must be initialised."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    if options.grad_weighting not in GRAD_WEIGHTINGS:
        raise ValueError(f"grad_weighting must be one of {GRAD_WEIGHTINGS}")
    cfg = model_config(plan, layers=options.layers, hidden=options.hidden, ffn=options.ffn, vocab=options.vocab,
                       seq=options.seq)
    layout = build_layout(plan, cfg.num_layers)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < layout.world:
        raise RuntimeError(f"the plan uses {layout.world} devices; launch {layout.world} ranks, not {world}")
    units = sync_units(cfg)
    groups, holders = _new_groups(layout, units)
    if rank >= layout.world:
        return RankResult(rank, None, [], {}, None, [])

    stage = layout.stage_of_rank[rank]
    replica = layout.replicas[stage.replica]
    is_leader = rank == stage.leader
    tp_group = groups.tp.get((stage.replica, stage.stage))
    p, v, mbs = len(replica.stages), layout.virtual_stages, layout.micro_batch_size
    n_virtual = p * v
    timer = OpTimer(options.slow_factor if rank == options.slow_rank else 1.0)

    # Chunks: full deterministic weights, then this rank's TP shard.
    mesh = DeviceMesh.from_group(tp_group, "cpu") if tp_group is not None else None
    chunks: dict[int, Chunk] = {}
    for virtual in stage.virtuals:
        part = replica.parts[virtual]
        chunk = Chunk(cfg, part.layers, part.has_embed, part.has_head, options.seed)
        if mesh is not None:
            parallelize_module(chunk, mesh, tp_plan(chunk, cfg.swiglu))
        chunks[virtual] = chunk
    params = {name: param for chunk in chunks.values() for name, param in chunk.named_parameters()}

    def input_shape(virtual: int) -> tuple[tuple[int, ...], torch.dtype]:
        if virtual == 0:
            return (mbs, cfg.seq_len), torch.long
        return (mbs, cfg.seq_len, cfg.hidden), torch.float32

    rows = _csv_rows(plan, replica.plan_id)
    if len(rows) != p:
        raise RuntimeError(f"replica {replica.plan_id}: {len(rows)} CSV rows for {p} stages")
    schedule = follower = None
    if is_leader:
        pp_group = groups.pp[stage.replica]
        # Row k of the CSV must be PP-group rank k; new_group orders ranks by number.
        leaders = sorted(replica.leaders)
        permuted = [None] * p
        for s, row in enumerate(rows):
            permuted[leaders.index(replica.stages[s].leader)] = row
        pp_stages = []
        for virtual in stage.virtuals:
            module = chunks[virtual] if tp_group is None else LeaderChunk(chunks[virtual], tp_group, rank)
            shape, dtype = input_shape(virtual)
            example_in = torch.zeros(shape, dtype=dtype)
            if virtual != 0:
                example_in.requires_grad_(True)
            out_shape = (mbs, cfg.seq_len, cfg.vocab if virtual == n_virtual - 1 else cfg.hidden)
            pp_stage = PipelineStage(module, virtual, n_virtual, torch.device("cpu"), input_args=(example_in,),
                                     output_args=(torch.zeros(out_shape, requires_grad=True),), group=pp_group)
            for method in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                setattr(pp_stage, method, timer.wrap(getattr(pp_stage, method)))
            pp_stages.append(pp_stage)
        schedule = _PipelineScheduleRuntime(pp_stages, n_microbatches=replica.num_microbatches, loss_fn=loss_fn,
                                            scale_grads=False)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / f"replica{replica.plan_id}.csv"
            path.write_text("".join(",".join(row) + "\n" for row in permuted))
            schedule._load_csv(str(path))
    else:
        follower = Follower(chunks, n_virtual, tp_group, stage.leader, input_shape, timer)
        follower.load_row(rows[stage.stage])

    # Replica contribution to the full-batch mean gradient (see the module docstring).
    if options.grad_weighting == "batch-share":
        coefficient = mbs / layout.global_batch_size
    else:
        coefficient = 1.0 / (len(layout.replicas) * replica.num_microbatches)
    first_rows = slice(replica.first_sequence, replica.first_sequence + replica.num_microbatches * mbs)
    first_stage, last_stage = 0 in stage.virtuals, n_virtual - 1 in stage.virtuals
    device = layout.devices[rank]
    losses: list[float] = []
    telemetry: list[dict[str, Any]] = []

    def to_full(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if isinstance(t, DTensor) else t

    for step in range(options.steps):
        for param in params.values():
            param.grad = None
        inputs, targets = global_batch(cfg, layout.global_batch_size, step, options.seed)
        mb_losses: list[torch.Tensor] = []
        if schedule is not None:
            args = (inputs[first_rows],) if first_stage else ()
            kwargs = {"target": targets[first_rows], "losses": mb_losses} if last_stage else {}
            schedule.step(*args, **kwargs)
        else:
            follower.step()

        # Gradients: full tensors, weighted all-reduce among the replicas' leaders, re-shard.
        with torch.no_grad():
            for unit in units:
                names = [name for name in params if _unit_of(name) == unit]
                if not names:
                    continue
                full = _full_tensors([params[name].grad for name in names], tp_group)
                flat = torch.cat([g.reshape(-1) for g in full]) if is_leader else torch.empty(
                    sum(g.numel() for g in full))
                if is_leader:
                    flat.mul_(coefficient)
                    if holders[unit] in groups.sync:
                        dist.all_reduce(flat, group=groups.sync[holders[unit]])
                if tp_group is not None:
                    dist.broadcast(flat, src=stage.leader, group=tp_group)
                offset = 0
                for name, g in zip(names, full, strict=True):
                    reduced = flat[offset : offset + g.numel()].view_as(g)
                    offset += g.numel()
                    param = params[name]
                    if isinstance(param, DTensor):
                        param.grad = distribute_tensor(reduced, param.device_mesh, param.placements,
                                                       src_data_rank=None)
                    else:
                        param.grad = reduced.clone()
            for param in params.values():
                param.sub_(param.grad, alpha=options.lr)

        # The step's loss: mean over every microbatch of every replica.
        total = torch.tensor([float(sum(loss.item() for loss in mb_losses)), float(len(mb_losses))],
                             dtype=torch.float64)
        dist.all_reduce(total, group=groups.plan)
        losses.append((total[0] / total[1]).item())
        ms = timer.take()
        telemetry.append({
            "device": device,
            "iteration": step,
            "microbatches": [{"seq_lengths": [cfg.seq_len] * mbs, "compute_ms": round(ms.get(mb, 0.0), 4)}
                             for mb in range(replica.num_microbatches)],
            "last_heartbeat_s_ago": 0.0,
        })

    final = {name: to_full(param.detach()).clone() for name, param in params.items()}
    return RankResult(rank, device, losses, final if is_leader else {}, replica.plan_id, telemetry)


def _full_tensors(tensors: list[torch.Tensor], group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """The full tensors of one sync unit's (possibly sharded) tensors.

    Evenly sharded DTensors travel in one all-gather over the TP group; any other DTensor
    uses `full_tensor()`. Replicated tensors are already full.
    """
    from torch.distributed.tensor import DTensor, Shard

    full = list(tensors)
    sharded = [i for i, t in enumerate(tensors) if isinstance(t, DTensor)]
    if not sharded:
        return full

    def even(t: DTensor) -> bool:
        placement = t.placements[0]
        return len(t.placements) == 1 and isinstance(placement, Shard) and t.shape[placement.dim] % t.device_mesh.size() == 0

    if group is None or not all(even(tensors[i]) for i in sharded):
        for i in sharded:
            full[i] = tensors[i].full_tensor()
        return full
    local = torch.cat([tensors[i].to_local().reshape(-1) for i in sharded])
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, local, group=group)
    offset = 0
    for i in sharded:
        shape = tensors[i].to_local().shape
        n = shape.numel()
        full[i] = torch.cat([piece[offset : offset + n].view(shape) for piece in pieces], dim=tensors[i].placements[0].dim)
        offset += n
    return full


def gather_telemetry(result: RankResult, world_devices: int) -> list[dict[str, Any]] | None:
    """All ranks' telemetry items on rank 0 (None elsewhere), ordered by iteration then rank."""
    items: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(result.telemetry, items, dst=0)
    if items is None:
        return None
    per_rank = [rank_items for rank_items in items[:world_devices] if rank_items]
    steps = max((len(rank_items) for rank_items in per_rank), default=0)
    return [rank_items[step] for step in range(steps) for rank_items in per_rank if step < len(rank_items)]


def run_rank(rank: int, world: int, init_method: str, plan_json: str, options: Options,
             out_dir: str | None = None, telemetry_path: str | None = None, timeout_s: float = 60.0) -> RankResult:
    """Join a gloo world, run the plan, optionally save this rank's results, leave the world."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    try:
        return _run_and_save(Plan.model_validate_json(plan_json), options, out_dir, telemetry_path)
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)


def _run_and_save(plan: Plan, options: Options, out_dir: str | None, telemetry_path: str | None) -> RankResult:
    result = run(plan, options)
    world_devices = len({d for r in plan.replicas for s in r.stages for d in s.devices})
    items = gather_telemetry(result, world_devices)
    if telemetry_path and items is not None:
        with open(telemetry_path, "w") as out:
            out.writelines(json.dumps(item) + "\n" for item in items)
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        torch.save({"rank": result.rank, "device": result.device, "replica": result.replica,
                    "losses": result.losses, "params": result.params},
                   Path(out_dir) / f"rank{result.rank}.pt")
    dist.barrier()
    return result


# ---------------------------------------------------------------------------------------------------------------
# Command line (under torchrun)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="resiplan-train",
        description="Train a small GPT on gloo/CPU exactly as a resiplan plan lays it out (run under "
                    "torchrun --nproc-per-node <devices the plan uses>).",
    )
    parser.add_argument("--plan", required=True, help="Plan JSON (as `resiplan plan` prints it)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate")
    parser.add_argument("--slow-rank", type=int, default=None, help="rank that sleeps to imitate a fail-slow GPU")
    parser.add_argument("--slow-factor", type=float, default=1.0, help="the slow rank's ops take this many times longer")
    parser.add_argument("--telemetry", default=None, help="write /v1/detect telemetry items here (JSON lines)")
    parser.add_argument("--grad-weighting", choices=GRAD_WEIGHTINGS, default="batch-share",
                        help="replica weights in the gradient all-reduce (uniform is wrong for unequal microbatches)")
    for name in ("layers", "hidden", "ffn", "vocab", "seq"):
        parser.add_argument(f"--{name}", type=int, default=None, help=f"override the model's {name}")
    parser.add_argument("--out-dir", default=None, help="save each rank's losses and final full parameters here")
    parser.add_argument("--timeout", type=float, default=300.0, help="collective timeout, seconds")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.slow_factor < 1.0:
        print("--slow-factor must be >= 1", file=sys.stderr)
        return 2
    plan = Plan.model_validate_json(Path(args.plan).read_text())
    options = Options(steps=args.steps, seed=args.seed, lr=args.lr, slow_rank=args.slow_rank,
                      slow_factor=args.slow_factor, grad_weighting=args.grad_weighting, layers=args.layers,
                      hidden=args.hidden, ffn=args.ffn, vocab=args.vocab, seq=args.seq)
    torch.set_num_threads(1)
    if "RANK" in os.environ:
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    elif build_layout(plan).world == 1:  # a one-device plan needs no launcher
        store = Path(tempfile.mkdtemp()) / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1,
                                timeout=timedelta(seconds=args.timeout))
    else:
        print(f"run me under torchrun --nproc-per-node {build_layout(plan).world} (the devices the plan uses)",
              file=sys.stderr)
        return 2
    try:
        result = _run_and_save(plan, options, args.out_dir, args.telemetry)
        if dist.get_rank() == 0:
            cfg = model_config(plan, layers=args.layers, hidden=args.hidden, ffn=args.ffn, vocab=args.vocab,
                               seq=args.seq)
            print(json.dumps({"model": cfg.__dict__, "losses": result.losses}), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
