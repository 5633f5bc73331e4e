"""Memory per GPU: model state (weights, gradients, optimizer) and activations.

Activation bytes follow Korthikanti et al. 2022 ("Reducing Activation
Recomputation"), generalized from ffn = 4h, MHA, GELU to any FFN width, GQA
and SwiGLU by counting the same stored tensors.
"""

from __future__ import annotations

from collections.abc import Iterable

from cost_models.choices import Recompute, ScheduleName
from cost_models.efficiency import SoftwareConfig
from cost_models.fp8 import saved_input_bytes_per_token
from cost_models.model_spec import ModelSpec
from cost_models.pipeline import interleaved_group_sizes

# bf16/fp16 weights (2) + fp32 gradients (4) + fp32 master weights, Adam m, v (12).
WEIGHT_BYTES_PER_PARAM = 2.0
GRAD_BYTES_PER_PARAM = 4.0
OPTIMIZER_BYTES_PER_PARAM = 12.0
# Without master weights (the model trains in bf16): Adam's m and v in bf16.
BF16_OPTIMIZER_BYTES_PER_PARAM = 4.0

# Memory per GPU a plan leaves free for what this model does not count, unless the request says
# otherwise (`options.memory_reserve_gib`). Measured pieces: the CUDA context PyTorch creates takes
# ~0.7 GiB (discuss.pytorch.org/t/high-gpu-memory-overhead/81330), and each NCCL communicator ~0.5-0.7
# GiB of buffers on A100 NVLink without NVLink SHARP (544 MB for 2 ranks, 688 MB for more:
# github.com/NVIDIA/nccl/issues/964). A Megatron-style GPU talks in at least three (tensor-parallel,
# data-parallel, pipeline neighbours): 0.7 + 3 x 0.65 ~ 2.7 GiB, rounded up for cuBLAS workspaces and
# the embedding group. NVLink SHARP (NCCL's default on H100 NVSwitch systems) costs ~1.6 GB per
# communicator (github.com/NVIDIA/nccl/issues/864); NVIDIA's NeMo launcher turns it off for memory
# (NeMo-Framework-Launcher#127): jobs that keep it on should raise the reserve to ~5 GiB.
DEFAULT_MEMORY_RESERVE_GIB = 3.0
# PyTorch's caching allocator fragments memory that is freed and reallocated
# every microbatch (activations); a plan at 99% of HBM by the books OOMs.
ACTIVATION_FRAGMENTATION = 0.10


def optimizer_bytes_per_param(master_weights: bool) -> float:
    """The optimizer's state per parameter: fp32 master weights and Adam moments (12), or, where the model
    trains in bf16 without a master copy (`SoftwareConfig.master_weights` False), bf16 moments (4)."""
    return OPTIMIZER_BYTES_PER_PARAM if master_weights else BF16_OPTIMIZER_BYTES_PER_PARAM


def state_bytes_per_param(zero_stage: int, data_parallel: int, grad_bytes: float = GRAD_BYTES_PER_PARAM,
                          optimizer_bytes: float = OPTIMIZER_BYTES_PER_PARAM) -> float:
    """Weights, gradients and optimizer state per parameter on one GPU: 18 bytes, with ZeRO stage 1, 2, 3
    the optimizer state, then the gradients, then the weights sharded over d replicas (the table in
    `cost_models.sharded_dp`). `grad_bytes`: the gradient buffer's element size, 4 (fp32, Megatron-LM's
    default) or 2 (bf16 gradients: `--grad-reduce-in-bf16`, 16 bytes in all). `optimizer_bytes`:
    `optimizer_bytes_per_param` (8 bytes in all for a model trained in bf16 without master weights)."""
    d = max(1, data_parallel)
    weights = WEIGHT_BYTES_PER_PARAM / d if zero_stage >= 3 else WEIGHT_BYTES_PER_PARAM
    grads = grad_bytes / d if zero_stage >= 2 else grad_bytes
    optimizer = optimizer_bytes / d if zero_stage >= 1 else optimizer_bytes
    return weights + grads + optimizer


