"""/v1/import and /v1/compare on trainer settings no trainer would run: each was a 500 (a division by zero, an
index into an empty list, unbounded recursion, a method called on a string) and is now a 422 naming the setting."""

from __future__ import annotations

import pytest

from tests.api.support import assert_detail

CLUSTER = {"num_nodes": 2, "gpus_per_node": 8, "gpu": "H100-SXM"}
MODEL = ("--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --seq-length 4096 --global-batch-size 16 "
         "--bf16 --vocab-size 32000")
TORCHRUN = "torchrun --nproc-per-node 8 pretrain_gpt.py "
TITAN = '[model]\nname="llama3"\nflavor="8B"\n[training]\nseq_len=4096\nglobal_batch_size=16\n'


@pytest.mark.parametrize(("args", "named"), [
    ("--num-layers 2 --hidden-size 64 --num-attention-heads 0", "--num-attention-heads 0 must be at least 1"),
    (MODEL + " --num-layers-per-virtual-pipeline-stage 0", "--num-layers-per-virtual-pipeline-stage 0 must be at least 1"),
    (MODEL + " --pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 16",
     "32 layers do not split into pp 4 x chunks of 16"),
    (TORCHRUN + MODEL + " --tensor-model-parallel-size 0", "--tensor-model-parallel-size 0 must be at least 1"),
    (TORCHRUN + MODEL + " --context-parallel-size 0", "--context-parallel-size 0 must be at least 1"),
    (MODEL + " --pipeline-model-parallel-size 0 --pipeline-model-parallel-layout t*32",
     "--pipeline-model-parallel-size 0 must be at least 1"),
    (MODEL + " --num-virtual-stages-per-pipeline-rank 0 --account-for-loss-in-pipeline-split",
     "--num-virtual-stages-per-pipeline-rank 0 must be at least 1"),
    (MODEL + " --micro-batch-size -2", "--micro-batch-size -2 must be at least 1"),
    (MODEL + " --mtp-num-layers -1", "--mtp-num-layers -1 must be at least 0"),
])
@pytest.mark.parametrize("route", ["/v1/import", "/v1/compare"])
def test_megatron_counts_below_one_are_named(client, route, args, named):
    assert_detail(client.post(route, json={"cluster": CLUSTER, "megatron_args": args}), named)


@pytest.mark.parametrize(("toml", "named"), [
    (TITAN + "[parallelism]\npipeline_parallel_degree=0\n", "--parallelism.pipeline_parallel_degree 0 must be at least 1"),
    (TITAN + "[parallelism]\npipeline_parallel_degree=-1\n", "--parallelism.pipeline_parallel_degree -1"),
    (TITAN + "[parallelism]\ndata_parallel_shard_degree=-3\n", "(or -1: the ranks left over)"),
    ("a=" + "[" * 500 + "]" * 500, "nests arrays or tables too deeply"),
])
def test_torchtitan_job_files_that_cannot_run_are_named(client, toml, named):
    assert_detail(client.post("/v1/import", json={"cluster": CLUSTER, "torchtitan_toml": toml}), named)


@pytest.mark.parametrize("degree", ["tensor_parallel_degree", "data_parallel_replicate_degree"])
def test_torchtitan_degrees_of_zero_under_torchrun_are_named(client, degree):
    overrides = ["torchrun", "--nproc-per-node", "8", "-m", "torchtitan.train", "--model.name", "llama3",
                 "--model.flavor", "8B", "--training.seq_len", "4096", f"--parallelism.{degree}", "0"]
    assert_detail(client.post("/v1/import", json={"cluster": CLUSTER, "overrides": overrides}),
                  f"--parallelism.{degree} 0 must be at least 1")


@pytest.mark.parametrize("section", ["fp16", "bf16", "zero_optimization", "pipeline", "data_types"])
@pytest.mark.parametrize("value", ["x", 3, [1], True])
def test_deepspeed_sections_that_are_not_objects_are_named(client, section, value):
    config = {"train_batch_size": 16, "bf16": {"enabled": True}, section: value}
    response = client.post("/v1/import", json={"cluster": CLUSTER, "megatron_args": MODEL, "deepspeed_config": config})
    assert_detail(response, f"{section} must be a JSON object, not {type(value).__name__}")
