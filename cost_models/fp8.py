"""What FP8 training adds to and takes from a transformer layer, as Transformer Engine runs it.

Megatron-Core with `--fp8-format hybrid` (and torchtitan's float8 converter) runs the four projection
GEMMs of each layer (QKV, attention output, the two MLP GEMMs) in FP8: E4M3 weights and activations in
the forward, E5M2 gradients in the backward, scaled per tensor from an amax history (delayed scaling;
Micikevicius et al., "FP8 Formats for Deep Learning", 2022; Transformer Engine's `fp8_autocast`).
The attention core, norms, the embedding and the output head stay in BF16 (Megatron's output layer is
not a Transformer Engine module), so only the projections' GEMMs run at the FP8 peak.

Costs beyond the GEMMs, counted here:
- casts: every FP8 GEMM input is read in BF16 and written in FP8 together with its transpose (TE's
  `cast_transpose`: the transpose feeds the weight-gradient GEMM, which Hopper's FP8 tensor cores need
  in TN layout), 2 + 1 + 1 bytes per element; in the backward the same for each output gradient.
- weights: TE keeps each weight's FP8 copy and its transpose across the microbatches of an iteration
  (cast once, on the first microbatch): 2 bytes per layer parameter beside the BF16 weight.
- activations: the inputs the projections save for their backward are kept in FP8, 1 byte per element
  instead of 2 (the norm outputs before QKV and the first MLP GEMM, the attention output, the MLP
  activation's output).
"""

from __future__ import annotations

from cost_models.model_spec import ModelSpec

# A weight's FP8 copy and its transpose, kept for the iteration.
WEIGHT_CACHE_BYTES_PER_PARAM = 2.0
# cast_transpose: read BF16 (2), write FP8 (1) and its FP8 transpose (1).
CAST_BYTES_PER_ELEMENT = 4.0


def cast_elements_per_token(model: ModelSpec, tp: int, sequence_parallel: bool) -> tuple[float, float]:
    """(forward, backward) elements cast to FP8 per token on one GPU of a TP group.

    Forward: the four projection inputs (the two norm outputs are sequence-sharded under sequence
    parallelism, cast before TE's FP8 all-gather). Backward: the four projections' output gradients.
    """
    h = model.hidden_size
    sp = tp if sequence_parallel else 1
    fc1_out = (2 if model.swiglu else 1) * model.mlp_width_per_token
    forward = h / sp + model.attention_output_width / tp + h / sp + model.mlp_width_per_token / tp
    backward = (model.q_width + 2 * model.kv_width) / tp + h / sp + fc1_out / tp + h / sp
    return forward, backward


def saved_input_bytes_per_token(model: ModelSpec) -> tuple[float, float]:
    """Bytes per token (multiples of h) that FP8 saves on the stored projection inputs:
    (replicated unless sequence parallel: the two norm outputs; TP-sharded: attention output and the
    MLP activation's output), one byte per element each."""
    return 2.0, (model.attention_output_width + model.mlp_width_per_token) / model.hidden_size