def _layer_activation_terms(model: ModelSpec, software: SoftwareConfig) -> tuple[float, float, float]:
    """Stored bytes per layer per token, as multiples of h: (replicated, tp_sharded, score_per_s).

    Replicated (unless sequence parallel): the two norm inputs (4), QKV and
    first MLP inputs (2 + 2), dropout masks (1 each). TP-sharded: Q, K, V, the
    output-projection input, the activation-function input(s) and the second
    MLP input. score_per_s: softmax output, its dropout mask and output
    (5 a s / h per token, with flash attention none of it is stored).
    """
    h = model.hidden_size
    masks = 2.0 if software.dropout else 0.0
    replicated = 4.0 + 2.0 + 2.0 + masks
    qkv = 2.0 * model.q_width / h + 2.0 * 2.0 * model.kv_width / h
    out_proj_input = 2.0 * model.attention_output_width / h
    if model.is_mla:  # the latents (whole on every TP rank): their norm's input and their up projection's
        replicated += 2.0 * 2.0 * (model.q_lora_rank + model.kv_lora_rank + model.qk_rope_head_dim) / h
    ffn_ratio = model.mlp_width_per_token / h
    activation_inputs = (2.0 * 2.0 if model.swiglu else 2.0) * ffn_ratio
    fc2_input = 2.0 * ffn_ratio
    sharded = qkv + out_proj_input + activation_inputs + fc2_input
    # A mixture of experts keeps each token's routed copies as its experts' first input and their outputs
    # for the weighted combine's backward (2 bytes x h each, per routed expert).
    replicated += 2.0 * 2.0 * model.experts_per_token * model.expert_layers / model.num_layers
    if software.fp8:
        replicated_saved, sharded_saved = saved_input_bytes_per_token(model)
        replicated -= replicated_saved
        sharded -= sharded_saved
    score_per_s = 0.0 if software.flash_attention else (2.0 + (3.0 if software.dropout else 0.0))
    return replicated, sharded, score_per_s


def layer_activation_bytes(
    model: ModelSpec,
    seq_length: int,
    micro_batch: int,
    tp: int,
    recompute: str,
    software: SoftwareConfig,
    cp: int = 1,
) -> float:
    """Activation bytes one layer keeps per in-flight microbatch on one GPU of a TP group.

    For GPT-3 shapes this is sbh (10 + 24/t + 5 a s/(h t)) without sequence
    parallelism, sbh/t (34 + 5 a s/h) with it, 34 sbh/t with selective
    recompute, and 2 sbh/t with full recompute. Context parallelism divides
    all of it by cp: each rank stores its s/cp tokens (and s/cp rows of scores).
    """
    sbh = float(seq_length * micro_batch * model.hidden_size) / cp
    sp_divisor = tp if software.sequence_parallel else 1
    if recompute == Recompute.FULL:
        return 2.0 * sbh / sp_divisor
    replicated, sharded, score_per_s = _layer_activation_terms(model, software)
    linear = sbh * (replicated / sp_divisor + sharded / tp)
    if recompute == Recompute.SELECTIVE:
        return linear
    heads = model.num_attention_heads
    scores = score_per_s * heads * seq_length * seq_length * micro_batch / (tp * cp)
    return linear + scores


def head_activation_bytes(model: ModelSpec, seq_length: int, micro_batch: int, tp: int) -> float:
    """Logits kept on the last stage for the loss: fp32, vocabulary split over TP, one microbatch."""
    return 4.0 * seq_length * micro_batch * model.vocab_size / tp


def embedding_activation_bytes(model: ModelSpec, seq_length: int, micro_batch: int, tp: int, sp: bool) -> float:
    """Embedding output kept on the first stage per in-flight microbatch."""
    return 2.0 * seq_length * micro_batch * model.hidden_size / (tp if sp else 1)


def in_flight_microbatches(schedule: str, stage: int, stages: int, microbatches: int, virtual_stages: int) -> float:
    """Microbatches whose activations a stage holds at its peak, in units of its full layer set.

    1F1B: stage i holds p - i. Interleaved 1F1B (v chunks): rank r warms up
    2 (p - r - 1) + (v - 1) g chunks and holds one more, each chunk 1/v of its
    layers, where g is the first microbatch group (p when m % p == 0, so the
    first stage holds p (1 + (p - 1)/(p v)) layer sets, Korthikanti's factor;
    up to 2p - 1 for other m). GPipe and looped BFS hold all m.
    """
    return in_flight_row(schedule, stages, microbatches, virtual_stages, (stage,))[0]


def in_flight_row(
    schedule: str, stages: int, microbatches: int, virtual_stages: int, positions: Iterable[int] | None = None
) -> list[float]:
    """`in_flight_microbatches` of each stage in `positions` (default: every stage); a whole row
    finds the interleaved first group once."""
    positions = range(stages) if positions is None else positions
    if schedule in (ScheduleName.GPIPE, ScheduleName.LOOPED_BFS):  # every forward before the first backward
        return [float(microbatches) for _ in positions]
    if schedule == ScheduleName.INTERLEAVED and virtual_stages > 1:
        first_group = interleaved_group_sizes(microbatches, stages)[0]
        most = microbatches * virtual_stages
        warm_up = (virtual_stages - 1) * first_group + 1
        return [min(2 * (stages - stage - 1) + warm_up, most) / virtual_stages for stage in positions]
    return [float(min(stages - stage, microbatches)) for stage in positions]
