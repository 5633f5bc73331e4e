"""DeepSpeed itself checks the deepspeed export, on real plans.

Everything runs in this process on PyTorch's fake process group: ranks, groups
and world sizes are real, collectives do nothing. On it:

- `DeepSpeedConfig(config, mpu=grid)` parses every exported document, the way
  `deepspeed.initialize` does for a PipelineModule (mpu is the module's
  PipelineParallelGrid), so its batch assertion checks train_batch_size ==
  micro x accumulation x the plan's dp;
- `PipeModelDataParallelTopology` and `PipelineParallelGrid` take the plan's
  degrees, and the topology's rank order puts every rank on its planned GPU;
- a PipelineModule built as a training script would (stock `type:` partition
  for even splits, `planned_pipeline_module` for uneven ones) gets the plan's
  layer split on every stage;
- `deepspeed.initialize` builds a PipelineEngine from the document on rank 0;
- DeepSpeed's own launcher code (runner parsing, launch.py's rank and device
  assignment, with process spawning stubbed out) places each rank of the
  `launch_command` on its planned GPU.

Wrong configs derived from real plans are rejected by DeepSpeed's own
assertions. DeepSpeed knows nothing of attention heads, so a TP that does not
divide them is caught by the adapter, not DeepSpeed.
"""

from __future__ import annotations

import os

# Before deepspeed picks an accelerator: these tests run on CPU even on a GPU machine.
os.environ["DS_ACCELERATOR"] = "cpu"

import copy
import importlib
import itertools
import json
import re
import shlex
import signal
import subprocess
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import deepspeed
import pydantic
import pytest
import torch
import torch.distributed as torch_dist
from deepspeed.accelerator import get_accelerator
from deepspeed.launcher import launch as ds_launch
from deepspeed.launcher import runner as ds_runner
from deepspeed.pipe import LayerSpec, PipelineModule
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.topology import (
    PipelineParallelGrid,
    PipeModelDataParallelTopology,
)
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from adapters import deepspeed as ds_export
from adapters.registry import ExportError, export_format
from adapters.stock import launch_blocks, stock_layout
from api.tasks.planning import estimate_for, plan_for
from tests.api.support import estimate_request, small_request
from wire.schemas import EstimateRequest, Plan, PlanRequest

STOCK = {"allow_non_uniform": False, "time_limit_s": 2}
FOUR_NODES = {"num_nodes": 4, "gpus_per_node": 8, "gpu": "A100-80GB"}
BATCH_64 = {"global_batch_size": 64, "seq_length": 4096}

# ---------------------------------------------------------------------------------------------------------------
# Real plans, each planned once


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], Plan]
    expect: dict[str, Any] = field(default_factory=dict)  # what the case is for: checked on the plan


def _plan(**overrides: Any) -> Callable[[], Plan]:
    return lambda: plan_for(PlanRequest.model_validate(small_request(**overrides)))


def _estimate(layout: dict[str, Any], **overrides: Any) -> Callable[[], Plan]:
    return lambda: estimate_for(EstimateRequest.model_validate(estimate_request(layout, **overrides)))


CASES = [
    Case("healthy-70b-tp4-pp4-dp2",
         _plan(model="llama2-70b", cluster=FOUR_NODES, training=BATCH_64, options={**STOCK, "schedules": ["1f1b"]}),
         {"tp": 4, "pp": 4, "dp": 2, "uneven": False}),
    Case("failed-gpu-uneven-first-last-tp2-pp7",
         _plan(failures={"failed": ["1:3"]}, options=STOCK), {"pp": 7, "uneven": True, "partial_node": True}),
    Case("full-recompute-mbs2-tp2-pp4-dp4",
         _estimate({"tp": 2, "pp": 4, "micro_batch_size": 2, "recompute": "full"}),
         {"recompute": "full", "micro_batch_size": 2, "pp": 4}),
    Case("selective-zero0-uneven-7-9-9-7",
         _estimate({"tp": 2, "pp": 4, "layers_per_stage": [7, 9, 9, 7]},
                   training={"global_batch_size": 256, "seq_length": 4096, "zero_stage": 0}),
         {"recompute": "selective", "zero_stage": 0, "uneven": True}),
    Case("selective-zero0-mbs2-pp1",
         _plan(options={**STOCK, "schedules": ["1f1b"]},
               training={"global_batch_size": 32, "seq_length": 2048, "recompute": "selective", "zero_stage": 0,
                         "micro_batch_size": 2}),
         {"recompute": "selective", "zero_stage": 0, "micro_batch_size": 2, "pp": 1}),
    Case("fp16-zero0",
         _plan(options=STOCK, training={**BATCH_64, "precision": "fp16", "zero_stage": 0}),
         {"precision": "fp16", "zero_stage": 0}),
    Case("gpipe-uneven-pp7", _plan(failures={"failed": ["1:3"]}, options={**STOCK, "schedules": ["gpipe"]}),
         {"schedule": "gpipe", "uneven": True}),
    Case("one-node-two-failed-pp3-dp2",
         _plan(cluster={"num_nodes": 1, "gpus_per_node": 8, "gpu": "A100-80GB"}, failures={"failed": ["0:3", "0:6"]},
               options=STOCK),
         {"pp": 3, "dp": 2, "nodes": 1, "partial_node": True}),
]
CASE_IDS = [case.name for case in CASES]
_plans: dict[str, Plan] = {}


def plan_of(name: str) -> Plan:
    if name not in _plans:
        _plans[name] = next(case for case in CASES if case.name == name).build()
    return _plans[name]


@pytest.fixture(params=CASES, ids=CASE_IDS)
def case(request: pytest.FixtureRequest) -> tuple[Case, Plan]:
    return request.param, plan_of(request.param.name)


def exported(plan: Plan) -> dict[str, Any]:
    """The document as a training script reads it from ds_config.json."""
    return json.loads(ds_export.render(plan))


# ---------------------------------------------------------------------------------------------------------------
# A fake world for deepspeed.comm


