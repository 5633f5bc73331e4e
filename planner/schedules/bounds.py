"""Bounds on the makespan of any per-stage operation order of a pipeline.

`lower_bound_ms(spec)` is a makespan no schedule can beat (derivation in
its docstring); `sequential_ms(spec)` is one the optimum never exceeds.
"""

from __future__ import annotations

import math

from cost_models.choices import ScheduleName
from planner.schedules.ops import ChunkTimes, PipelineSpec

# Schedules whose backward passes are all whole B ops: `lower_bound_ms(split_backward=False)` holds for them.
FULL_BACKWARD = frozenset({ScheduleName.GPIPE, ScheduleName.ONE_F_ONE_B, ScheduleName.INTERLEAVED, ScheduleName.LOOPED_BFS})


def full_backward_only(allowed: frozenset[str] | None) -> bool:
    """Whether every schedule in `allowed` (None: every schedule, split backward and CP-SAT's included)
    runs whole backward ops, so that the tighter full-backward bounds hold."""
    return allowed is not None and allowed <= FULL_BACKWARD


def _virtual_times(spec: PipelineSpec) -> list[ChunkTimes]:
    return [spec.chunks[s][c] for s, c in (spec.physical(u) for u in range(spec.num_stages * spec.virtual_stages))]


def lower_bound_ms(spec: PipelineSpec, *, split_backward: bool = True) -> float:
    """A makespan no schedule of `spec` can beat.

    Notation: m microbatches, V = p v virtual stages with times f(u), i(u),
    w(u), b(u) = i(u) + w(u); L the p2p latency (0 when p = 1; consecutive
    virtual stages are always on different physical stages otherwise).
    On stage s, F_s, I_s, W_s, B_s are m times the sum over its chunks.
    All microbatches have the same times, so every dependency chain below
    has the same length whichever microbatch it belongs to.

    * head_s = sum_{u<s} (f(u) + L): every op of stage s waits for a
      forward F(mb, cp+s), which waits for the forward chain through
      virtual stages 0..cp+s-1; that chain contains 0..s-1.
    * A_s, the earliest any backward (I or B) of stage s can start: it
      needs I(mb, V-1), after the whole forward chain, then the backward
      chain from V-1 down to its own virtual stage; the shortest is that of
      the last chunk vs = (v-1)p + s:
      A_s = sum_u f(u) + (V-1) L + sum_{u=vs+1}^{V-1} (i(u) + L).
    * D_s, what must still run after the last I of stage s ends (at e):
      for that I(mb, cp+s), its own W(mb, cp+s) and the chain
      I(mb, cp+s-1) .. I(mb, 0) then W(mb, 0), each cross-stage step + L.
      D_s = min over c of max(w(cp+s), sum_{u<cp+s} (L + i(u)) + w(0)).

    Split backward (I/W). All F and I of stage s lie in [head_s, e] (every
    F precedes its I); no W starts before the first I, which starts at
    a >= A_s; during [head_s, a] stage s can only run forwards. If x is the
    W work stage s does before e, e >= max(a, head_s + F_s) + I_s + x, and
    after e it still owes max(D_s, W_s - x), so the makespan
    T >= max(A_s, head_s + F_s) + I_s + max(W_s, D_s).

    This bound holds for every schedule, B, I/W or mixed: replacing a B by
    I immediately followed by W at the same place in the order makes no op
    later (the gradient is released earlier, the W ends when the B did),
    so the best split schedule is never worse than the best B schedule.

    Full backward only (`split_backward=False`, valid only for schedules
    whose backwards are all B): the last op of stage s is a B (an F's B
    follows it on the stage), ending at e >= max(A_s, head_s + F_s) + B_s
    (A_s with b for i); the chain B(mb, s-1) .. B(mb, 0) still follows, so
    T >= max(A_s, head_s + F_s) + B_s + sum_{u<s} (L + b(u)).

    Memory (one chunk per stage, a cap of k microbatches on stage s,
    k = floor(limit / activation)): let t_j be the j-th earliest forward
    start on s and r_j the j-th earliest release end (B, or W when split).
    When the j-th forward starts, j + 1 have started and at most k are
    alive, so r_{j-k} <= t_j. Every microbatch's release ends at least R_s
    after its forward starts, R_s = f(s) + sum_{u>s} (f(u) + i(u) + 2L)
    + i(s) + w(s) (the round trip; b for i and no w when full), so
    r_j >= t_j + R_s (sorted matching). Hence t_j >= t_{j-k} + R_s and
    T >= head_s + ((m-1) mod k) f(s) + (floor((m-1)/k) + 1) R_s + drain,
    drain = sum_{u<s} (L + b(u)) when full (the last release is a B whose
    chain follows), 0 when split. The split round trip is the shorter, so
    this too holds for every schedule. A cap below one microbatch: inf.

    The result is the maximum over stages.
    """
    p, v, m = spec.num_stages, spec.virtual_stages, spec.num_microbatches
    V, L = p * v, spec.hop_latency_ms
    times = _virtual_times(spec)
    f = [t.forward_ms for t in times]
    back = [t.input_grad_ms if split_backward else t.backward_ms for t in times]
    w = [t.weight_grad_ms if split_backward else 0.0 for t in times]
    forward_chain = sum(f) + (V - 1) * L
    best = 0.0
    for s in range(p):
        head = sum(f[:s]) + s * L
        forward_work = m * sum(f[c * p + s] for c in range(v))
        back_work = m * sum(back[c * p + s] for c in range(v))
        weight_work = m * sum(w[c * p + s] for c in range(v))
        last = (v - 1) * p + s
        first_backward = forward_chain + sum(back[u] + L for u in range(last + 1, V))
        drains = []
        for c in range(v):
            vs = c * p + s
            chain = sum(L + back[u] for u in range(vs)) + w[0]
            drains.append(max(w[vs], chain) if split_backward else chain)
        drain = min(drains)
        after = max(weight_work, drain) if split_backward else drain
        best = max(best, max(first_backward, head + forward_work) + back_work + after)
        if spec.activation_limit_gib is not None and v == 1 and spec.chunks[s][0].activation_gib > 0:
            k = math.floor(spec.activation_limit_gib[s] / spec.chunks[s][0].activation_gib + 1e-9)
            if k < 1:
                return math.inf
            round_trip = f[s] + sum(f[u] + back[u] + 2 * L for u in range(s + 1, p)) + back[s] + w[s]
            drain = 0.0 if split_backward else sum(L + back[u] for u in range(s))
            best = max(best, head + ((m - 1) % k) * f[s] + ((m - 1) // k + 1) * round_trip + drain)
    return best


def sequential_ms(spec: PipelineSpec) -> float:
    """Makespan of running the microbatches one after another: an upper bound on the optimum.

    It also has the least activation memory any schedule can have (all of a
    microbatch's chunks are alive together in every schedule), so it is
    feasible whenever anything is.
    """
    times = _virtual_times(spec)
    V = len(times)
    round_trip = sum(t.forward_ms + t.backward_ms for t in times) + 2 * (V - 1) * spec.hop_latency_ms
    return spec.num_microbatches * round_trip


__all__ = ["FULL_BACKWARD", "full_backward_only", "lower_bound_ms", "sequential_ms"]
