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
    # A mixture of experts (num_experts > 0): `ffn` is each routed expert's width; `shared_ffn` the shared
    # experts' (0: none); the first `dense_layers` layers have a dense MLP `dense_ffn` wide.
    num_experts: int = 0
    top_k: int = 0
    shared_ffn: int = 0
    dense_layers: int = 0
    dense_ffn: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def routed(self, layer: int) -> bool:
        """Whether `layer`'s MLP is routed experts."""
        return self.num_experts > 0 and layer >= self.dense_layers


def model_config(plan: Plan, *, layers: int | None = None, hidden: int | None = None, ffn: int | None = None,
                 vocab: int | None = None, seq: int | None = None) -> ModelConfig:
    """The executor's model: the plan's architecture, shrunk where it would not train on a CPU.

    Without overrides: a hidden size above 256 becomes `heads * max(2, 2 * (32 // heads))`
    (head dim 2..64, even for RoPE) with ffn twice that, a vocabulary above 1024 becomes 256,
    a sequence above 128 tokens becomes 32. Layer count and head counts stay as planned; a mixture of
    experts keeps its expert count, top k and dense layers, and when shrunk its shared and dense MLPs take
    the routed experts' width.
    """
    arch = plan.architecture
    if arch is None:
        raise ValueError("the plan carries no architecture; plan it again with this resiplan version")
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
    experts = {}
    if arch.num_experts:
        shrunk = arch.hidden_size > 256

        def width(planned: int) -> int:
            return planned if not planned or not shrunk else ffn

        experts = {"num_experts": arch.num_experts, "top_k": arch.experts_per_token,
                   "shared_ffn": width(arch.shared_expert_ffn_hidden_size), "dense_layers": arch.dense_layers,
                   "dense_ffn": width(arch.dense_ffn_hidden_size)}
    return ModelConfig(layers or arch.num_layers, hidden, ffn, heads, kv, vocab, arch.swiglu, seq, **experts)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _all_gathered(local: torch.Tensor, group: Any, size: int) -> list[torch.Tensor]:
    """Every rank's `local` (equal shapes), in group-rank order."""
    import torch.distributed as dist

    pieces = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(pieces, local.contiguous(), group=group)
    return pieces


