"""Context parallelism (CP): one sequence split over a CP group, attention exchanged around a ring.

What CP changes on one GPU of a stage (tp x cp GPUs; rank order tp fastest, then cp):

* Every token-linear term (projection GEMMs, elementwise traffic, TP collectives, stored activations,
  pipeline sends, the head's logits) sees seq / cp tokens.
* Causal attention is split load-balanced: the sequence is cut into 2 cp chunks and rank r keeps chunks
  r and 2 cp - 1 - r, so every rank computes 1 / cp of the causal attention FLOPs (Megatron-Core,
  docs/source/api-guide/context_parallel.rst, "load balancing"; Transformer Engine's
  `AttnFuncWithCPAndKVP2P`). CP needs the fused (flash) attention kernel: Megatron-Core runs it through
  Transformer Engine's DotProductAttention only, so the planner offers CP > 1 only with flash attention.
* Keys and values travel around the ring: in forward each rank receives the other cp - 1 ranks' K and V
  (2 x seq/cp x micro-batch x kv_width/tp elements each, bf16), one ring step per peer, each step
  overlapped with the attention of the block already there; in backward K, V and their gradients travel
  (twice the bytes). The all-gather flavour (Llama 3, section 3.3.2: "all-gather based CP"; torchtitan's
  default rotate method) moves the same bytes per rank. With the exchange overlapped, a layer's
  attention costs max(attention, exchange) per step: `exposed_exchange_ms` adds what the cp - 1
  overlapped steps cannot hide.
* Weights are whole on every CP rank, and their gradients are reduced over dp x cp ranks (Megatron's
  data-parallel-with-CP group), so ZeRO shards over dp x cp as well.

The ring crosses nodes when the tp x cp group does: then every step waits for the inter-node hop.
"""

from __future__ import annotations

from cost_models.comm import NETWORK_STEP_LATENCY_S, NVLINK_STEP_LATENCY_S
from cost_models.model_spec import ModelSpec

KV_BYTES_PER_ELEMENT = 2.0  # bf16 keys and values (Transformer Engine keeps them bf16 under FP8 too)
BACKWARD_EXCHANGE_FACTOR = 2.0  # K, V and dK, dV travel in backward


def load_balanced_chunks(seq_length: int, cp: int, tp: int = 1) -> bool:
    """Whether a sequence of `seq_length` tokens cuts into the 2 cp equal chunks load balancing needs,
    each also split over tp by sequence parallelism (torchtitan's `ParallelDims.seq_len_divisor`,
    tp x 2 cp; Megatron-LM asserts seq_length % 2 cp and splits each CP rank's tokens over tp)."""
    if cp == 1:
        return True
    return cp > 1 and seq_length % (2 * cp * tp) == 0


def kv_exchange_bytes(model: ModelSpec, seq_length: int, micro_batch: int, tp: int, cp: int) -> float:
    """Bytes one GPU receives in one layer's forward: the other cp - 1 ranks' K and V shards."""
    if cp <= 1:
        return 0.0
    local_tokens = seq_length * micro_batch / cp
    return (cp - 1) * 2.0 * local_tokens * model.kv_width / tp * KV_BYTES_PER_ELEMENT


def ring_link(tp: int, cp: int, gpus_per_node: int, intra_gb_s: float, inter_gb_s: float) -> tuple[float, float]:
    """(bandwidth GB/s, per-step latency s) of the CP ring: NVLink inside a node, else the network."""
    if tp * cp <= gpus_per_node:
        return intra_gb_s, NVLINK_STEP_LATENCY_S
    return inter_gb_s, NETWORK_STEP_LATENCY_S


def exchange_ms(bytes_moved: float, cp: int, bandwidth_gb_s: float, latency_s: float) -> float:
    """The whole ring exchange of `bytes_moved`, cp - 1 steps."""
    if cp <= 1 or bytes_moved <= 0:
        return 0.0
    return 1e3 * (bytes_moved / (bandwidth_gb_s * 1e9) + (cp - 1) * latency_s)


def exposed_exchange_ms(exchange_total_ms: float, attention_ms: float, cp: int) -> float:
    """What compute cannot hide: each of the cp - 1 transfers runs under one of cp attention blocks
    (the last block, computed after the last arrival, hides nothing)."""
    if cp <= 1:
        return 0.0
    return max(0.0, exchange_total_ms - attention_ms * (cp - 1) / cp)
