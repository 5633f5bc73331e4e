"""POST /v1/compare and `resiplan compare` (issue 21): the stock Megatron layout a user picks by hand (TP 8 in a
node, PP as memory requires, micro-batch 1) against the best plan, on every sample scenario."""

from __future__ import annotations

import json

import pytest

from api.tasks.comparing import compare_for
from api.tasks.planning import estimate_for
from planner.errors import PlanningError
from tests.api.support import EXAMPLES_DIR, assert_detail, estimate_request
from tests.cli.test_cli import run_ok, write
from wire.comparison import CompareResponse
from wire.schemas import EstimateRequest

SCENARIOS = sorted(path.stem for path in EXAMPLES_DIR.glob("*.json"))


def _by_hand(name: str) -> dict:
    """The scenario with the layout a Megatron user would write: TP 8 in a node, the least PP that fits memory
    (an even split, as Megatron's default), micro-batch 1."""
    body = json.loads((EXAMPLES_DIR / f"{name}.json").read_text())
    body["options"] = {**body.get("options", {}), "time_limit_s": 3}
    for pp in range(1, 129):
        layout = {"tp": 8, "pp": pp, "micro_batch_size": 1}
        try:
            estimate_for(EstimateRequest.model_validate({**body, "layout": layout}))
        except PlanningError:
            continue
        return {**body, "layout": layout}
    raise AssertionError(f"{name}: no pipeline length fits")


@pytest.mark.parametrize("name", SCENARIOS)
def test_the_best_plan_is_never_slower_than_the_hand_written_layout(name):
    comparison = compare_for(EstimateRequest.model_validate(_by_hand(name)))
    yours_s, best_s = comparison.yours.predicted.iteration_time_s, comparison.best.predicted.iteration_time_s
    assert not comparison.planner_slower and best_s <= yours_s + 2e-6, (best_s, yours_s)
    assert comparison.speedup == pytest.approx(yours_s / best_s, rel=1e-5)
    assert comparison.yours.status == "fixed"
    gains = [c.gain for c in comparison.changes if c.gain is not None]
    assert gains == sorted(gains, reverse=True), "changes are ranked by what each buys"
    for change in comparison.changes:
        if change.iteration_time_s is not None:
            assert change.gain == pytest.approx(1 - change.iteration_time_s / yours_s, abs=1e-6)
        else:
            assert change.why
    if best_s < yours_s * 0.999:
        assert comparison.changes, "a faster plan differs from the user's layout somewhere"


def test_a_change_is_the_users_layout_with_that_field_alone(client):
    """The micro-batch change, estimated independently, is what compare reports for it."""
    body = estimate_request({"tp": 8, "pp": 1, "micro_batch_size": 1})
    comparison = compare_for(EstimateRequest.model_validate(body))
    best_mbs = comparison.best.micro_batch_size
    assert best_mbs != 1, "this case is chosen for a best plan with another micro-batch size"
    (change,) = [c for c in comparison.changes if c.change.startswith("micro_batch_size")]
    alone = estimate_for(EstimateRequest.model_validate(estimate_request({"tp": 8, "pp": 1, "micro_batch_size": best_mbs})))
    assert change.iteration_time_s == alone.predicted.iteration_time_s


def test_uneven_model_chunks_are_refused_as_outside_the_searched_space(client):
    """layers_per_chunk is estimated, not searched: compared, the best plan could be slower than the user's layout
    for want of looking, so compare refuses it (as it refuses shard groups and expert-TP it does not search)."""
    layout = {"tp": 1, "pp": 4, "virtual_stages": 2, "schedule": "interleaved", "recompute": "selective",
              "micro_batch_size": 1, "layers_per_chunk": [3, 4, 4, 5, 5, 4, 4, 3]}
    assert_detail(client.post("/v1/compare", json=estimate_request(layout)), "layers_per_chunk", "not searched",
                  "/v1/estimate")


def test_the_route(client):
    body = estimate_request({"tp": 8, "pp": 1, "micro_batch_size": 1})
    response = client.post("/v1/compare", json=body)
    assert response.status_code == 200, response.text
    comparison = CompareResponse.model_validate(response.json())
    assert comparison.best.predicted.iteration_time_s <= comparison.yours.predicted.iteration_time_s


def test_a_replica_by_replica_layout_is_refused(client):
    body = estimate_request({"replicas": [{"num_microbatches": 256, "stages": [{"devices": ["0:0"], "layers": [0, 32]}]}]})
    assert_detail(client.post("/v1/compare", json=body), "by shape")


def test_the_command_line(tmp_path, capsys):
    request = write(tmp_path, estimate_request({"tp": 8, "pp": 1, "micro_batch_size": 1}))
    out = run_ok(capsys, ["compare", "--request", request, "--format", "table"])
    assert "Each change alone" in out and "yours" in out and "best" in out


def test_an_import_body_is_imported_then_compared(client):
    """API.md: compare takes an import body too; what the import could not model comes with the answer."""
    command = ("torchrun --nnodes 4 --nproc-per-node 8 pretrain_gpt.py --tensor-model-parallel-size 8 "
               "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32 --swiglu "
               "--untie-embeddings-and-output-weights --normalization RMSNorm --position-embedding-type rope "
               "--disable-bias-linear --seq-length 4096 --micro-batch-size 1 --global-batch-size 256 --bf16")
    body = {"megatron_args": command, "cluster": {"num_nodes": 4, "gpus_per_node": 8, "gpu": "A100-80GB"}}
    response = client.post("/v1/compare", json=body)
    assert response.status_code == 200, response.text
    comparison = CompareResponse.model_validate(response.json())
    assert len(comparison.yours.replicas) == 4 and comparison.yours.replicas[0].stages[0].tp == 8
    assert comparison.best.predicted.iteration_time_s <= comparison.yours.predicted.iteration_time_s
    # Megatron does not overlap the gradient reduction unless told; the cost model assumes it does.
    assert any(entry.startswith("no --overlap-grad-reduce") for entry in comparison.not_modelled)