@dataclass(frozen=True)
class ContextParallel:
    """A stage's context-parallel ranks as one of them sees them: its index among them, their count, and the
    group of those with its TP index (they hold the same heads).

    Sequences are split as Megatron-LM splits them for causal attention: into 2 x size equal pieces, rank c
    holding pieces c and 2 size - 1 - c, so every rank attends over the same number of earlier tokens."""

    group: Any  # torch.distributed.ProcessGroup
    rank: int
    size: int

    def positions(self, seq_len: int, rank: int | None = None) -> torch.Tensor:
        """The sequence positions a rank holds, in the order it holds them."""
        c = self.rank if rank is None else rank
        piece = seq_len // (2 * self.size)
        return torch.cat([torch.arange(c * piece, (c + 1) * piece),
                          torch.arange((2 * self.size - 1 - c) * piece, (2 * self.size - c) * piece)])

    def gathered(self, local: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's `local` along `dim`, put back in sequence order."""
        pieces = _all_gathered(local, self.group, self.size)
        seq_len = local.shape[dim] * self.size
        full = local.new_empty((*local.shape[:dim], seq_len, *local.shape[dim + 1:]))
        for rank, piece in enumerate(pieces):
            full.index_copy_(dim, self.positions(seq_len, rank), piece)
        return full


class _SplitSequence(torch.autograd.Function):
    """Whole sequences in (every rank of the stage has them), this rank's positions out; backward puts every
    rank's gradient back together, the gradient of the whole input."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, context: ContextParallel) -> torch.Tensor:
        ctx.context = context
        return x.index_select(1, context.positions(x.shape[1])).contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.context.gathered(grad, 1), None


class _GatherSequence(torch.autograd.Function):
    """This rank's positions in, whole sequences out (the same on every rank); backward keeps this rank's
    positions of the gradient, which every rank holds whole and alike (what follows runs on whole sequences)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, context: ContextParallel) -> torch.Tensor:
        ctx.context = context
        return context.gathered(local, 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.index_select(1, ctx.context.positions(grad.shape[1])).contiguous(), None


class _GatherKeysValues(torch.autograd.Function):
    """Keys or values (batch, heads, local positions, head_dim) in, every position's out; backward sums what
    every rank's queries put on each position and keeps this rank's."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, context: ContextParallel) -> torch.Tensor:
        ctx.context = context
        return context.gathered(local, 2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.context.group)
        return grad.index_select(2, ctx.context.positions(grad.shape[2])).contiguous(), None


def _rope(x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary position embedding on (batch, heads, seq, head_dim) at `positions` (default 0, 1, ...); per head,
    so TP-local."""
    seq, dim = x.shape[-2], x.shape[-1]
    if dim % 2:
        return x
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    at = torch.arange(seq) if positions is None else positions
    angles = torch.outer(at.to(torch.float32), inv)
    cos, sin = angles.cos(), angles.sin()
    first, second = x[..., : dim // 2], x[..., dim // 2 :]
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


class Attention(nn.Module):
    """Causal GQA self-attention. Head counts come from the projection widths, so a TP shard runs its own heads."""

    def __init__(self, cfg: ModelConfig, context: ContextParallel | None = None):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.context = context
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
        context = self.context
        if context is None:
            q, k = _rope(q), _rope(k)
        else:
            # This rank's queries against every rank's keys and values, causal by sequence position.
            seq_len = s * context.size
            mine = context.positions(seq_len)
            q, k = _rope(q, mine), _rope(k, mine)
            k, v = _GatherKeysValues.apply(k, context), _GatherKeysValues.apply(v, context)
        group = q.shape[1] // k.shape[1]  # local q heads per local kv head (TP keeps the ratio)
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        if context is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            visible = mine[:, None] >= torch.arange(seq_len)[None, :]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=visible)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class Mlp(nn.Module):
    def __init__(self, cfg: ModelConfig, width: int | None = None):
        super().__init__()
        width = width or cfg.ffn
        self.swiglu = cfg.swiglu
        self.w1 = nn.Linear(cfg.hidden, width, bias=False)  # gate (SwiGLU) or up (GELU)
        if cfg.swiglu:
            self.w3 = nn.Linear(cfg.hidden, width, bias=False)  # up
        self.w2 = nn.Linear(width, cfg.hidden, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x) if self.swiglu else F.gelu(self.w1(x)))


@dataclass(frozen=True)
class ExpertParallel:
    """A stage's expert-parallel ranks as one of them sees them: its index, their count and their group. Rank e
    holds the e-th block of num_experts / size routed experts (megatron-core's layout)."""

    group: Any  # torch.distributed.ProcessGroup
    rank: int
    size: int

    def experts(self, num_experts: int) -> range:
        per_rank = num_experts // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    def gathered_indices(self, local: torch.Tensor) -> torch.Tensor:
        return torch.cat(_all_gathered(local, self.group, self.size))


class _GatherTokens(torch.autograd.Function):
    """Every EP rank's tokens (rank-major); backward sums what every rank's experts put on each token and keeps
    this rank's."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: ExpertParallel) -> torch.Tensor:
        ctx.group = group
        return torch.cat(_all_gathered(local, group.group, group.size))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group.group)
        return grad.chunk(ctx.group.size)[ctx.group.rank], None


class _CombineTokens(torch.autograd.Function):
    """Each EP rank's experts' outputs for every rank's tokens in, the sum over ranks for this rank's tokens out;
    backward hands each rank the gradients of every rank's tokens."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, group: ExpertParallel) -> torch.Tensor:
        import torch.distributed as dist

        ctx.group = group
        summed = partial.contiguous().clone()
        dist.all_reduce(summed, group=group.group)
        return summed.chunk(group.size)[group.rank].contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return torch.cat(_all_gathered(grad, ctx.group.group, ctx.group.size)), None


