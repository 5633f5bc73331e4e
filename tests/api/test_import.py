"""POST /v1/import (issue 21): a Megatron-LM command line as an estimate request; pasted text is parsed, never
run."""

from __future__ import annotations

from tests.adapters.test_megatron_import import LLAMA3_8B_EXAMPLE
from tests.api.support import assert_detail, verify_plan

CLUSTER = {"num_nodes": 1, "gpus_per_node": 8, "gpu": "H200"}


def test_the_llama3_example_imports_and_estimates(client):
    response = client.post("/v1/import", json={"megatron_args": LLAMA3_8B_EXAMPLE, "cluster": CLUSTER})
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["request"]["layout"]["dp"] == 8 and answer["request"]["cluster"] == {**CLUSTER, "nvlink_topology": "switch"}
    assert answer["request"]["training"]["precision"] == "fp8"  # --fp8-format hybrid, priced
    assert any(entry.startswith("--fp8-param-gather") for entry in answer["not_modelled"])
    estimate = client.post("/v1/estimate", json=answer["request"])
    assert estimate.status_code == 200, estimate.text
    plan = verify_plan(estimate.json(), answer["request"])
    assert plan.status == "fixed" and len(plan.replicas) == 8 and plan.precision == "fp8"
    # The same job on GPUs without FP8 tensor cores is refused, saying why.
    a100 = {**answer["request"], "cluster": {**CLUSTER, "gpu": "A100-80GB"}}
    assert_detail(client.post("/v1/estimate", json=a100), "fp8 needs FP8 tensor cores")


def test_a_command_line_resiplan_cannot_take_is_a_422(client):
    args = ("pretrain_gpt.py --num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 128 --bf16 "
            "--vocab-size 1000")
    assert_detail(client.post("/v1/import", json={"megatron_args": args, "cluster": CLUSTER}), "--global-batch-size")
    # tp 16 on 8-GPU nodes: the command line parses, the request it describes does not hold.
    args = LLAMA3_8B_EXAMPLE.replace("--tensor-model-parallel-size 1", "--tensor-model-parallel-size 16")
    response = client.post("/v1/import", json={"megatron_args": args, "cluster": CLUSTER})
    assert response.status_code == 422, response.text


def test_shell_text_is_parsed_never_run(client, tmp_path):
    marker = tmp_path / "ran"
    args = (f"pretrain_gpt.py $(touch {marker}) `touch {marker}` --num-layers 32 --hidden-size 4096 "
            "--ffn-hidden-size 11008 --num-attention-heads 32 --swiglu --normalization RMSNorm "
            "--position-embedding-type rope --seq-length 4096 --global-batch-size 64 --bf16; "
            f"touch {marker}")
    response = client.post("/v1/import", json={"megatron_args": args, "cluster": CLUSTER})
    assert response.status_code == 200, response.text
    assert not marker.exists()
    assert any("not flags" in note for note in response.json()["notes"])


def test_unknown_body_forms_are_refused(client):
    body = {"nemo_config": {"trainer": {}}, "cluster": CLUSTER}
    assert client.post("/v1/import", json=body).status_code == 422


def test_a_deepspeed_config_beside_its_megatron_deepspeed_flags(client):
    config = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 8,
              "zero_optimization": {"stage": 1}, "bf16": {"enabled": True},
              "pipeline": {"activation_checkpoint_interval": 1}}
    args = ("deepspeed pretrain_gpt.py --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
            "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32 --swiglu "
            "--normalization rmsnorm --use-rotary-position-embeddings --no-position-embedding --seq-length 4096 "
            "--untie-embeddings-and-output-weights --disable-bias-linear")
    response = client.post("/v1/import", json={"deepspeed_config": config, "megatron_args": args, "cluster": CLUSTER})
    assert response.status_code == 200, response.text
    layout = response.json()["request"]["layout"]
    assert (layout["tp"], layout["pp"], layout["dp"], layout["micro_batch_size"], layout["recompute"]) == (
        2, 2, 4, 2, "full")


def test_torchtitan_overrides_import(client):
    body = {"overrides": ["--module", "llama3", "--config", "llama3_8b", "--parallelism.tensor_parallel_degree", "2",
                          "--parallelism.data_parallel_shard_degree", "4", "--training.local_batch_size", "2",
                          "--training.seq_len", "4096", "activation_checkpoint:selective"],
            "cluster": CLUSTER}
    response = client.post("/v1/import", json=body)
    assert response.status_code == 200, response.text
    request = response.json()["request"]
    assert request["model"] == "llama3.1-8b"
    assert (request["layout"]["tp"], request["layout"]["dp"], request["training"]["global_batch_size"]) == (2, 4, 8)


def test_one_trainers_settings_at_a_time(client):
    body = {"megatron_args": LLAMA3_8B_EXAMPLE, "overrides": ["--training.seq_len", "8"], "cluster": CLUSTER}
    assert_detail(client.post("/v1/import", json=body), "one trainer's settings")


def test_a_deepspeed_export_of_a_zero_3_plan_imports(client):
    """A ZeRO-2/3 export has no PipelineModule (`resiplan.pipeline_module` null): it imports as one stage, ZeRO-3,
    with the bf16 gradients DeepSpeed accumulates there (a 500 before: the null was read as a dict)."""
    from adapters.deepspeed import document
    from api.tasks.planning import estimate_for
    from tests.api.support import estimate_request
    from wire.schemas import EstimateRequest

    plan = estimate_for(EstimateRequest.model_validate(estimate_request(
        {"tp": 1, "pp": 1, "dp": 32}, training={"global_batch_size": 64, "seq_length": 4096, "zero_stage": 3})))
    response = client.post("/v1/import", json={"deepspeed_config": document(plan), "cluster": CLUSTER})
    assert response.status_code == 200, response.text
    request = response.json()["request"]
    assert (request["layout"]["pp"], request["layout"]["dp"]) == (1, 32)
    assert request["training"]["zero_stage"] == 3 and request["training"]["grad_precision"] == "bf16"


def test_a_hostile_resiplan_key_gets_a_422_naming_it(client):
    base = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True}}
    for resiplan, fragment in (({"model": None, "seq_length": 4096, "tensor_parallel": [2]}, "resiplan.tensor_parallel"),
                               ({"model": "llama", "seq_length": 4096}, "resiplan.model must be a JSON object"),
                               ({"pipeline_module": {"transformer_layers_per_stage": "8,8"}, "seq_length": 4096},
                                "transformer_layers_per_stage must list whole numbers")):
        response = client.post("/v1/import", json={"deepspeed_config": {**base, "resiplan": resiplan},
                                                   "cluster": CLUSTER})
        assert_detail(response, fragment)
