"""The TP-group protocol around a chunk: the leader broadcasts the chunk input before forward and the
output gradient in backward; followers replay the leader's schedule CSV row by row."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from executor.model import Chunk
from executor.timing import OP_WORK, OpTimer


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
                 input_shape: Callable[[int], tuple[tuple[int, ...], torch.dtype]], timer: OpTimer,
                 layer_mbs: dict[int, float] | None = None):
        self.chunks, self.num_stages = chunks, num_stages
        self.group, self.leader = group, leader
        self.input_shape = input_shape
        self.timer = timer
        self.layer_mbs = layer_mbs or {}  # per chunk: layers x micro_batch_size / tp (the emulated work)
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
            start = self.timer.start()
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
            self.timer.record(mb, start, self.layer_mbs.get(virtual, 0.0) * OP_WORK[kind])
        if cache or deferred:
            raise RuntimeError(f"follower left work undone: {sorted(cache)} {sorted(deferred)}")