class Moe(nn.Module):
    """Routed experts plus the shared ones. The router's softmax over experts picks each token's top k, whose
    weights are renormalized to sum to 1 (Mixtral's, and Qwen3's `norm_topk_prob`). With `expert_group`, this
    rank holds its block of the experts and runs them on the tokens of every rank of its EP group (the
    dispatch: an all-gather), and the outputs are summed back to each token's rank (the combine): what the
    all-to-all dispatcher computes, with more traffic."""

    def __init__(self, cfg: ModelConfig, expert_group: ExpertParallel | None = None):
        super().__init__()
        self.top_k, self.expert_group = cfg.top_k, expert_group
        held = range(cfg.num_experts) if expert_group is None else expert_group.experts(cfg.num_experts)
        self.router = nn.Linear(cfg.hidden, cfg.num_experts, bias=False)
        self.experts = nn.ModuleDict({str(e): Mlp(cfg) for e in held})
        self.shared = Mlp(cfg, cfg.shared_ffn) if cfg.shared_ffn else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        weights, chosen = torch.softmax(self.router(tokens), dim=-1).topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        routed_in, routed_weights, routed_chosen = tokens, weights, chosen
        if self.expert_group is not None:
            # Tokens and their weights travel together: one collective each way, in the same order on every rank
            # whatever the autograd engine's order of independent nodes.
            width = tokens.shape[-1]
            routed = _GatherTokens.apply(torch.cat([tokens, weights], dim=-1), self.expert_group)
            routed_in, routed_weights = routed[:, :width], routed[:, width:]
            with torch.no_grad():
                routed_chosen = self.expert_group.gathered_indices(chosen)
        out = torch.zeros_like(routed_in)
        for name, expert in self.experts.items():
            rows, slots = (routed_chosen == int(name)).nonzero(as_tuple=True)
            if rows.numel():
                out = out.index_add(0, rows, expert(routed_in[rows]) * routed_weights[rows, slots].unsqueeze(-1))
        if self.expert_group is not None:
            out = _CombineTokens.apply(out, self.expert_group)
        if self.shared is not None:
            out = out + self.shared(tokens)
        return out.view_as(x)


class Block(nn.Module):
    """One pre-norm decoder layer."""

    def __init__(self, cfg: ModelConfig, context: ContextParallel | None = None, layer: int = 0,
                 expert_group: ExpertParallel | None = None):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden)
        self.attn = Attention(cfg, context)
        self.mlp_norm = RMSNorm(cfg.hidden)
        if cfg.routed(layer):
            self.mlp = Moe(cfg, expert_group)
        else:
            self.mlp = Mlp(cfg, cfg.dense_ffn if cfg.num_experts else None)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.attn_norm(h))
        return h + self.mlp(self.mlp_norm(h))


class Chunk(nn.Module):
    """A run of consecutive layers, with the embedding if it starts the model and norm + head if it ends it.

    Parameter names are global (`layers.5.wq.weight`), so a chunk's state is a slice of the whole model's.
    With `context`, the layers run on this rank's positions of each sequence; the embedding, the final norm
    and the head run on whole sequences on every context-parallel rank alike, so a chunk still takes and
    hands on whole sequences.
    """

    def __init__(self, cfg: ModelConfig, layers: Iterable[int], has_embed: bool, has_head: bool, seed: int,
                 context: ContextParallel | None = None, expert_group: ExpertParallel | None = None):
        super().__init__()
        if context is not None and cfg.seq_len % (2 * context.size):
            raise ValueError(f"context parallelism over {context.size} ranks splits each sequence into "
                             f"{2 * context.size} equal pieces; {cfg.seq_len} tokens do not split so (--seq)")
        self.context = context
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden) if has_embed else None
        self.layers = nn.ModuleDict({str(i): Block(cfg, context, i, expert_group) for i in layers})
        self.norm = RMSNorm(cfg.hidden) if has_head else None
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False) if has_head else None
        init_parameters(self, seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        if self.context is not None:
            h = _SplitSequence.apply(h, self.context)
        for block in self.layers.values():
            h = block(h)
        if self.context is not None:
            h = _GatherSequence.apply(h, self.context)
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
