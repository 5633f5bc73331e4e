"""training.tp_comm_overlap: how the trainer overlaps TP collectives with their GEMMs, priced, echoed and read back.

Megatron's --tp-comm-overlap hides the forward's and the backward's collectives; PyTorch's asynchronous TP the
forward's only (`cost_models.compute.layer_time`). With one pipeline stage and no recompute the two passes move
the same bytes under GEMMs of the same size, so asynchronous TP saves exactly half of what Megatron's saves.
"""

from __future__ import annotations

import pytest

from adapters.megatron_import import import_megatron
from adapters.torchtitan import override_argv
from adapters.torchtitan_import import import_torchtitan
from api.tasks.planning import estimate_for, plan_for
from tests.api.support import estimate_request, small_request
from wire.schemas import EstimateRequest, PlanRequest

H100 = {"num_nodes": 1, "gpus_per_node": 8, "gpu": "H100-SXM"}


def _estimate(overlap: str | None, tp: int = 8, recompute: str = "none", pp: int = 1):
    training = {"global_batch_size": 16, "seq_length": 8192}
    if overlap is not None:
        training["tp_comm_overlap"] = overlap
    body = estimate_request({"tp": tp, "pp": pp, "recompute": recompute, "micro_batch_size": 1}, cluster=H100,
                            model="llama3-8b", training=training)
    return estimate_for(EstimateRequest.model_validate(body))


def test_none_is_the_default_and_every_plan_says_which_it_priced():
    default, named = _estimate(None), _estimate("none")
    assert default.tp_comm_overlap == named.tp_comm_overlap == "none"
    assert default.predicted.iteration_time_s == named.predicted.iteration_time_s
    for overlap in ("megatron", "async_tp"):
        assert _estimate(overlap).tp_comm_overlap == overlap


def test_asynchronous_tp_saves_half_of_what_megatrons_overlap_saves():
    exposed = {name: _estimate(name).predicted.breakdown.tp_comm_s for name in ("none", "async_tp", "megatron")}
    assert exposed["none"] > exposed["async_tp"] > exposed["megatron"] > 0
    megatron_saves = exposed["none"] - exposed["megatron"]
    assert exposed["none"] - exposed["async_tp"] == pytest.approx(megatron_saves / 2, rel=1e-4)
    times = {name: _estimate(name).predicted.iteration_time_s for name in ("none", "async_tp", "megatron")}
    assert times["none"] > times["async_tp"] > times["megatron"]


def test_a_full_recompute_keeps_asynchronous_tp_to_one_of_three_passes():
    """Full recompute runs the forward again inside the backward; asynchronous TP hides only the first forward's
    collectives, one of three passes of equal traffic, where Megatron's hides all three."""
    exposed = {name: _estimate(name, recompute="full").predicted.breakdown.tp_comm_s
               for name in ("none", "async_tp", "megatron")}
    megatron_saves = exposed["none"] - exposed["megatron"]
    assert exposed["none"] - exposed["async_tp"] == pytest.approx(megatron_saves / 3, rel=1e-4)


def test_without_tensor_parallelism_there_is_nothing_to_overlap():
    times = {_estimate(name, tp=1, recompute="full").predicted.iteration_time_s
             for name in ("none", "async_tp", "megatron")}
    assert len(times) == 1


def test_the_search_prices_it_too():
    """A plan search, not only an estimate, prices the overlap: the same request plans no slower with it."""
    def planned(overlap: str):
        body = small_request(cluster={"num_nodes": 2, "gpus_per_node": 8, "gpu": "H100-SXM"}, model="llama3-70b",
                             training={"global_batch_size": 64, "seq_length": 4096, "tp_comm_overlap": overlap},
                             options={"time_limit_s": 5, "allow_non_uniform": False})
        return plan_for(PlanRequest.model_validate(body))

    plain, overlapped = planned("none"), planned("megatron")
    assert overlapped.tp_comm_overlap == "megatron"
    assert overlapped.predicted.iteration_time_s < plain.predicted.iteration_time_s