class FakeWorld:
    """deepspeed.comm over torch.distributed's fake backend, re-initialized at each world size and rank."""

    def enter(self, world_size: int, rank: int = 0) -> None:
        if torch_dist.is_initialized():
            torch_dist.destroy_process_group()
        torch_dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        if importlib.import_module("deepspeed.comm.comm").cdb is None:
            # sees torch.distributed initialized and wraps it in DeepSpeed's TorchBackend
            deepspeed.comm.init_distributed(dist_backend="fake", auto_mpi_discovery=False, verbose=False)
        assert deepspeed.comm.get_world_size() == world_size and deepspeed.comm.get_rank() == rank

    def close(self) -> None:
        if torch_dist.is_initialized():
            torch_dist.destroy_process_group()
        importlib.import_module("deepspeed.comm.comm").cdb = None


@pytest.fixture(scope="module")
def world():
    assert get_accelerator().device_name() == "cpu", "deepspeed picked a non-CPU accelerator before DS_ACCELERATOR"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LOCAL_RANK", "0")  # PipelineModule reads it
        # DeepSpeed's TorchBackend JIT-compiles its CPU shared-memory all-reduce kernel (a C++ build) on
        # creation; collectives on a fake group never reach it.
        patch.setattr(importlib.import_module("deepspeed.comm.torch"), "build_shm_op", lambda: None)
        # BF16_Optimizer's forced memory reports each run gc.collect(), a quarter second with torch loaded
        patch.setattr(importlib.import_module("deepspeed.runtime.bf16_optimizer"), "see_memory_usage",
                      lambda *_, **__: None)
        fake = FakeWorld()
        try:
            yield fake
        finally:
            fake.close()


def topology_of(document: dict[str, Any]) -> PipeModelDataParallelTopology:
    degrees = document["resiplan"]["pipeline_module"]["topology"]
    assert degrees["class"] == "PipeModelDataParallelTopology"
    return PipeModelDataParallelTopology(num_pp=degrees["num_pp"], num_mp=degrees["num_mp"], num_dp=degrees["num_dp"])


def grid_of(world: FakeWorld, document: dict[str, Any], rank: int = 0) -> PipelineParallelGrid:
    topology = topology_of(document)
    world.enter(topology.world_size(), rank)
    return PipelineParallelGrid(topology=topology)


# A model as a training script lays it out: embedding, the transformer layers, final norm, head.


class Embedding(nn.Linear):
    pass


class TransformerLayer(nn.Linear):
    pass


class FinalNorm(nn.Linear):
    pass


class Head(nn.Linear):
    pass


def layer_specs(num_transformer_layers: int) -> list[LayerSpec]:
    return [LayerSpec(Embedding, 4, 4), *(LayerSpec(TransformerLayer, 4, 4) for _ in range(num_transformer_layers)),
            LayerSpec(FinalNorm, 4, 4), LayerSpec(Head, 4, 4)]


def pipeline_module(document: dict[str, Any]) -> PipelineModule:
    """What a training script builds from the `resiplan` section (on the current fake rank)."""
    settings = document["resiplan"]["pipeline_module"]
    layers = layer_specs(document["resiplan"]["model"]["num_layers"])
    kwargs = {"topology": topology_of(document), "loss_fn": nn.MSELoss(),
              "activation_checkpoint_interval": settings["activation_checkpoint_interval"]}
    if settings["partition_method"] == ds_export.EXPLICIT_PARTITION_METHOD:
        parts = ds_export.pipeline_parts(settings["transformer_layer_boundaries"], first_transformer_index=1,
                                         num_layers=len(layers))
        return ds_export.planned_pipeline_module(layers, parts, **kwargs)
    return PipelineModule(layers, partition_method=settings["partition_method"], **kwargs)


def transformer_layers_per_stage(module: PipelineModule) -> list[int]:
    specs = module._layer_specs
    return [sum(spec.typename is TransformerLayer for spec in specs[start:stop])
            for start, stop in zip(module.parts[:-1], module.parts[1:])]


# ---------------------------------------------------------------------------------------------------------------
# The plans are what the cases claim


def test_cases_are_what_they_claim(case):
    spec, plan = case
    layout = stock_layout(plan, "DeepSpeed")
    facts = {
        "tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "uneven": layout.uneven,
        "recompute": layout.recompute, "zero_stage": layout.zero_stage, "micro_batch_size": layout.micro_batch_size,
        "precision": layout.precision, "schedule": layout.schedule,
        "partial_node": len(layout.rank_devices) % layout.gpus_per_node != 0, "nodes": len(layout.nodes),
    }
    assert {key: facts[key] for key in spec.expect} == spec.expect


def test_registry_serves_the_export():
    plan = plan_of(CASE_IDS[0])
    text = export_format("deepspeed").render(plan)
    assert text == ds_export.render(plan) and json.loads(text)["resiplan"]["plan_id"] == plan.plan_id
    assert ds_export.render(plan, replica_id=plan.replicas[-1].id) == text  # one config serves every replica
    with pytest.raises(ExportError, match="no replica 999"):
        ds_export.render(plan, replica_id=999)


# ---------------------------------------------------------------------------------------------------------------
# DeepSpeed accepts every export


def test_deepspeed_config_accepts_the_export(world, case):
    _, plan = case
    layout = stock_layout(plan, "DeepSpeed")
    document = exported(plan)
    grid = grid_of(world, document)
    assert grid.get_data_parallel_world_size() == layout.dp

    config = DeepSpeedConfig(copy.deepcopy(document), mpu=grid)  # as deepspeed.initialize does for a PipelineModule

    assert config.world_size == layout.dp  # the batch assertion used the plan's dp
    assert config.train_batch_size == plan.global_batch_size == layout.global_batch_size
    assert config.train_micro_batch_size_per_gpu == plan.micro_batch_size
    assert config.gradient_accumulation_steps == layout.num_microbatches
    assert config.zero_optimization_stage == plan.zero_stage <= 1  # PipelineEngine refuses ZeRO-2/3
    assert config.bfloat16_config.enabled == (layout.precision == "bf16")
    assert config.float16_config.enabled == (layout.precision == "fp16")
    assert config.gradient_clipping == ds_export.GRADIENT_CLIPPING
    # PipelineEngine asserts these are bools and reads the interval from here
    assert all(isinstance(config.pipeline[key], bool) for key in ("pipe_partitioned", "grad_partitioned"))
    assert config.pipeline["activation_checkpoint_interval"] == (1 if plan.recompute == "full" else 0)
    assert config.activation_checkpointing_config.partition_activations == (plan.recompute == "full" and layout.tp > 1)
    # the config proper is the document without the resiplan key, which DeepSpeed ignores
    assert ds_export.deepspeed_config(plan) == {k: v for k, v in document.items() if k != ds_export.RESIPLAN_KEY}