def test_the_compared_layouts_page_shows_the_comparison(client):
    """Both plans are stored; the user's layout's page shows the two side by side and the ranked changes, and
    links the best plan's page."""
    body = estimate_request({"tp": 8, "pp": 1, "micro_batch_size": 1})
    comparison = CompareResponse.model_validate(client.post("/v1/compare", json=body).json())
    stored = client.get(f"/v1/plans/{comparison.yours.plan_id}").json()
    assert stored["comparison"]["best_plan_id"] == comparison.best.plan_id
    assert client.get(f"/v1/plans/{comparison.best.plan_id}").status_code == 200
    page = client.get(f"/ui/plans/{comparison.yours.plan_id}")
    assert page.status_code == 200, page.text
    assert "Compared with the best plan" in page.text and f"/ui/plans/{comparison.best.plan_id}" in page.text
    assert "fullest stage GiB" in page.text
    for change in comparison.changes:
        assert change.change.replace("→", "&rarr;") in page.text or change.change in page.text
    best_page = client.get(f"/ui/plans/{comparison.best.plan_id}").text
    assert "Compared with the best plan" not in best_page


def test_an_expert_parallel_layout_keeps_its_ep_in_every_change_and_the_ep_change_is_priced_alone():
    """Mixtral-8x7B on 64 H100s written by hand as tp 2, pp 8, dp 4 without EP: the best plan splits the
    experts (ep > 1), compare offers that change alone, priced as the user's layout with only ep changed."""
    mixtral = {"cluster": {"num_nodes": 8, "gpus_per_node": 8, "gpu": "H100-SXM"}, "model": "mixtral-8x7b",
               "training": {"global_batch_size": 256, "seq_length": 4096}, "options": {"time_limit_s": 10}}
    layout = {"tp": 2, "pp": 8, "dp": 4, "micro_batch_size": 1, "recompute": "none"}
    comparison = compare_for(EstimateRequest.model_validate({**mixtral, "layout": layout}))
    assert comparison.best.ep > 1 and comparison.best.predicted.iteration_time_s < comparison.yours.predicted.iteration_time_s
    (change,) = [c for c in comparison.changes if c.change.startswith("ep ")]
    assert change.change == f"ep 1 → {comparison.best.ep}"
    alone = EstimateRequest.model_validate({**mixtral, "layout": {**layout, "ep": comparison.best.ep}})
    if change.iteration_time_s is None:  # ep must divide the user's dp; the reason is the estimate's
        with pytest.raises(PlanningError, match="ep"):
            estimate_for(alone)
    else:
        assert change.iteration_time_s == estimate_for(alone).predicted.iteration_time_s
    # an EP layout of the user's keeps its ep in the other changes (the TP change, here) instead of dropping it
    with_ep = compare_for(EstimateRequest.model_validate({**mixtral, "layout": {**layout, "ep": 4}}))
    assert with_ep.yours.ep == 4
    (tp_change,) = [c for c in with_ep.changes if c.change == "tp 2 → 1"]
    again = {key: value for key, value in {**layout, "tp": 1, "ep": 4}.items() if key != "dp"}
    assert tp_change.iteration_time_s == estimate_for(
        EstimateRequest.model_validate({**mixtral, "layout": again})).predicted.iteration_time_s


def test_an_expert_tp_change_moves_ep_and_etp_together():
    """GPT-OSS-120B on 64 H100s by hand as tp 2, pp 4, dp 8, ep 4 with its experts split over TP: the best plan
    keeps them whole (etp 1); compare offers ep and etp as one change (the EP group depends on both), priced as
    the user's layout with that change alone, or with the estimate's reason."""
    body = {"cluster": {"num_nodes": 8, "gpus_per_node": 8, "gpu": "H100-SXM"}, "model": "gpt-oss-120b",
            "training": {"global_batch_size": 256, "seq_length": 8192}, "options": {"time_limit_s": 10}}
    layout = {"tp": 2, "pp": 4, "dp": 8, "ep": 4, "micro_batch_size": 1, "recompute": "none"}
    comparison = compare_for(EstimateRequest.model_validate({**body, "layout": layout}))
    assert comparison.best.etp == 1 and comparison.yours.etp is None
    (change,) = [c for c in comparison.changes if "etp" in c.change]
    assert change.change == f"ep 4, etp = tp → ep {comparison.best.ep}, etp 1"
    alone = EstimateRequest.model_validate({**body, "layout": {**layout, "ep": comparison.best.ep, "etp": 1}})
    if change.iteration_time_s is None:
        with pytest.raises(PlanningError) as refused:
            estimate_for(alone)
        assert change.why == str(refused.value)
    else:
        assert change.iteration_time_s == estimate_for(alone).predicted.iteration_time_s


def test_an_expert_tp_the_planner_does_not_search_is_refused():
    body = estimate_request({"tp": 4, "pp": 2, "dp": 4, "ep": 4, "etp": 2, "recompute": "full"},
                            cluster={"num_nodes": 4, "gpus_per_node": 8, "gpu": "H100-SXM"}, model="qwen3-30b-a3b",
                            training={"global_batch_size": 64, "seq_length": 4096})
    with pytest.raises(PlanningError, match="etp 2 .* is estimated but not searched"):
        compare_for(EstimateRequest.model_validate(body))
