"""What each GPU holds of a mixture of experts, for migration: the replicated weights whole (over TP),
its EP block of the routed experts, and its share of the optimizer state among the replicas holding the
same weights. Expected figures come from Mixtral-8x7B's published shape, not from the code under test."""

from __future__ import annotations

import pytest

from api.tasks.planning import estimate_for
from cost_models.migration import OPTIMIZER_BYTES_PER_PARAM, WEIGHT_BYTES_PER_PARAM, ShardBlock, unit_params
from planner.replan.holdings import device_holdings, placed_layout
from wire.convert import resolve_model
from wire.schemas import EstimateRequest

MIXTRAL = {"name": "mixtral-8x7b", "num_layers": 32, "hidden_size": 4096, "ffn_hidden_size": 14336,
           "num_attention_heads": 32, "num_kv_heads": 8, "vocab_size": 32000, "num_experts": 8,
           "experts_per_token": 2, "rope_theta": 1e6}
ONE_EXPERT = 3 * 4096 * 14336
REPLICATED = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 4096 * 8 + 2 * 4096  # attention, router, norms
TOTAL = 32 * (REPLICATED + 8 * ONE_EXPERT) + 2 * 32000 * 4096  # layers, embedding, head (units leave out the final norm)


def _plan(ep: int, etp: int | None = None, cp: int = 1):
    layout = {"tp": 2, "cp": cp, "pp": 4, "dp": 8 // cp, "ep": ep, "recompute": "full"} | ({"etp": etp} if etp else {})
    request = EstimateRequest.model_validate({
        "cluster": {"num_nodes": 8, "gpus_per_node": 8, "gpu": "H100-SXM"}, "model": MIXTRAL,
        "training": {"global_batch_size": 256, "seq_length": 4096}, "layout": layout})
    return estimate_for(request), request


def _bytes(blocks: tuple[ShardBlock, ...], units, weights: bool) -> float:
    return sum(units.params(b.first_unit, b.end_unit)
               * ((b.weight_hi - b.weight_lo) * WEIGHT_BYTES_PER_PARAM if weights
                  else (b.optimizer_hi - b.optimizer_lo) * OPTIMIZER_BYTES_PER_PARAM) for b in blocks)


@pytest.mark.parametrize(("ep", "etp", "cp"), [(1, None, 1), (2, None, 1), (8, None, 1), (2, 1, 1), (4, 1, 1),
                                              (8, 1, 1), (2, None, 2), (4, None, 2), (8, 1, 2), (2, 1, 2)])
def test_every_gpu_holds_its_experts_and_the_job_holds_one_optimizer_copy(ep, etp, cp):
    """With etp 1 a GPU holds 8 / ep whole experts (ep over both TP ranks of ep / 2 replicas); with cp 2 the EP
    group takes a replica's two CP ranks first. Either way a stage's 16 GPUs hold 16 / (ep x etp) copies."""
    plan, request = _plan(ep, etp, cp)
    units = unit_params(resolve_model(request.model))
    holdings = device_holdings(placed_layout(plan))
    assert TOTAL == pytest.approx(units.params(0, 34), rel=1e-9)
    # weights: a middle stage's GPU holds 8 layers of the replicated part (halved by TP) and 8 / ep experts,
    # each halved by expert-TP 2 or whole
    expert_tp = etp or 2
    for device in plan.replicas[-1].stages[1].devices:
        assert _bytes(holdings[device], units, True) == pytest.approx(
            8 * (REPLICATED / 2 + 8 / ep * ONE_EXPERT / expert_tp) * WEIGHT_BYTES_PER_PARAM)
    # across the job: 8 replicas of the replicated part, 16 GPUs a stage holding 8 / (ep x etp) of the experts
    # (16 / (ep x etp) copies), one optimizer state
    weights = sum(_bytes(h, units, True) for h in holdings.values())
    dense_total = TOTAL - 32 * 8 * ONE_EXPERT
    assert weights == pytest.approx((8 * dense_total + 16 / (ep * expert_tp) * 32 * 8 * ONE_EXPERT)
                                    * WEIGHT_BYTES_PER_PARAM)
    optimizer = sum(_bytes(h, units, False) for h in holdings.values())
    assert optimizer == pytest.approx(TOTAL * OPTIMIZER_BYTES_PER_PARAM)
    # every expert byte of a layer is held somewhere: the stage's GPUs' expert ranges cover [1 - e, 1) as many
    # times as there are copies, no more in one place than another
    share = 8 * ONE_EXPERT / (REPLICATED + 8 * ONE_EXPERT)
    cover: dict[tuple[float, float], int] = {}
    for device in (d for r in plan.replicas for d in r.stages[1].devices):
        for block in holdings[device]:
            if block.first_unit <= 10 < block.end_unit and block.weight_lo >= 1 - share - 1e-9:
                key = (round(block.weight_lo, 9), round(block.weight_hi, 9))
                cover[key] = cover.get(key, 0) + 1
    assert set(cover.values()) == {16 // (ep * expert_tp)}
    assert sum(hi - lo for lo, hi in cover) == pytest.approx(share)


def test_splitting_the_experts_receives_no_weights():
    """From EP 1 to EP 8 on the same GPUs each keeps one of the eight experts it already holds: no weight
    moves, and at most that expert's optimizer state (now shared by fewer replicas) does."""
    whole, request = _plan(1)
    split, _ = _plan(8)
    units = unit_params(resolve_model(request.model))
    before, after = device_holdings(placed_layout(whole)), device_holdings(placed_layout(split))
    assert before.keys() == after.keys()
    from cost_models.migration import common_bytes, holding_bytes

    for device in after:
        received = holding_bytes(after[device], units) - common_bytes(after[device], before[device], units)
        weights_received = _bytes(after[device], units, True) - sum(
            units.params(max(a.first_unit, b.first_unit), min(a.end_unit, b.end_unit))
            * max(0.0, min(a.weight_hi, b.weight_hi) - max(a.weight_lo, b.weight_lo)) * WEIGHT_BYTES_PER_PARAM
            for a in after[device] for b in before[device])
        assert weights_received == pytest.approx(0.0, abs=1.0)
        assert received <= 8 * ONE_EXPERT / 2 * OPTIMIZER_BYTES_PER_PARAM + 1.0