def test_topology_takes_the_degrees_and_places_every_rank(world, case):
    _, plan = case
    layout = stock_layout(plan, "DeepSpeed")
    document = exported(plan)
    topology = topology_of(document)
    assert topology.world_size() == layout.world_size == len(layout.rank_devices)
    assert (topology.get_dim("pipe"), topology.get_dim("model"), topology.get_dim("data")) == (layout.pp, layout.tp,
                                                                                              layout.dp)
    replicas = sorted(plan.replicas, key=lambda r: r.id)
    for rank in range(topology.world_size()):
        coord = topology.get_coord(rank)
        planned = replicas[coord.data].stages[coord.pipe].devices[coord.model]
        assert document["resiplan"]["rank_devices"][rank] == planned, f"rank {rank} at {coord}"
    grid = grid_of(world, document)
    assert (grid.get_pipe_parallel_world_size(), grid.get_slice_parallel_world_size(),
            grid.get_data_parallel_world_size()) == (layout.pp, layout.tp, layout.dp)


def test_pipeline_module_builds_the_planned_split_on_every_stage(world, case):
    _, plan = case
    layout = stock_layout(plan, "DeepSpeed")
    document = exported(plan)
    topology = topology_of(document)
    boundaries = document["resiplan"]["pipeline_module"]["transformer_layer_boundaries"]
    for stage in range(layout.pp):
        rank = topology.filter_match(pipe=stage, data=layout.dp - 1, model=layout.tp - 1)[0]
        world.enter(topology.world_size(), rank)
        module = pipeline_module(document)
        assert transformer_layers_per_stage(module) == list(layout.layers_per_stage)
        assert module.stage_id == stage
        built = [type(layer) for layer in module.forward_funcs]
        assert built.count(TransformerLayer) == boundaries[stage + 1] - boundaries[stage]
        assert (Embedding in built) == (stage == 0) and (Head in built) == (stage == layout.pp - 1)


@pytest.mark.parametrize("name", [case.name for case in CASES if case.expect.get("precision") != "fp16"])
def test_deepspeed_initialize_builds_a_pipeline_engine_from_the_export(world, name):
    """Not for fp16: DeepSpeed's CPU accelerator has no fp16 ("Type fp16 is not supported on your device")."""
    plan = plan_of(name)
    layout = stock_layout(plan, "DeepSpeed")
    document = exported(plan)
    world.enter(layout.world_size, 0)
    module = pipeline_module(document)
    engine, *_ = deepspeed.initialize(model=module, config=copy.deepcopy(document),
                                      optimizer=torch.optim.AdamW(module.parameters(), lr=1e-3))
    assert isinstance(engine, PipelineEngine)
    assert (engine.num_stages, engine.dp_world_size, engine.micro_batches, engine.micro_batch_size) == (
        layout.pp, layout.dp, layout.num_microbatches, layout.micro_batch_size)
    assert engine.train_batch_size() == plan.global_batch_size
    assert engine.zero_optimization_stage() == plan.zero_stage
    assert engine.is_pipe_partitioned == engine.is_grad_partitioned == (layout.tp > 1)
    assert module.activation_checkpoint_interval == (1 if plan.recompute == "full" else 0)


# ---------------------------------------------------------------------------------------------------------------
# DeepSpeed rejects wrong configs derived from real plans


@pytest.fixture
def uneven_plan() -> Plan:
    return plan_of("failed-gpu-uneven-first-last-tp2-pp7")


@pytest.fixture
def healthy_plan() -> Plan:
    return plan_of("healthy-70b-tp4-pp4-dp2")


def test_deepspeed_rejects_a_batch_that_does_not_multiply_out(world, healthy_plan):
    document = exported(healthy_plan)
    dp = document["resiplan"]["pipeline_module"]["topology"]["num_dp"]
    grid = grid_of(world, document)
    for key, delta in (("train_batch_size", dp), ("gradient_accumulation_steps", 1),
                       ("train_micro_batch_size_per_gpu", 1)):
        wrong = copy.deepcopy(document)
        wrong[key] += delta
        with pytest.raises(AssertionError, match="train_batch_size is not equal to micro_batch_per_gpu"):
            DeepSpeedConfig(wrong, mpu=grid)


def test_deepspeed_rejects_the_export_under_another_dp(world, healthy_plan):
    """The same config on a grid with pp and dp swapped (same world size) fails the batch assertion."""
    document = exported(healthy_plan)
    degrees = document["resiplan"]["pipeline_module"]["topology"]
    assert degrees["num_pp"] != degrees["num_dp"]
    world.enter(degrees["num_pp"] * degrees["num_mp"] * degrees["num_dp"])
    swapped = PipelineParallelGrid(topology=PipeModelDataParallelTopology(
        num_pp=degrees["num_dp"], num_mp=degrees["num_mp"], num_dp=degrees["num_pp"]))
    with pytest.raises(AssertionError, match="train_batch_size is not equal"):
        DeepSpeedConfig(copy.deepcopy(document), mpu=swapped)


def test_deepspeed_rejects_degrees_that_do_not_fill_the_world(world, uneven_plan):
    document = exported(uneven_plan)
    degrees = document["resiplan"]["pipeline_module"]["topology"]
    world.enter(degrees["num_pp"] * degrees["num_mp"] * degrees["num_dp"])
    with pytest.raises(AssertionError, match="Invalid Grid"):
        PipelineParallelGrid(topology=PipeModelDataParallelTopology(
            num_pp=degrees["num_pp"], num_mp=degrees["num_mp"], num_dp=degrees["num_dp"] + 1))
    with pytest.raises(RuntimeError, match="must divide distributed world size"):
        PipelineModule(layer_specs(4), num_stages=degrees["num_pp"] + 1)


