"""The reference model: a small llama-style decoder built from a plan's architecture, its seeded
initialisation, data, loss, TP plan and the single-process reference run."""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from wire.schemas import Plan

GRAD_WEIGHTINGS = ("batch-share", "uniform")



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
    if arch.num_experts:
        raise ValueError(f"the plan's model is a mixture of {arch.num_experts} experts; the reference executor "
                         "runs dense models only")
    if getattr(arch, "mtp_layers", 0):
        raise ValueError("the plan's model predicts further tokens (mtp_layers); the reference executor builds the "
                         "next-token model only")
    if arch.head_dim is not None or arch.qk_norm:
        raise ValueError("the plan's model sets head_dim apart from hidden / heads or norms queries and keys; the "
                         "reference executor builds Llama-style attention only")
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


def reference_train(cfg: ModelConfig, global_batch_size: int, steps: int, seed: int, lr: float,
                    optimizer: str = "sgd", adam_eps: float = 1e-8
                    ) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process, the whole batch: (per-step losses, initial params, final params). Adam is PyTorch's own
    (`torch.optim.Adam`, not the executor's sharded one), so it checks that one."""
    model = Chunk(cfg, range(cfg.num_layers), True, True, seed)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    adam = torch.optim.Adam(model.parameters(), lr=lr, eps=adam_eps, foreach=False) if optimizer == "adam" else None
    losses = []
    for step in range(steps):
        inputs, targets = global_batch(cfg, global_batch_size, step, seed)
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        losses.append(loss.item())
        if adam is not None:
            adam.step()
            continue
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(p.grad, alpha=lr)
    return losses, initial, {name: p.detach().clone() for name, p in model.named_parameters()}