def test_unknown_overlap_is_a_422(client):
    body = estimate_request({"tp": 2, "pp": 1}, training={"global_batch_size": 16, "seq_length": 2048,
                                                          "tp_comm_overlap": "userbuffers"})
    response = client.post("/v1/estimate", json=body)
    assert response.status_code == 422
    assert "tp_comm_overlap" in response.text


def test_megatron_command_line_reads_back_as_megatron_overlap():
    words = ("torchrun --nproc-per-node 8 pretrain_gpt.py --tensor-model-parallel-size 4 --sequence-parallel "
             "--tp-comm-overlap --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 "
             "--num-attention-heads 32 --group-query-attention --num-query-groups 8 --swiglu --seq-length 8192 "
             "--max-position-embeddings 8192 --micro-batch-size 1 --global-batch-size 16 --bf16 "
             "--position-embedding-type rope --normalization RMSNorm --disable-bias-linear "
             "--untie-embeddings-and-output-weights --vocab-size 128256 --use-distributed-optimizer "
             "--overlap-grad-reduce --overlap-param-gather")
    imported = import_megatron(words)
    assert imported.request["training"]["tp_comm_overlap"] == "megatron"
    assert not [entry for entry in imported.not_modelled if "--tp-comm-overlap" in entry]
    without = import_megatron(words.replace(" --tp-comm-overlap", ""))
    assert "tp_comm_overlap" not in without.request["training"]


@pytest.mark.parametrize("words,expected", [
    ("--parallelism.tensor_parallel_degree 2 --compile.enable --compile.enable_async_tensor_parallel", "async_tp"),
    ("--parallelism.tensor_parallel_degree 2 --parallelism.enable_async_tensor_parallel", "async_tp"),
    ("--parallelism.tensor_parallel_degree 2 --compile.enable_async_tensor_parallel false", None),
    ("--parallelism.tensor_parallel_degree 1 --compile.enable --compile.enable_async_tensor_parallel", None),
    ("--parallelism.tensor_parallel_degree 2", None),
])
def test_torchtitan_overrides_read_back_as_asynchronous_tp(words, expected):
    text = f"{words} --training.seq_len 8192 --training.global_batch_size 16 --training.local_batch_size 2"
    imported = import_torchtitan(text, model="llama3-8b")
    assert imported.request["training"].get("tp_comm_overlap") == expected
    assert not [entry for entry in imported.not_modelled if "async_tensor_parallel" in entry]


def test_an_older_torchtitan_job_file_reads_back_as_asynchronous_tp():
    toml = "[parallelism]\ntensor_parallel_degree = 4\n[experimental]\nenable_async_tensor_parallel = true\n"
    imported = import_torchtitan("--training.seq_len 8192 --training.global_batch_size 16", toml=toml,
                                 model="llama3-8b")
    assert imported.request["training"]["tp_comm_overlap"] == "async_tp"


def test_a_torchtitan_switch_that_is_not_a_boolean_is_named():
    with pytest.raises(Exception, match="--compile.enable_async_tensor_parallel 'sometimes'"):
        import_torchtitan("--parallelism.tensor_parallel_degree 2 --compile.enable_async_tensor_parallel sometimes "
                          "--training.seq_len 8192 --training.global_batch_size 16", model="llama3-8b")


def test_the_torchtitan_export_reads_back_to_the_same_overlap():
    plan = estimate_for(EstimateRequest.model_validate(estimate_request(
        {"tp": 2, "pp": 2}, cluster={"num_nodes": 2, "gpus_per_node": 8, "gpu": "H100-SXM"}, model="llama3-8b",
        training={"global_batch_size": 32, "seq_length": 8192, "tp_comm_overlap": "async_tp"})))
    imported = import_torchtitan(" ".join(override_argv(plan)), model="llama3-8b")
    assert imported.request["training"]["tp_comm_overlap"] == "async_tp"