def test_deepspeed_rejects_mixed_precision_and_zero_typos(world, healthy_plan):
    document = exported(healthy_plan)
    grid = grid_of(world, document)
    both = copy.deepcopy(document) | {"fp16": {"enabled": True}}
    with pytest.raises(AssertionError, match="bfloat16 and fp16 modes cannot be simultaneously enabled"):
        DeepSpeedConfig(both, mpu=grid)
    typo = copy.deepcopy(document)
    typo["zero_optimization"]["stagee"] = 1
    with pytest.raises(pydantic.ValidationError, match="stagee"):
        DeepSpeedConfig(typo, mpu=grid)


def test_pipeline_engine_rejects_zero_2(world, healthy_plan):
    """DeepSpeedConfig takes ZeRO-2; the PipelineEngine refuses it, which is why plans stop at ZeRO-1."""
    document = exported(healthy_plan)
    document["zero_optimization"]["stage"] = 2
    DeepSpeedConfig(copy.deepcopy(document), mpu=grid_of(world, document))
    module = pipeline_module(document)
    with pytest.raises(AssertionError, match="ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism"):
        deepspeed.initialize(model=module, config=document, optimizer=torch.optim.AdamW(module.parameters()))


def test_stock_pipeline_module_refuses_the_explicit_marker(world, uneven_plan):
    """An uneven split is "explicit": stock PipelineModule raises on it rather than splitting its own way."""
    document = exported(uneven_plan)
    assert document["resiplan"]["pipeline_module"]["partition_method"] == ds_export.EXPLICIT_PARTITION_METHOD
    world.enter(topology_of(document).world_size())
    with pytest.raises(NotImplementedError, match="Partitioning method explicit not implemented"):
        PipelineModule(layer_specs(32), topology=topology_of(document), partition_method="explicit")
    # and DeepSpeed's own even methods do not give the plan's split
    module = PipelineModule(layer_specs(32), topology=topology_of(document), partition_method="type:transformer")
    assert transformer_layers_per_stage(module) != document["resiplan"]["pipeline_module"][
        "transformer_layers_per_stage"]


def test_pipeline_parts_place_embedding_and_head():
    assert ds_export.pipeline_parts([0, 3, 8, 10], first_transformer_index=1, num_layers=13) == [0, 4, 9, 13]
    with pytest.raises(ValueError):
        ds_export.pipeline_parts([0, 3, 8, 10], first_transformer_index=4, num_layers=13)


# ---------------------------------------------------------------------------------------------------------------
# The adapter refuses what DeepSpeed cannot run


def test_adapter_refuses_tp_that_does_not_divide_heads(healthy_plan):
    """DeepSpeed knows no heads (its config and topology take tp 4 for a 30-head model): the adapter checks."""
    architecture = healthy_plan.architecture.model_copy(update={"num_attention_heads": 30, "num_kv_heads": 30})
    tampered = healthy_plan.model_copy(update={"architecture": architecture})
    PipeModelDataParallelTopology(num_pp=4, num_mp=4, num_dp=2)  # nothing to object to
    with pytest.raises(ExportError, match="tp 4 does not divide the model's 30 attention heads"):
        ds_export.render(tampered)


def test_adapter_refuses_an_fp8_plan_saying_where_fp8_runs(healthy_plan):
    """DeepSpeedConfig accepts no FP8 setting (its bf16/fp16 sections are all it has): the adapter refuses."""
    fp8 = healthy_plan.model_copy(update={"precision": "fp8"})
    with pytest.raises(ExportError, match="precision fp8 .*megatron or torchtitan"):
        ds_export.render(fp8)


def test_adapter_refuses_a_non_uniform_plan():
    # spelled out, not searched: a search cut short by a loaded machine may answer a uniform plan
    node0, node1 = ([f"{node}:{gpu}" for gpu in range(8)] for node in (0, 1))
    replicas = [{"num_microbatches": 16, "stages": [{"devices": node0, "layers": [0, 32]}]},
                {"num_microbatches": 16, "stages": [{"devices": node1[:4], "layers": [0, 16]},
                                                    {"devices": node1[4:], "layers": [16, 32]}]}]
    plan = estimate_for(EstimateRequest.model_validate(small_request(layout={"replicas": replicas})))
    assert not plan.uniform
    with pytest.raises(ExportError) as refused:
        ds_export.render(plan)
    message = str(refused.value)
    assert message.startswith("DeepSpeed cannot run this plan:")
    assert re.search(r"different (microbatch counts|stage counts|TP sizes)|split the layers differently", message)
    assert '"allow_non_uniform": false' in message


@pytest.mark.parametrize("schedule, reason", [
    ("interleaved", "no interleaved schedule"),
    ("zb-h1", "no split \\(input/weight-gradient\\) backward"),
    ("optimized", "not a solver-made one"),
])
def test_adapter_refuses_schedules_deepspeed_has_not(schedule, reason):
    plan = _plan(model="llama2-70b", cluster=FOUR_NODES, training=BATCH_64,
                 options={**STOCK, "schedules": [schedule]})()
    assert plan.uniform and plan.schedule == schedule and len(plan.replicas[0].stages) > 1
    with pytest.raises(ExportError, match=f'schedule "{schedule}" \\(.*{reason}') as refused:
        ds_export.render(plan)
    assert '"options": {"allow_non_uniform": false, "schedules": ["1f1b"]}' in str(refused.value)
    if plan.virtual_stages > 1:
        assert f"{plan.virtual_stages} virtual stages per GPU" in str(refused.value)
    with pytest.raises(ExportError):
        ds_export.launch_command(plan)


# ---------------------------------------------------------------------------------------------------------------
# launch_command, run through DeepSpeed's launcher code and torchrun's rank rule


def _run_launch_py(world_info: str, node_rank: int, args: Any) -> list[tuple[list[str], dict[str, str]]]:
    """deepspeed/launcher/launch.py's main for one node, recording the processes it would spawn."""
    spawned: list[tuple[list[str], dict[str, str]]] = []

    class Process:
        pid = 0
        returncode = 0

        def __init__(self, cmd: list[str], env: dict[str, str], **_: Any):
            spawned.append((list(cmd), dict(env)))

        def poll(self) -> int:
            return 0

    argv = ["launch", f"--world_info={world_info}", f"--node_rank={node_rank}", "--master_addr=127.0.0.1",
            f"--master_port={args.master_port}", args.user_script, *args.user_args]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ds_launch, "subprocess", types.SimpleNamespace(Popen=Process))
        patch.setattr(ds_launch, "signal", types.SimpleNamespace(signal=lambda *_: None, SIGINT=signal.SIGINT,
                                                                 SIGTERM=signal.SIGTERM))
        patch.setattr(ds_launch, "time", types.SimpleNamespace(sleep=lambda _: None))
        patch.setattr(sys, "argv", argv)
        ds_launch.main()
    return spawned


TRAIN_SCRIPT = "my train.py"  # what $TRAIN_SCRIPT holds when the launch line runs


def bash_words(command: str, env: dict[str, str]) -> list[str]:
    """The words bash hands the program of one command line (quotes removed, variables expanded)."""
    shown = subprocess.run(["bash", "-c", 'words() { printf "%s\\0" "$@"; }; words ' + command],
                           env={"PATH": "/usr/bin:/bin", **env}, capture_output=True, text=True, check=True)
    return shown.stdout.split("\0")[:-1]


def test_launch_stops_until_the_training_script_is_set():
    plan = plan_of(CASE_IDS[0])
    (command,) = [line for line in ds_export.launch_command(plan).splitlines() if line.startswith("deepspeed ")]
    refused = subprocess.run(["bash", "-c", "deepspeed() { touch ran; }; " + command], capture_output=True,
                             text=True, env={"PATH": "/usr/bin:/bin"})
    assert refused.returncode != 0
    assert "TRAIN_SCRIPT: set TRAIN_SCRIPT to your training script" in refused.stderr


def deepspeed_launcher_placement(lines: list[str], tmp_path: Path, local_gpus: int, local_node: int) -> dict[int, str]:
    """rank -> "node:gpu" where DeepSpeed's launcher starts the `deepspeed` line of `lines`.

    The runner's own parsing (arguments, hostfile, --include, the world info it encodes), then
    launch.py per host, as runner.main does without the ssh/pdsh part. Hosts are `node<N>`, or
    `localhost` (= local_node) without a hostfile, where the runner counts local_gpus GPUs.
    """
    (command,) = [line for line in lines if line.startswith("deepspeed ")]
    if f"cat > {ds_export.HOSTFILE} <<'RESIPLAN_HOSTS'" in lines:
        start = lines.index(f"cat > {ds_export.HOSTFILE} <<'RESIPLAN_HOSTS'") + 1
        (tmp_path / ds_export.HOSTFILE).write_text("\n".join(lines[start:lines.index("RESIPLAN_HOSTS")]) + "\n")
    argv = bash_words(command, {ds_export.TRAIN_SCRIPT_VARIABLE: TRAIN_SCRIPT})[1:]
    args = ds_runner.parse_args(argv)
    pool = ds_runner.fetch_hostfile(str(tmp_path / args.hostfile)) if args.hostfile == ds_export.HOSTFILE else None
    if not pool:
        pool = {"localhost": local_gpus}  # runner.main without a hostfile: the local device count
    active = ds_runner.parse_inclusion_exclusion(pool, args.include, args.exclude)
    active = ds_runner.apply_num_nodes_and_gpus(active, args.num_nodes, args.num_gpus)
    world_info = ds_runner.encode_world_info(active)
    placement = {}
    for node_rank, host in enumerate(active):
        node = local_node if host == "localhost" else int(host.removeprefix("node"))
        for cmd, env in _run_launch_py(world_info, node_rank, args):
            assert cmd[2:] == [TRAIN_SCRIPT, f"--local_rank={env['LOCAL_RANK']}",
                               *shlex.split(ds_export.TRAIN)[1:]]
            gpu = env["CUDA_VISIBLE_DEVICES"].split(",")[int(env["LOCAL_RANK"])]
            placement[int(env["RANK"])] = f"{node}:{gpu}"
            assert int(env["WORLD_SIZE"]) == sum(len(slots) for slots in active.values())
    return placement


def torchrun_placement(lines: list[str]) -> dict[int, str]:
    """rank -> "node:gpu" for the torchrun lines: node rank k gets the ranks after node ranks 0..k-1 (torch
    elastic's _assign_worker_ranks), local rank i the i-th CUDA_VISIBLE_DEVICES entry."""
    rows = []
    for previous, line in itertools.pairwise(lines):
        if " torchrun " in line and not line.startswith("#"):
            node = int(previous.removeprefix("# on node "))
            visible = re.match(r"CUDA_VISIBLE_DEVICES=([\d,]+) ", line).group(1).split(",")
            nproc = int(re.search(r"--nproc_per_node=(\d+)", line).group(1))
            node_rank = int(re.search(r"--node_rank=(\d+)", line).group(1))
            assert nproc == len(visible)
            rows.append((node_rank, node, visible))
    placement, first = {}, 0
    for _, node, visible in sorted(rows):
        placement.update({first + local: f"{node}:{gpu}" for local, gpu in enumerate(visible)})
        first += len(visible)
    return placement


@pytest.mark.parametrize("name", [CASE_IDS[0], "full-recompute-mbs2-tp2-pp4-dp4", "selective-zero0-mbs2-pp1",
                                  "failed-gpu-uneven-first-last-tp2-pp7", "one-node-two-failed-pp3-dp2"])
def test_launch_command_puts_every_rank_on_its_planned_gpu(name, tmp_path):
    plan = plan_of(name)
    layout = stock_layout(plan, "DeepSpeed")
    lines = ds_export.launch_command(plan).splitlines()
    planned = dict(enumerate(layout.rank_devices))
    if any(line.startswith("deepspeed ") for line in lines):
        placement = deepspeed_launcher_placement(lines, tmp_path, layout.gpus_per_node, layout.nodes[0])
    else:
        placement = torchrun_placement(lines)
        assert all(line.endswith(f" {ds_export.TRAIN}") for line in lines if " torchrun " in line and line[0] != "#")
    assert placement == planned


def test_torchrun_fallback_is_needed_where_deepspeeds_launcher_misplaces(tmp_path):
    """On the plan with a node running 6 of 8 GPUs after a full node, DeepSpeed's launcher would give
    rank 8 LOCAL_RANK 8 % 6 = 2: the export uses torchrun there."""
    plan = plan_of("failed-gpu-uneven-first-last-tp2-pp7")
    layout = stock_layout(plan, "DeepSpeed")
    assert "CUDA_VISIBLE_DEVICES=0,1,2,4,5,6 torchrun " in ds_export.launch_command(plan)
    blocks = launch_blocks(layout, "DeepSpeed")
    assert not ds_export.deepspeed_launcher_places(blocks)
    lines = ds_export.deepspeed_launcher_lines(blocks, layout.gpus_per_node)
    placement = deepspeed_launcher_placement(lines, tmp_path, layout.gpus_per_node, layout.nodes[0])
    assert placement != dict(enumerate(layout.rank_devices))
    assert sorted(placement.values()) == sorted(layout.rank_devices)  # the right GPUs, some under other ranks


@pytest.mark.parametrize("blocks", [
    [(0, list(range(8))), (1, list(range(8)))],
    [(0, [0, 1, 2, 4, 5, 6]), (1, [0, 1, 2, 3, 4, 5])],
    [(0, [0, 1, 2, 4, 5, 6]), (1, [0, 1, 2, 3, 4, 5, 6, 7])],
    [(2, [1, 0])],
    [(3, [0, 2, 5])],
])
def test_deepspeed_launcher_places_agrees_with_launch_py(blocks, tmp_path):
    lines = ds_export.deepspeed_launcher_lines(blocks, gpus_per_node=8)
    placement = deepspeed_launcher_placement(lines, tmp_path, local_gpus=8, local_node=blocks[0][0])
    planned = dict(enumerate(f"{node}:{gpu}" for node, gpus in blocks for gpu in gpus))
    assert (placement == planned) == ds_export.deepspeed_launcher_places(blocks)


# ---------------------------------------------------------------------------------------------------------------
# ZeRO-2 and ZeRO-3: DeepSpeed's plain engine (its PipelineEngine refuses them), so only with pp 1


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_engine_runs_zero_2_and_3_without_a_pipeline_module(world, stage):
    plan = estimate_for(EstimateRequest.model_validate(estimate_request(
        {"tp": 1, "pp": 1, "dp": 32}, training={"global_batch_size": 64, "seq_length": 4096, "zero_stage": stage})))
    document = exported(plan)
    assert document["resiplan"]["pipeline_module"] is None and "pipeline" not in document
    world.enter(32, 0)
    config = DeepSpeedConfig(copy.deepcopy(document))
    assert (config.zero_optimization_stage, config.world_size) == (stage, 32)
    assert config.gradient_accumulation_steps == plan.replicas[0].num_microbatches == 2
    model = nn.Sequential(Embedding(4, 4), TransformerLayer(4, 4), Head(4, 4))
    # the script's model-parallel unit (tp 1 here), as a Megatron-DeepSpeed script passes its mpu
    grid = PipelineParallelGrid(topology=PipeModelDataParallelTopology(num_pp=1, num_mp=1, num_dp=32))
    engine, *_ = deepspeed.initialize(model=model, config=copy.deepcopy(document), mpu=grid,
                                      optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert not isinstance(engine, PipelineEngine)
    assert engine.zero_optimization_stage() == stage == plan.zero_stage
    assert (engine.train_batch_size(), engine.gradient_accumulation_steps()) == (64, 2)
    # without ZeRO-1's fp32 option DeepSpeed accumulates in the model's bf16, and the importer says so
    assert engine.get_data_types() == (torch.bfloat16, torch.bfloat16)
    from adapters.deepspeed_import import import_deepspeed
    assert import_deepspeed(document).request["training"][
        "grad_precision"] == "bf16"


def test_adapter_refuses_zero_2_with_pipeline_parallelism():
    plan = estimate_for(EstimateRequest.model_validate(estimate_request(
        {"tp": 1, "pp": 2, "dp": 16}, training={"global_batch_size": 64, "seq_length": 4096, "zero_stage": 2})))
    with pytest.raises(ExportError, match="zero_stage 2 with pp 2 .DeepSpeed's PipelineEngine runs ZeRO stage 0 or 1"):
        ds_export.render(plan)


def test_adapter_refuses_hybrid_sharding_which_deepspeed_removed(world):
    """Shard groups replicated across nodes (dp_shard < dp) have no DeepSpeed 0.19 equivalent: MiCS, its
    hybrid sharding of all ZeRO state, is gone, and DeepSpeedConfig itself refuses its setting."""
    plan = estimate_for(EstimateRequest.model_validate(estimate_request(
        {"tp": 1, "pp": 1, "dp": 32, "dp_shard": 8},
        training={"global_batch_size": 64, "seq_length": 4096, "zero_stage": 3})))
    assert plan.dp_shard == 8
    with pytest.raises(ExportError, match=r"hybrid sharding \(dp_shard 8 of 32 replicas\): DeepSpeed 0.19 removed MiCS"):
        ds_export.render(plan)
    full = estimate_for(EstimateRequest.model_validate(estimate_request(
        {"tp": 1, "pp": 1, "dp": 32}, training={"global_batch_size": 64, "seq_length": 4096, "zero_stage": 3})))
    document = exported(full)
    document["zero_optimization"]["mics_shard_size"] = 8
    world.enter(32, 0)
    with pytest.raises(Exception, match="MiCS ZeRO-3 sharding has been removed"):
        DeepSpeedConfig(copy.deepcopy(document))


def test_bf16_gradients_accumulate_and_reduce_in_bf16_in_deepspeeds_own_config(world):
    """grad_precision bf16: DeepSpeed's parsed config accumulates gradients in bf16 and communicates in bf16, and
    the config reads back as bf16 gradients; fp32 gradients with ZeRO-1 keep its fp32 accumulation."""
    from adapters.deepspeed_import import import_deepspeed

    for grad_precision in ("bf16", "fp32"):
        plan = estimate_for(EstimateRequest.model_validate(estimate_request(
            {"tp": 1, "pp": 1, "dp": 32}, training={"global_batch_size": 64, "seq_length": 4096,
                                                     "grad_precision": grad_precision})))
        document = exported(plan)
        world.enter(32, 0)
        config = DeepSpeedConfig(copy.deepcopy(document))
        assert config.grad_accum_dtype == grad_precision
        assert config.communication_data_type == (torch.bfloat16 if grad_precision == "bf16" else None)
        imported = import_deepspeed(document)
        assert imported.request["training"].get("grad_precision", "fp32") == grad_precision


# ---------------------------------------------------------------------------------------------------------------
# A mixture of experts: DeepSpeed's AutoEP (the config's expert_parallel section) on a plain engine, tp 1, pp 1

MIXTRAL_LIKE = {"name": "mixtral-like", "num_layers": 32, "hidden_size": 4096, "ffn_hidden_size": 14336,
                "num_attention_heads": 32, "num_kv_heads": 8, "vocab_size": 32000, "num_experts": 8,
                "experts_per_token": 2, "rope_theta": 1e6}
H100_32 = {"num_nodes": 4, "gpus_per_node": 8, "gpu": "H100-SXM"}


def _moe_plan(layout: dict[str, Any], **training: Any) -> Plan:
    return estimate_for(EstimateRequest.model_validate(estimate_request(
        {"recompute": "full", **layout}, cluster=H100_32, model=MIXTRAL_LIKE,
        training={"global_batch_size": 64, "seq_length": 4096, **training})))


class _FusedExperts(nn.Module):
    """Experts stored as Hugging Face transformers 5 stores Mixtral's: gate and up fused, one 3-D tensor each."""

    def __init__(self, experts: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * ffn, hidden))
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, ffn))


class _SparseBlock(nn.Module):
    def __init__(self, experts: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = _FusedExperts(experts, hidden, ffn)


class _DecoderLayer(nn.Module):
    def __init__(self, experts: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.mlp = _SparseBlock(experts, hidden, ffn)


class MixtralShaped(nn.Module):
    """The module tree of a Hugging Face Mixtral (model.layers.N.mlp with gate and experts) and its config's
    expert fields, at toy widths: what AutoEP detects and swaps."""

    def __init__(self, experts: int, top_k: int, layers: int = 2, hidden: int = 16, ffn: int = 24) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(_DecoderLayer(experts, hidden, ffn) for _ in range(layers))
        self.config = types.SimpleNamespace(model_type="mixtral", num_local_experts=experts, num_experts_per_tok=top_k)


@pytest.fixture
def fresh_expert_groups(monkeypatch):
    """DeepSpeed keeps its expert groups, a clone of the world group and the last engine's model-parallel unit in
    module globals, and skips creating a group that exists: a fresh set for each fake world, and no unit (the
    script passes none)."""
    from deepspeed.utils import groups
    for name in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
                 "_EXPERT_DATA_PARALLEL_GROUP_RANKS"):
        monkeypatch.setattr(groups, name, {})
    for name in ("_WORLD_GROUP", "mpu", "mesh_device"):
        monkeypatch.setattr(groups, name, None)
    return groups


@pytest.mark.parametrize("zero_stage", [1, 3])
@pytest.mark.parametrize("rank", [0, 13, 31])
def test_autoep_holds_the_planned_experts_on_the_planned_expert_groups(world, fresh_expert_groups, zero_stage, rank):
    """deepspeed.initialize takes the export as it is (plus the script's own optimizer), swaps a Mixtral-shaped
    model's MoE blocks for AutoEP layers holding experts / ep experts on this rank, and puts the rank's EP group on
    the plan's ep consecutive replicas and its expert-data-parallel group on the replicas holding the same
    experts: megatron-core's expert order at tp 1, which the plan prices."""
    plan = _moe_plan({"tp": 1, "pp": 1, "dp": 32, "ep": 8}, zero_stage=zero_stage)
    assert (plan.ep, plan.zero_stage, len(plan.replicas)) == (8, zero_stage, 32)
    document = exported(plan)
    assert document["expert_parallel"] == {"enabled": True, "autoep_size": 8, "expert_tensor_parallel_size": 1,
                                           "comm_backend": "comm"}
    assert document["resiplan"]["pipeline_module"] is None and "pipeline" not in document
    world.enter(32, rank)
    config = DeepSpeedConfig(copy.deepcopy(document))
    assert (config.expert_parallel_config.enabled, config.expert_parallel_config.autoep_size) == (True, 8)
    experts = plan.architecture.num_experts
    model = MixtralShaped(experts, plan.architecture.experts_per_token)
    # ZeRO wants expert parameters in their own optimizer groups: DeepSpeed makes them when it builds the optimizer
    script = {**copy.deepcopy(document), "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, config=script, model_parameters=model.parameters())
    assert not isinstance(engine, PipelineEngine)
    swapped = [m for name, m in engine.module.named_modules() if name.endswith(".mlp")]
    assert [type(m).__name__ for m in swapped] == ["AutoEPMoELayer"] * 2
    for layer in swapped:  # ZeRO-3 partitions the tensor: its whole shape is ds_shape
        weights = layer.experts.w1
        assert getattr(weights, "ds_shape", weights.shape)[0] == experts // plan.ep == 1
    devices = document["resiplan"]["rank_devices"]
    replicas = sorted(plan.replicas, key=lambda r: r.id)
    first = rank - rank % plan.ep
    ep_ranks = fresh_expert_groups._EXPERT_PARALLEL_GROUP_RANKS[f"ep_size_{plan.ep}"]
    assert [devices[q] for q in ep_ranks] == [replicas[i].stages[0].devices[0] for i in range(first, first + plan.ep)]
    edp_ranks = fresh_expert_groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[f"ep_size_{plan.ep}"]
    assert [devices[q] for q in edp_ranks] == [replicas[i].stages[0].devices[0]
                                              for i in range(rank % plan.ep, 32, plan.ep)]


def test_autoep_export_reads_back_as_the_plan(world):
    """The importer reads AutoEP's section back: the same layout and the same estimate (ZeRO-1 keeps the plan's
    fp32 gradient accumulation); DeepEP's backend is the flex dispatcher."""
    from adapters.deepspeed_import import import_deepspeed

    for dispatcher, backend in (("alltoall", "comm"), ("flex", "deepep")):
        plan = _moe_plan({"tp": 1, "pp": 1, "dp": 32, "ep": 8}, zero_stage=1, moe_dispatcher=dispatcher)
        document = exported(plan)
        assert document["expert_parallel"]["comm_backend"] == backend
        world.enter(32, 0)
        DeepSpeedConfig(copy.deepcopy(document))  # DeepSpeed parses and validates AutoEP's section
        imported = import_deepspeed(document)
        assert imported.not_modelled == []
        assert imported.request["layout"]["ep"] == 8
        assert imported.request["training"]["moe_dispatcher"] == dispatcher
        again = estimate_for(EstimateRequest.model_validate({**imported.request, "cluster": H100_32}))
        assert again.ep == 8 and again.moe_dispatcher == plan.moe_dispatcher
        assert again.predicted.iteration_time_s == plan.predicted.iteration_time_s


def test_importer_refuses_what_autoep_refuses():
    from adapters.command_line import CommandLineError
    from adapters.deepspeed_import import import_deepspeed

    document = exported(_moe_plan({"tp": 1, "pp": 1, "dp": 32, "ep": 8}, zero_stage=1))
    for change, message in (({"expert_tensor_parallel_size": 2}, "AutoEP runs only 1"),
                            ({"comm_backend": "nccl"}, "comm_backend 'nccl'")):
        bad = copy.deepcopy(document)
        bad["expert_parallel"].update(change)
        with pytest.raises(CommandLineError, match=message):
            import_deepspeed(bad)
    odd = copy.deepcopy(document)
    odd["expert_parallel"]["use_grouped_mm"] = False
    assert import_deepspeed(odd).not_modelled == ["expert_parallel.use_grouped_mm: not an AutoEP setting resiplan "
                                                  "models"]


@pytest.mark.parametrize(("layout", "training", "reason"), [
    ({"tp": 2, "pp": 1, "dp": 16, "ep": 8, "etp": 1}, {}, "a mixture of experts with tp 2 .AutoEP's tensor parallelism"),
    ({"tp": 1, "pp": 2, "dp": 16, "ep": 8}, {}, "a mixture of experts with pp 2 .DeepSpeed's AutoEP swaps"),
    ({"tp": 1, "pp": 1, "dp": 32, "ep": 8, "recompute": "selective"}, {"moe_a2a_overlap": True, "zero_stage": 3},
     "moe_a2a_overlap .AutoEP has no batch-level overlap"),
])
def test_adapter_refuses_expert_layouts_autoep_cannot_run(layout, training, reason):
    plan = _moe_plan(layout, **training)
    with pytest.raises(ExportError, match=reason + ".*export to megatron or torchtitan"):
        ds_export.render(plan)


class _RoutedBlock(nn.Module):
    """GPT-OSS's MoE block as Hugging Face names it: a biased `router`, fused experts."""

    def __init__(self, experts: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.router = nn.Linear(hidden, experts, bias=True)
        self.experts = _FusedExperts(experts, hidden, ffn)


def test_autoep_leaves_a_model_type_it_has_no_preset_for_unchanged(world, fresh_expert_groups):
    """Why the adapter refuses GPT-OSS: deepspeed.initialize with AutoEP on a gpt_oss-typed model raises nothing and
    swaps nothing, so every rank keeps every expert."""
    model = MixtralShaped(8, 4)
    for layer in model.model.layers:
        layer.mlp = _RoutedBlock(8, 16, 24)
    model.config.model_type = "gpt_oss"
    world.enter(16, 5)
    config = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 1}, "bf16": {"enabled": True},
              "expert_parallel": {"enabled": True, "autoep_size": 8, "expert_tensor_parallel_size": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    blocks = [m for name, m in engine.module.named_modules() if name.endswith(".mlp")]
    assert [type(m).__name__ for m in blocks] == ["_RoutedBlock"] * 2
    assert all(m.experts.gate_up_proj.shape[0] == 8 for m in blocks)


def test_adapter_refuses_a_mixture_autoep_has_no_preset_for():
    """GPT-OSS's MoE blocks match none of AutoEP's presets, and AutoEP leaves a model it does not recognize unchanged
    (no error): exported, every rank would hold every expert. The adapter refuses it by name."""
    plan = estimate_for(EstimateRequest.model_validate(estimate_request(
        {"tp": 1, "pp": 1, "dp": 8, "ep": 8, "recompute": "full"}, cluster={"num_nodes": 1, "gpus_per_node": 8,
                                                                           "gpu": "H100-SXM"},
        model="gpt-oss-20b", training={"global_batch_size": 8, "seq_length": 4096})))
    assert plan.ep == 8 and plan.architecture.attention_sinks
    with pytest.raises(ExportError, match="GPT-OSS-style mixture of experts .DeepSpeed 0.19's AutoEP has no preset"):
        ds_export.render(plan)


def test_autoep_without_expert_parallelism_keeps_every_expert_on_every_rank(world, fresh_expert_groups):
    """ep 1: the export still turns AutoEP on (its grouped GEMMs, the kernels the plan prices) and every swapped
    layer holds all the experts, its EP group the rank alone."""
    plan = _moe_plan({"tp": 1, "pp": 1, "dp": 32, "ep": 1}, zero_stage=3)
    document = exported(plan)
    assert document["expert_parallel"]["autoep_size"] == 1
    world.enter(32, 13)
    experts = plan.architecture.num_experts
    model = MixtralShaped(experts, plan.architecture.experts_per_token)
    script = {**copy.deepcopy(document), "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, config=script, model_parameters=model.parameters())
    swapped = [m for name, m in engine.module.named_modules() if name.endswith(".mlp")]
    assert [type(m).__name__ for m in swapped] == ["AutoEPMoELayer"] * 2
    for layer in swapped:
        weights = layer.experts.w1
        assert getattr(weights, "ds_shape", weights.shape)[0] == experts
    assert list(fresh_expert_groups._EXPERT_PARALLEL_GROUP_RANKS["ep_size_1"]) == [13]
