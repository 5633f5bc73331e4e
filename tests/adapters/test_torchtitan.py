"""The torchtitan export, checked by torchtitan 0.3's own code on CPU.

For real plans: torchtitan's ConfigManager parses the overrides into its
Trainer.Config (its __post_init__ checks run), ParallelDims accepts the
degrees, its device mesh (on a fake process group) puts every rank where
the plan put it, its pipeline code splits the model into the plan's layer
ranges and builds the schedule (named, or the plan's own from the CSV),
and the model config validates TP against the heads. Deliberately broken
overrides are refused by the same code; plans torchtitan cannot run are
refused by the adapter first.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import io
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    _PipelineScheduleRuntime,
    get_schedule_class,
)
from torch.testing._internal.distributed.fake_pg import FakeStore
from torchtitan.config import ConfigManager
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.distributed.fsdp import get_fsdp_reshard_after_forward_policy
from torchtitan.distributed.pipeline_parallel import (
    _build_pipeline_schedule,
    _generate_llm_fqn_per_model_part,
    _get_pipeline_metadata,
    _get_pp_rank_to_stage_indices_mapping,
    _split_module,
)
from torchtitan.models.common import ComplexRoPE
from torchtitan.models.llama3 import _build_llama3_layers, _debugmodel

from adapters import torch_csv
from adapters.registry import ExportError, export_format
from adapters.stock import stock_layout
from adapters.torchtitan_model import model_config as model_config_of
from adapters.torchtitan_model import model_spec
from adapters.torchtitan import (
    BUILTIN_CONFIGS,
    REQUIRED,
    SCHEDULE_CSV,
    launch_command,
    model_selection,
    module_fqns_per_model_part,
    override_argv,
    render,
    resolve_architecture,
    schedule_csv,
    torchtitan_overrides,
)
from api.tasks.planning import estimate_for, plan_for
from cost_models.model_spec import model_preset
from tests.adapters.support import _MockStage
from tests.api.support import estimate_request, small_request
from wire.schemas import EstimateRequest, ModelArchitecture, Plan, PlanRequest

A100_40 = {"num_nodes": 2, "gpus_per_node": 8, "gpu": "A100-40GB"}
ONE_NODE_40 = {"num_nodes": 1, "gpus_per_node": 8, "gpu": "A100-40GB"}
SLOW = {"slow": [{"device": "0:3", "speed": 0.5}]}
FAILED = {"failed": ["1:5"]}
STOCK = {"time_limit_s": 3, "allow_non_uniform": False}
H100 = {"num_nodes": 2, "gpus_per_node": 8, "gpu": "H100-SXM"}
COMPUTE = ("F", "B", "I", "W")  # PyTorch's compute actions; the schedules add REDUCE_GRAD, comms, (un)shards


def _request(model: str, batch: int, seq: int, options: dict, **extra) -> dict:
    training = {"global_batch_size": batch, "seq_length": seq, **extra.pop("training", {})}
    return small_request(model=model, training=training, options={**STOCK, **options}, **extra)


# Each solves to OPTIMAL in well under a second, so the plan does not depend on machine load.
REQUESTS = {
    # pp 4 x tp 2 x dp 2, 10 layers a stage: --pipeline_parallel_layers_per_stage
    "1f1b-even": _request("llama2-13b", 128, 4096, {"schedules": ["1f1b"]}, cluster=A100_40),
    # a slow GPU: 4 stages of tp 2, the slow group last with 2 layers; torchtitan's own llama3_8b config
    "1f1b-uneven-first": _request("llama3.1-8b", 32, 4096, {"schedules": ["1f1b"]}, cluster=ONE_NODE_40, failures=SLOW),
    # a failed GPU: 7 stages of tp 2 on 8 + 6 GPUs, the last stage 2 layers; selective recompute, no ZeRO
    "1f1b-uneven-last": _request("llama3-8b", 32, 4096, {}, failures=FAILED,
                                 training={"recompute": "selective", "zero_stage": 0}),
    "interleaved": _request("llama2-13b", 64, 4096, {"schedules": ["interleaved"]}),
    # breadth-first over looped chunks: torchtitan's LoopedBFS, by name
    "looped-bfs": _request("llama2-13b", 16, 4096, {"schedules": ["looped-bfs"]}),
    # GPipe holds every microbatch: 8 of them still fit beside 70B on 16 GPUs (less the memory reserve)
    # with full recompute
    "gpipe-full": _request("llama2-70b", 8, 4096, {"schedules": ["gpipe"]}),
    # pp 1: torchtitan accumulates the 4 microbatches as gradient-accumulation steps
    "no-pp-selective": _request("llama3-8b", 64, 8192, {"schedules": ["1f1b"]}, training={"recompute": "selective"}),
    # zero-bubble and optimized orders travel as the torch-csv export
    "zb-h1-uneven": _request("llama3-8b", 32, 4096, {"schedules": ["zb-h1"], "allow_non_uniform": True},
                             cluster=ONE_NODE_40, failures=SLOW),
    "optimized-uneven": _request("llama3-8b", 16, 4096, {"schedules": ["optimized"], "time_limit_s": 5},
                                 cluster=ONE_NODE_40, failures=SLOW),
    "optimized-interleaved": _request("llama2-70b", 16, 4096, {"schedules": ["optimized"], "time_limit_s": 8,
                                                                "allow_non_uniform": True}),
    # FP8 training on H100s: the same overrides, float8 linears from the config function
    "fp8-h100": _request("llama3-8b", 32, 8192, {"schedules": ["1f1b"]}, cluster=H100,
                         training={"precision": "fp8"}),
}
# ZeRO-3 as FSDP2 resharding after forward (pp 1, what torchtitan shards that way): a fixed layout, since the
# planner may pipeline where torchtitan cannot run ZeRO-3
ZERO3 = estimate_request({"tp": 1, "pp": 1, "dp": 32}, model="llama3-8b",
                         training={"global_batch_size": 64, "seq_length": 8192, "zero_stage": 3})
# Context parallelism: a fixed tp 2 x cp 2 x pp 2 layout (ZeRO-1), and one with no ZeRO and no pipeline, which
# torchtitan still runs FSDP over the CP ranks for
CONTEXT_PARALLEL = {
    "cp-pp": estimate_request({"tp": 2, "cp": 2, "pp": 2}, model="llama3-8b", cluster=H100,
                              training={"global_batch_size": 32, "seq_length": 8192}),
    "cp-zero0": estimate_request({"tp": 4, "cp": 2, "pp": 1}, model="llama3-8b", cluster=H100,
                                 training={"global_batch_size": 16, "seq_length": 16384, "zero_stage": 0}),
}
# Expert parallelism: Qwen3-30B-A3B (torchtitan's own qwen3_30b_a3b) with its 128 experts over 4 replicas, tp 1,
# and over the 8 GPUs of 4 tp-2 replicas with whole experts (etp 1: torchtitan never splits an expert over TP),
# and over the CP ranks of 4 cp-2 replicas, ZeRO-1 (its EP groups come from the FSDP and CP ranks)
EXPERT_PARALLEL = {
    "ep-pp": estimate_request({"tp": 1, "pp": 2, "ep": 4}, model="qwen3-30b-a3b", cluster=H100,
                              training={"global_batch_size": 32, "seq_length": 4096}),
    "ep-tp-etp1": estimate_request({"tp": 2, "pp": 2, "ep": 8, "etp": 1, "recompute": "full"},
                                   model="qwen3-30b-a3b", cluster=H100,
                                   training={"global_batch_size": 32, "seq_length": 4096}),
    "ep-cp": estimate_request({"tp": 1, "cp": 2, "pp": 2, "ep": 8, "recompute": "full"},
                              model="qwen3-30b-a3b", cluster=H100,
                              training={"global_batch_size": 32, "seq_length": 8192}),
}
# Hybrid sharding (HSDP): FSDP2 over torchtitan's (dp_replicate, dp_shard) mesh, shard groups of a node's replicas:
# ZeRO-3 without PP (llama3-8b, 32 A100s, what the search picks on them), ZeRO-1 under a tp 2 x pp 2 pipeline, and
# ZeRO-3 with Qwen3-30B-A3B's experts over ep 4 inside each shard group of 8 (its efsdp mesh: 2 ranks per expert
# block in a group, replicated across the 2 groups)
HYBRID = {
    "hsdp-ep": estimate_request({"tp": 1, "pp": 1, "dp": 16, "ep": 4, "dp_shard": 8, "recompute": "full"},
                                model="qwen3-30b-a3b", cluster=H100,
                                training={"global_batch_size": 32, "seq_length": 4096, "zero_stage": 3}),
    "hsdp-zero3": estimate_request({"tp": 1, "pp": 1, "dp": 32, "dp_shard": 8}, model="llama3-8b",
                                   training={"global_batch_size": 64, "seq_length": 8192, "zero_stage": 3}),
    "hsdp-zero1-pp": estimate_request({"tp": 2, "pp": 2, "dp": 8, "dp_shard": 4}, model="llama3-8b",
                                      training={"global_batch_size": 32, "seq_length": 8192}),
}
# Uneven model chunks (an estimate's layers_per_chunk): the embedding's and the loss's chunks one layer short
UNEVEN_CHUNKS = {
    "interleaved-uneven-chunks": estimate_request(
        {"tp": 1, "pp": 4, "virtual_stages": 2, "schedule": "interleaved", "recompute": "selective",
         "layers_per_chunk": [3, 4, 4, 5, 5, 4, 4, 3]},
        model="llama3-8b", training={"global_batch_size": 64, "seq_length": 4096}),
}
# PyTorch's asynchronous TP (training.tp_comm_overlap async_tp): torch.compile with the micro-pipeline TP pass
ASYNC_TP = {
    "async-tp": estimate_request({"tp": 2, "pp": 2}, model="llama3-8b", cluster=H100,
                                 training={"global_batch_size": 32, "seq_length": 8192, "tp_comm_overlap": "async_tp"}),
}
NON_UNIFORM = _request("llama3-8b", 32, 4096, {"schedules": ["1f1b"], "allow_non_uniform": True}, failures=FAILED)


@functools.cache
def real_plan(name: str) -> Plan:
    if name == "zero3-no-pp":
        return estimate_for(EstimateRequest.model_validate(ZERO3))
    if name in CONTEXT_PARALLEL:
        return estimate_for(EstimateRequest.model_validate(CONTEXT_PARALLEL[name]))
    if name in EXPERT_PARALLEL:
        return estimate_for(EstimateRequest.model_validate(EXPERT_PARALLEL[name]))
    if name in HYBRID:
        return estimate_for(EstimateRequest.model_validate(HYBRID[name]))
    if name in UNEVEN_CHUNKS:
        return estimate_for(EstimateRequest.model_validate(UNEVEN_CHUNKS[name]))
    if name in ASYNC_TP:
        return estimate_for(EstimateRequest.model_validate(ASYNC_TP[name]))
    body = NON_UNIFORM if name == "non-uniform" else REQUESTS[name]
    return plan_for(PlanRequest.model_validate(body))


CASES = [*sorted(REQUESTS), "zero3-no-pp", *CONTEXT_PARALLEL, *EXPERT_PARALLEL, *HYBRID, *UNEVEN_CHUNKS, *ASYNC_TP]


@pytest.fixture(params=CASES)
def case(request) -> str:
    return request.param


@pytest.fixture
def plan(case) -> Plan:
    return real_plan(case)


@functools.cache
def parsed_config(case: str):
    """torchtitan's Trainer.Config from the case's overrides; shared, so tests must not change it."""
    return parse(real_plan(case), override_argv(real_plan(case)))


@functools.cache
def meta_model(plan_case: str):
    """The torchtitan model for the case's architecture, on the meta device."""
    plan = real_plan(plan_case)
    with torch.device("meta"):
        return model_config(plan, parsed_config(plan_case)).build()


def base_args(plan: Plan) -> list[str]:
    """torchtitan's own config for the plan's model, else its small llama3 (the overrides do not depend on it)."""
    module, config = model_selection(plan) or ("llama3", "llama3_debugmodel")
    return ["--module", module, "--config", config]


def parse(plan: Plan, argv: list[str]):
    return ConfigManager().parse_args(base_args(plan) + argv)


def tiny_llama3(plan: Plan, tied: bool | None = None):
    """A torchtitan Llama3 model config with the plan's layer count and heads, every width tiny."""
    arch = plan.architecture
    config = _debugmodel("flex")
    head_dim = 8
    dim = arch.num_attention_heads * head_dim
    config.layers = _build_llama3_layers(
        n_layers=arch.num_layers, dim=dim, n_heads=arch.num_attention_heads, n_kv_heads=arch.num_kv_heads,
        hidden_dim=32, rope=ComplexRoPE.Config(dim=head_dim, max_seq_len=131072, theta=500000, scaling="llama"),
        attn_backend="flex",
    )
    config.dim = dim
    config.tok_embeddings.embedding_dim = dim
    config.norm.normalized_shape = dim
    config.lm_head.in_features = dim
    config.enable_weight_tying = arch.tied_embeddings if tied is None else tied
    return config


def model_config(plan: Plan, parsed):
    """The model torchtitan would build: its own for a built-in model, else the tiny stand-in."""
    return parsed.model_spec.model if model_selection(plan) else tiny_llama3(plan)


def flat(text: str) -> str:
    """tyro's boxed error text as one line."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())


def compute_rows(csv_text: str) -> list[list[str]]:
    return list(csv.reader(io.StringIO(csv_text)))


def build_schedule(parsed, layout, stages=None):
    """torchtitan's own schedule builder, for PP rank 0's stages (model-free stand-ins)."""
    p, v = layout.pp, layout.virtual_stages
    return _build_pipeline_schedule(
        parallelism=parsed.parallelism, local_batch_size=parsed.training.local_batch_size,
        stages=stages or [_MockStage(num_stages=p * v, group_size=p) for _ in range(v)],
        loss_fn=lambda *args, **kwargs: (None, None),
    )


class RecordingStage(_MockStage):
    """A stage whose compute only records itself and whose sends and receives are empty."""

    def __init__(self, stage_index: int, num_stages: int):
        super().__init__(num_stages=num_stages, group_size=num_stages, group_rank=stage_index)
        self.stage_index = stage_index
        self.actions: list[str] = []

    is_first = property(lambda self: self.stage_index == 0)
    is_last = property(lambda self: self.stage_index == self.num_stages - 1)

    def get_fwd_recv_ops(self, *args, **kwargs):
        return []

    get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = get_fwd_recv_ops

    def forward_one_chunk(self, microbatch, *args, **kwargs):
        self.actions.append(f"{self.stage_index}F{microbatch}")

    def backward_one_chunk(self, microbatch, *args, **kwargs):
        self.actions.append(f"{self.stage_index}B{microbatch}")

    def perform_reduce_grad(self, *args, **kwargs):
        pass


def executed_order(parsed, layout) -> list[list[str]]:
    """Per PP rank, the compute actions torchtitan's schedule runs.

    Multi-stage schedules (and the CSV runtime) execute their `pipeline_order`. Single-stage
    ones (1F1B, GPipe) run a hand-written loop instead, and their `pipeline_order` is only a
    description (PyTorch 2.13's 1F1B one is off by one microbatch on the last stage), so
    their loop is run for real on recording stages.
    """
    schedule = build_schedule(parsed, layout)
    assert schedule._n_microbatches == layout.num_microbatches
    if isinstance(schedule, PipelineScheduleMulti):
        return [[str(a) for a in schedule.pipeline_order[rank] if a is not None and a.computation_type.value in COMPUTE]
                for rank in range(layout.pp)]
    rows = []
    for rank in range(layout.pp):
        stage = RecordingStage(rank, layout.pp)
        schedule = build_schedule(parsed, layout, [stage])
        schedule._initialize_stage = lambda *args, **kwargs: None  # shape inference needs a model
        schedule._step_microbatches(target_mbs=[None] * layout.num_microbatches, losses=[])
        rows.append(stage.actions)
    return rows


@pytest.fixture
def in_tmp(tmp_path, monkeypatch) -> Path:
    """Run in tmp_path, with the plan's schedule CSV where torchtitan is told to read it."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def fake_world():
    """A one-process fake process group of any world size, for torchtitan's device mesh."""
    def init(world_size: int) -> None:
        dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------
# Accepted: every real plan's overrides go through torchtitan's own config, mesh, pipeline and model code


def test_the_cases_cover_every_mapping():
    """Guards the coverage the cases were chosen for, should the planner answer them differently."""
    layouts = {case: stock_layout(real_plan(case), "torchtitan") for case in CASES}
    renders = {case: render(real_plan(case)) for case in CASES}
    assert {layout.recompute for layout in layouts.values()} == {"none", "selective", "full"}
    assert {layout.zero_stage for layout in layouts.values()} == {0, 1, 3}
    assert {(layout.cp > 1, layout.zero_stage, layout.pp > 1) for layout in layouts.values() if layout.cp > 1} >= {
        (True, 1, True), (True, 0, False)}
    assert {layout.schedule for layout in layouts.values() if layout.pp > 1} >= {
        "1f1b", "gpipe", "interleaved", "looped-bfs", "zb-h1", "optimized"}
    assert any(layout.pp == 1 and layout.num_microbatches > 1 for layout in layouts.values())
    csv_v = {layouts[case].virtual_stages for case in REQUESTS if schedule_csv(real_plan(case))}
    assert 1 in csv_v and max(csv_v) > 1
    assert any("layers_per_stage" in text for text in renders.values())
    assert any("module_fqns_per_model_part" in text for text in renders.values())
    assert any(layout.uneven and layout.layers_per_stage[0] != layout.layers_per_stage[1] for layout in layouts.values())
    assert any(layout.uneven and layout.layers_per_stage[-1] != layout.layers_per_stage[-2] for layout in layouts.values())
    assert any(len(layout.nodes) > 1 for layout in layouts.values())
    assert any(layout.ep > 1 and layout.pp > 1 for layout in layouts.values())
    assert {layout.zero_stage for layout in layouts.values() if layout.shard_groups > 1 and layout.zero_stage} == {1, 3}


def test_render_is_the_overrides_one_per_line(plan):
    text = render(plan, None)
    lines = text.rstrip("\n").split("\n")
    assert lines == torchtitan_overrides(plan)
    assert shlex.split(text) == override_argv(plan)
    assert lines[-1].startswith("activation_checkpoint:")  # tyro's subcommand: anything after it belongs to it
    assert export_format("torchtitan").render(plan, None) == text


def test_config_manager_parses_the_plans_values(case, plan):
    layout = stock_layout(plan, "torchtitan")
    parsed = parsed_config(case)
    par, training = parsed.parallelism, parsed.training
    assert (par.tensor_parallel_degree, par.pipeline_parallel_degree) == (layout.tp, layout.pp)
    assert (par.context_parallel_degree, par.expert_parallel_degree) == (layout.cp, layout.ep)
    if layout.zero_stage >= 1:  # FSDP over the shard group: parameters whole within a step (ZeRO-1) or not (ZeRO-3)
        shard = plan.dp_shard or layout.dp
        assert (par.data_parallel_shard_degree, par.data_parallel_replicate_degree) == (shard, layout.dp // shard)
    else:
        assert (par.data_parallel_shard_degree, par.data_parallel_replicate_degree) == (1, layout.dp)
    if layout.zero_stage >= 1 or layout.cp > 1:  # torchtitan runs FSDP (over dp_shard x cp) whenever cp > 1
        # torchtitan's own reading of the policy: FSDP2 reshards after forward exactly for ZeRO-3
        resharded = get_fsdp_reshard_after_forward_policy(par.fsdp_reshard_after_forward, layout.pp > 1)
        assert resharded == (layout.zero_stage == 3)
    assert par.pipeline_parallel_microbatch_size == layout.micro_batch_size
    assert training.seq_len == layout.seq_length
    assert training.global_batch_size == layout.global_batch_size
    # torchtitan's arithmetic (Trainer.__init__): accumulation steps and pipeline microbatches per step
    accumulation = training.global_batch_size // (training.local_batch_size * layout.dp)
    assert training.global_batch_size % (training.local_batch_size * layout.dp) == 0
    if layout.pp > 1:
        assert accumulation == 1
        assert training.local_batch_size // par.pipeline_parallel_microbatch_size == layout.num_microbatches
    else:
        assert accumulation == layout.num_microbatches
    assert training.disable_cuda_graphs == (layout.pp > 1 or layout.ep > 1)
    assert training.mixed_precision_param == "bfloat16" and training.dtype == "float32"
    assert par.enable_sequence_parallel
    expected_ac = {"none": type(None), "selective": SelectiveAC.Config, "full": FullAC.Config}[layout.recompute]
    assert type(parsed.activation_checkpoint) is expected_ac
    if layout.pp > 1 and layout.schedule in ("zb-h1", "zb-h2", "optimized"):
        assert par.pipeline_parallel_schedule_csv == SCHEDULE_CSV
    elif layout.pp > 1:
        assert par.pipeline_parallel_schedule == {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B",
                                                  "looped-bfs": "LoopedBFS"}[layout.schedule]
        assert not par.pipeline_parallel_schedule_csv


def test_parallel_dims_and_mesh_place_every_rank_where_the_plan_did(case, plan, fake_world):
    layout = stock_layout(plan, "torchtitan")
    parsed = parsed_config(case)
    dims = ParallelDims.from_config(parsed.parallelism, world_size=layout.world_size)  # validates in __post_init__
    assert (dims.tp, dims.pp, dims.dp_replicate * dims.dp_shard, dims.cp) == (layout.tp, layout.pp, layout.dp, layout.cp)
    assert dims.world_size == layout.world_size == sum(len(s.devices) for r in plan.replicas for s in r.stages)

    fake_world(layout.world_size)
    dims.build_mesh()
    # rank 0's groups along each axis give the axis strides of torchtitan's (pp, dp, cp, tp) mesh
    strides = {}
    for axis, name, size in (("tp", "tp", layout.tp), ("cp", "cp", layout.cp), ("dp", "batch", layout.dp),
                             ("pp", "pp", layout.pp)):
        strides[axis] = dims.get_mesh(name).mesh.tolist()[1] if size > 1 else 0
        if size > 1:
            assert dims.get_mesh(name).mesh.tolist() == [i * strides[axis] for i in range(size)]
    replicas = sorted(plan.replicas, key=lambda r: r.id)
    for rank, device in enumerate(layout.rank_devices):
        tp_i = rank // strides["tp"] % layout.tp if layout.tp > 1 else 0
        cp_i = rank // strides["cp"] % layout.cp if layout.cp > 1 else 0
        dp_i = rank // strides["dp"] % layout.dp if layout.dp > 1 else 0
        pp_i = rank // strides["pp"] % layout.pp if layout.pp > 1 else 0
        assert replicas[dp_i].stages[pp_i].devices[cp_i * layout.tp + tp_i] == device, f"rank {rank}"
    shard = plan.dp_shard if layout.zero_stage >= 1 and plan.dp_shard else layout.dp
    if layout.zero_stage >= 1 and shard < layout.dp:
        # hybrid sharding: FSDP shards over dp_shard (x cp, whose axis is checked above) and replicates over
        # dp_replicate (torchtitan.distributed.full_dtensor.resolve_fsdp_mesh): rank 0's dp_shard group is the
        # first stage's TP rank 0 of the plan's first shard group, replicas 0..dp_shard-1; its replicate group
        # the same place in every shard group
        group = [layout.rank_devices[rank] for rank in dims.get_mesh("dp_shard").mesh.tolist()]
        assert group == [replicas[i].stages[0].devices[0] for i in range(shard)]
        replicate = [layout.rank_devices[rank] for rank in dims.get_mesh("dp_replicate").mesh.tolist()]
        assert replicate == [replicas[i].stages[0].devices[0] for i in range(0, layout.dp, shard)]
    if layout.ep > 1:
        # torchtitan's EP group of rank 0 holds the first ep GPUs of the plan's first stage, which share its experts
        # (every TP and CP rank of the first replicas); the experts' FSDP group is the other ranks holding the same
        # experts
        # (its ranks over tp, then cp, then replicas, as megatron-core's expert order with etp 1)
        stage_gpus = layout.tp * layout.cp
        group = dims.get_mesh("ep").mesh.tolist()
        assert [layout.rank_devices[rank] for rank in group] == [
            replicas[q // stage_gpus].stages[0].devices[q % stage_gpus] for q in range(layout.ep)]
        # with hybrid sharding, inside the shard group: the groups replicate the experts as they do the rest
        assert dims.get_mesh("efsdp").size() == shard * stage_gpus // layout.ep
        if shard < layout.dp:
            efsdp = [layout.rank_devices[rank] for rank in dims.get_mesh("efsdp").mesh.tolist()]
            assert efsdp == [replicas[i].stages[0].devices[0] for i in range(0, shard, layout.ep // stage_gpus)]


def test_model_config_accepts_tp_and_seq_len(plan):
    parsed = parse(plan, override_argv(plan))  # its own: update_from_config changes the model config
    model = model_config(plan, parsed)
    model.update_from_config(config=parsed)  # TP divides heads and KV heads, seq_len within RoPE, no tying under PP
    assert len(model.layers) == plan.architecture.num_layers


def test_pipeline_split_is_the_plans(case, plan):
    layout = stock_layout(plan, "torchtitan")
    if layout.pp == 1:
        assert not any("pipeline_parallel_schedule" in line or "module_fqns" in line for line in render(plan).split("\n"))
        return
    parsed = parsed_config(case)
    par = parsed.parallelism
    dims = ParallelDims.from_config(par, world_size=layout.world_size)
    # exactly what torchtitan's pipeline_llm does to choose each model part's modules
    num_parts, num_layers, first_less, last_less = _get_pipeline_metadata(dims, par, model_config(plan, parsed))
    parts = par.module_fqns_per_model_part or _generate_llm_fqn_per_model_part(
        num_parts, num_layers, first_less, last_less)
    assert parts == module_fqns_per_model_part(layout)
    p, v = layout.pp, layout.virtual_stages
    assert len(parts) == p * v
    names = [fqn for part in parts for fqn in part]
    assert names == ["tok_embeddings"] + [f"layers.{i}" for i in range(num_layers)] + ["norm", "lm_head"]
    for rank in range(p):
        local = _get_pp_rank_to_stage_indices_mapping(rank, p, par.pipeline_parallel_schedule, len(parts))
        assert local == tuple(rank + c * p for c in range(v))  # the looped placement the plan's chunks assume
        held = sum(1 for i in local for fqn in parts[i] if fqn.startswith("layers."))
        assert held == layout.layers_per_stage[rank]
    # each part holds the layers of the plan's model chunk: a stage's chunk_layers, else its layers / v
    stages = plan.replicas[0].stages
    planned = [stages[i % p].chunk_layers[i // p] if stages[i % p].chunk_layers is not None
               else (stages[i % p].layers[1] - stages[i % p].layers[0]) // v for i in range(p * v)]
    assert [sum(fqn.startswith("layers.") for fqn in part) for part in parts] == planned
    # the names are the real model's modules
    whole = meta_model(case)
    modules = {name for name, _ in whole.named_children()} | {f"layers.{name}" for name, _ in whole.layers.named_children()}
    assert set(names) <= modules


def test_torchtitans_splitter_keeps_exactly_each_parts_modules():
    case = "1f1b-uneven-first"
    parts = parsed_config(case).parallelism.module_fqns_per_model_part
    assert parts is not None and len(parts) == len(real_plan(case).replicas[0].stages)
    for index, part in enumerate(parts):
        chunk = _split_module(meta_model(case), part)
        assert [f"layers.{name}" for name, _ in chunk.layers.named_children()] == [f for f in part if f.startswith("layers.")]
        assert (chunk.tok_embeddings is not None) == (index == 0)
        assert (chunk.norm is not None) == (chunk.lm_head is not None) == (index == len(parts) - 1)


def test_torchtitan_runs_the_plans_schedule(case, plan, in_tmp):
    layout = stock_layout(plan, "torchtitan")
    if layout.pp == 1:
        return
    text = schedule_csv(plan)
    if text is not None:
        (in_tmp / SCHEDULE_CSV).write_text(text)
    parsed = parsed_config(case)
    schedule = build_schedule(parsed, layout)
    if text is not None:
        assert type(schedule) is _PipelineScheduleRuntime  # loaded and validated by _load_csv
    else:
        assert type(schedule) is get_schedule_class(parsed.parallelism.pipeline_parallel_schedule)
    # what torchtitan runs is the plan's own order, action for action
    assert executed_order(parsed, layout) == compute_rows(torch_csv.render(plan, None))


def test_launch_command_runs_every_rank_on_its_device(plan, tmp_path):
    layout = stock_layout(plan, "torchtitan")
    calls = run_launch(plan, tmp_path)
    nnodes = {int(call["args"]["--nnodes"]) for call in calls}
    assert nnodes == {len(calls)}
    base = 0
    for node_rank, call in enumerate(sorted(calls, key=lambda c: int(c["args"]["--node_rank"]))):
        assert int(call["args"]["--node_rank"]) == node_rank
        nproc = int(call["args"]["--nproc_per_node"])
        visible = call["visible"] or list(range(nproc))
        devices = layout.rank_devices[base:base + nproc]
        assert len({d.split(":")[0] for d in devices}) == 1, f"node rank {node_rank} spans nodes: {devices}"
        assert [int(d.split(":")[1]) for d in devices] == visible[:nproc]
        base += nproc
        if len(calls) > 1:
            assert call["args"]["--master_addr"] == "10.0.0.1"
        # the words torchtitan gets after bash: the model, the overrides the other tests parse, and the
        # required settings from the environment, before the activation-checkpoint subcommand
        overrides = override_argv(plan)
        assert call["train"] == base_args(plan) + overrides[:-1] + REQUIRED_ARGV + overrides[-1:]
    assert base == layout.world_size
    text = schedule_csv(plan)
    if text is not None:
        assert (tmp_path / SCHEDULE_CSV).read_text() == text  # the here-document wrote what torchtitan reads


REQUIRED_VALUES = {"HF_ASSETS_PATH": "/data/tokenizer dir", "DATASET": "c4_test", "TRAIN_STEPS": "7", "LR": "0.0003"}
REQUIRED_ARGV = [word for setting in REQUIRED for word in (setting.flag, REQUIRED_VALUES[setting.variable])]
STUB = 'torchrun() { { echo "VISIBLE=${CUDA_VISIBLE_DEVICES-}"; printf "%s\\n" "$@"; echo "--END--"; } >> calls.txt; }\n'


def run_launch(plan: Plan, cwd: Path) -> list[dict]:
    """Run the launch lines in bash, `torchrun` stubbed to record its arguments and CUDA_VISIBLE_DEVICES.

    A single line for all nodes runs once per NODE_RANK; per-node lines run once.
    """
    def run(node_rank: int) -> list[dict]:
        (cwd / "calls.txt").unlink(missing_ok=True)
        env = {"PATH": "/usr/bin:/bin", "MASTER_ADDR": "10.0.0.1", "NODE_RANK": str(node_rank),
               "TORCHTITAN_MODULE": "llama3", "TORCHTITAN_CONFIG": "llama3_debugmodel", **REQUIRED_VALUES}
        subprocess.run(["bash", "-euc", STUB + launch_command(plan)], cwd=cwd, env=env, check=True)
        calls = []
        for block in (cwd / "calls.txt").read_text().split("--END--\n")[:-1]:
            visible, *words = block.rstrip("\n").split("\n")
            visible = visible.removeprefix("VISIBLE=")
            split = words.index("-m")
            assert words[split + 1] == "torchtitan.train"
            args = dict(word.split("=", 1) for word in words[:split] if "=" in word)
            if "--standalone" in words[:split]:
                args.setdefault("--node_rank", "0")
            calls.append({"visible": [int(g) for g in visible.split(",")] if visible else None,
                          "args": args, "train": words[split + 2:]})
        return calls

    calls = run(0)
    nodes = int(calls[0]["args"]["--nnodes"])
    if len(calls) == 1 and nodes > 1:
        calls += [call for node_rank in range(1, nodes) for call in run(node_rank)]
    return calls


def test_launch_uses_torchtitans_own_llama3_config():
    plan = real_plan("1f1b-uneven-first")
    assert model_selection(plan) == ("llama3", "llama3_8b")
    assert "--module llama3 --config llama3_8b" in launch_command(plan)
    other = real_plan("1f1b-even")  # llama2-13b: torchtitan has no config for it
    assert model_selection(other) is None
    assert '"${TORCHTITAN_MODULE:?' in launch_command(other)


def test_an_fp8_plan_gets_torchtitans_float8_converter_on_every_layer_linear():
    plan = real_plan("fp8-h100")
    assert plan.precision == "fp8"
    # torchtitan's llama3_8b trains in bf16: the launch names the user's config function instead
    assert model_selection(plan) is None
    command = launch_command(plan)
    assert '"${TORCHTITAN_MODULE:?' in command and "model_spec(plan.architecture, float8=True)" in command
    # torchtitan's own converter (torchao's Float8Linear, emulated on CPU) on the plan's architecture, and on a
    # Qwen3 one (torchtitan's qwen3 spec)
    qwen3 = resolve_architecture("qwen3-8b")
    for arch, family in ((plan.architecture, "llama3"), (qwen3, "qwen3")):
        spec = model_spec(arch, float8=True, emulate=True)
        assert spec.name == family
        plain = model_spec(arch)
        kinds = {path: type(value).__qualname__ for path, value in _linear_configs(spec.model)}
        assert kinds and {path for path, _ in _linear_configs(plain.model)} == set(kinds)
        assert kinds.pop("lm_head") == "Linear.Config"  # the output head stays bf16, as the plan prices it
        assert set(kinds.values()) == {"Float8Linear.Config"}
        assert any(path.startswith("layers.") and path.endswith("w2") for path in kinds)


def _linear_configs(config, path: str = ""):
    """(path, config) of every Linear config (plain or float8) inside a torchtitan model config."""
    if type(config).__qualname__ in ("Linear.Config", "Float8Linear.Config"):
        yield path, config
        return
    if dataclasses.is_dataclass(config):
        for field in dataclasses.fields(config):
            yield from _linear_configs(getattr(config, field.name), f"{path}.{field.name}".lstrip("."))
    elif isinstance(config, (list, tuple)) and config and dataclasses.is_dataclass(config[0]):
        yield from _linear_configs(config[0], f"{path}.0")


@pytest.mark.parametrize(("selection", "preset"), sorted(BUILTIN_CONFIGS.items()))
def test_builtin_configs_build_the_preset_they_are_chosen_for(selection, preset):
    """torchtitan's own config function builds the preset's model: its parameters, one by one, RoPE, norms,
    biases and tying, as the model resiplan's own spec of the preset builds."""
    parsed = ConfigManager().parse_args(["--module", selection[0], "--config", selection[1]])
    model = parsed.model_spec.model
    spec = model_preset(preset)
    ours = model_config_of(resolve_architecture(preset))
    with torch.device("meta"):
        built, planned = model.build(), ours.build()
    assert {name: p.shape for name, p in built.named_parameters()} == {
        name: p.shape for name, p in planned.named_parameters()}
    assert sum(p.numel() for p in built.parameters()) == spec.total_params
    assert any(name.endswith(".bias") for name, _ in built.named_parameters()) == (spec.linear_bias or spec.qkv_bias)
    assert (len(model.layers), model.dim, model.vocab_size, model.enable_weight_tying) == (
        spec.num_layers, spec.hidden_size, spec.vocab_size, spec.tied_embeddings)
    rope, our_rope = model.layers[0].attention.rope, ours.layers[0].attention.rope
    assert rope.theta == spec.rope_theta
    for field in ("scaling", "scaling_factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
                  "rope_factor", "beta_fast", "beta_slow", "original_seq_len", "truncate"):
        assert getattr(rope, field, None) == getattr(our_rope, field, None), field
    assert getattr(rope, "scaling", "none") == {None: "none", "llama3": "llama", "yarn": "yarn"}[
        spec.rope_scaling and spec.rope_scaling.rope_type]
    norms = {model.layers[0].attention_norm.eps, model.norm.eps}
    if spec.qk_norm:
        norms.add(model.layers[0].attention.qk_norm.eps)
    assert norms == {spec.norm_epsilon}
    if spec.num_experts:  # the last layer: DeepSeek-V3's first ones are dense
        moe = model.layers[-1].moe
        assert (moe.num_experts, moe.router.top_k) == (spec.num_experts, spec.experts_per_token)


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_torchtitans_expert_parallelism_holds_the_experts_the_memory_model_counts(ep, fake_world):
    """A Qwen3 mixture of experts built from resiplan's spec and parallelized by torchtitan's own qwen3 code
    on 8 ranks (FSDP 8, expert parallelism `ep`, tp 1, as the export asks): each rank holds num_experts / ep
    whole experts, the share `cost_models.expert_parallel.layer_params_per_gpu` gives a GPU (FSDP then
    shards them further between steps, which the ZeRO-1 memory model does not count on)."""
    from cost_models.expert_parallel import layer_params_per_gpu
    from cost_models.model_spec import ModelSpec

    spec = ModelSpec("tiny-qwen3-moe", num_layers=2, hidden_size=256, ffn_hidden_size=64, num_attention_heads=4,
                     num_kv_heads=2, vocab_size=1024, swiglu=True, tied_embeddings=False, norm_epsilon=1e-6,
                     rope_theta=1e6, num_experts=16, experts_per_token=4, head_dim=128, qk_norm=True)
    arch = ModelArchitecture.model_validate(dataclasses.asdict(spec))
    parsed = ConfigManager().parse_args(["--module", "qwen3", "--config", "qwen3_debugmodel",
                                         "--parallelism.data_parallel_shard_degree", "8",
                                         "--parallelism.expert_parallel_degree", str(ep), "--training.seq_len", "256"])
    dims = ParallelDims.from_config(parsed.parallelism, world_size=8)
    fake_world(8)
    dims.build_mesh()
    config = model_config_of(arch)
    config.update_from_config(config=parsed)
    with torch.device("meta"):
        model = config.build()
    model.parallelize(dims)
    layer = dict(model.layers.named_children())["0"]
    local = {name: (p.to_local() if hasattr(p, "to_local") else p).numel() for name, p in layer.named_parameters()}
    experts = sum(n for name, n in local.items() if ".routed_experts." in name)
    assert experts == spec.routed_expert_params_per_layer / ep
    assert sum(local.values()) == layer_params_per_gpu(spec, 1, ep)


def test_torchtitans_hybrid_sharding_holds_the_share_the_memory_model_counts(fake_world, monkeypatch):
    """torchtitan's own llama3 parallelize function (FSDP2 included) on 8 ranks as a hybrid-sharded plan exports
    them (replicate 2 x shard 4, ZeRO-3): each rank holds a quarter of every layer, replicated over the other
    group, the 1/dp_shard share `cost_models.memory` counts for sharded state (`state_bytes_per_param(3, 4)`:
    weights 2/4 bytes each), not the 1/8 full sharding would give. On a CPU fake process group torchtitan's
    default SPMD backend wants every parameter a DTensor before FSDP (which its GPU path makes); its
    `partial_dtensor` backend shards the same FSDP2 way over the same (dp_replicate, dp_shard) ranks."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torch.distributed.tensor import Replicate, Shard

    from cost_models.memory import WEIGHT_BYTES_PER_PARAM, state_bytes_per_param

    parsed = ConfigManager().parse_args(["--module", "llama3", "--config", "llama3_debugmodel",
                                         "--parallelism.data_parallel_replicate_degree", "2",
                                         "--parallelism.data_parallel_shard_degree", "4",
                                         "--parallelism.fsdp_reshard_after_forward", "always",
                                         "--parallelism.spmd_backend", "partial_dtensor",
                                         "--training.seq_len", "256"])
    dims = ParallelDims.from_config(parsed.parallelism, world_size=8)
    fake_world(8)
    monkeypatch.setattr(parallel_dims_module, "device_type", "cpu")  # FSDP2 takes its device from the mesh's
    dims.build_mesh()
    config = parsed.model_spec.model
    config.update_from_config(config=parsed)
    with torch.device("meta"):
        model = config.build()
    whole = {name: p.numel() for name, p in dict(model.layers.named_children())["0"].named_parameters()}
    model = parsed.model_spec.parallelize_fn(
        model, parallel_dims=dims, training=parsed.training, parallelism=parsed.parallelism,
        compile_config=parsed.compile, ac_config=parsed.activation_checkpoint, dump_folder=parsed.dump_folder)
    layer = dict(model.layers.named_children())["0"]
    placements = {tuple(p.placements) for p in layer.parameters()}
    assert placements == {(Replicate(), Shard(0))}  # replicated across groups, sharded inside each
    local = {name: p.to_local().numel() for name, p in layer.named_parameters()}
    assert local.keys() == whole.keys()
    assert sum(local.values()) == sum(whole.values()) / 4
    share = sum(local.values()) / sum(whole.values())
    # what ZeRO-3 saves over ZeRO-2 on a shard group of 4: the weights beyond the held share
    assert state_bytes_per_param(2, 4) - state_bytes_per_param(3, 4) == WEIGHT_BYTES_PER_PARAM * (1 - share)


def test_llama3_without_scaling_is_not_torchtitans_llama3_1():
    """Meta-Llama-3-8B has the shape of torchtitan's llama3_8b but no RoPE scaling: a config of the user's."""
    plan = real_plan("1f1b-uneven-first")
    llama3 = plan.model_copy(update={"architecture": plan.architecture.model_copy(update={"rope_scaling": None})})
    assert model_selection(plan) == ("llama3", "llama3_8b")
    assert model_selection(llama3) is None


def test_launch_lines_quote_plan_supplied_text(tmp_path):
    plan = real_plan("1f1b-even")
    hostile = plan.model_copy(update={
        "plan_id": "x\ntouch pwned-id",
        "architecture": plan.architecture.model_copy(update={"name": 'a}"; touch pwned-name; echo "'}),
    })
    calls = run_launch(hostile, tmp_path)
    assert calls and not list(tmp_path.glob("pwned*"))


def test_uneven_interleaved_parts_follow_the_looped_placement():
    layout = stock_layout(real_plan("interleaved"), "torchtitan")  # 2 stages x v chunks
    v, total = layout.virtual_stages, sum(layout.layers_per_stage)
    assert len(layout.layers_per_stage) == 2 and v > 1
    # the most even uneven split whose stages both cut into v chunks (v = 4 of 40 layers: 16 + 24, 4 + 6 a chunk)
    first = max(a for a in range(v, total // 2, v) if (total - a) % v == 0)
    layout = dataclasses.replace(layout, layers_per_stage=(first, total - first))
    parts = module_fqns_per_model_part(layout)
    assert [sum(f.startswith("layers.") for f in part) for part in parts] == [first // v, (total - first) // v] * v
    for rank in range(2):
        local = _get_pp_rank_to_stage_indices_mapping(rank, 2, "Interleaved1F1B", len(parts))
        assert sum(f.startswith("layers.") for i in local for f in parts[i]) == layout.layers_per_stage[rank]
    with pytest.raises(ExportError, match=f"do not split into virtual_stages={v} equal chunks"):
        module_fqns_per_model_part(dataclasses.replace(layout, layers_per_stage=(first + 1, total - first - 1)))


def test_interleaved_with_named_schedule_not_csv():
    plan = real_plan("interleaved")
    assert plan.virtual_stages > 1 and schedule_csv(plan) is None
    assert "--parallelism.pipeline_parallel_schedule Interleaved1F1B" in render(plan)


def test_uneven_split_spelled_as_module_fqns():
    plan = real_plan("1f1b-uneven-first")
    stages = plan.replicas[0].stages
    assert len({end - start for start, end in (stage.layers for stage in stages)}) > 1  # uneven
    line = next(line for line in render(plan).split("\n") if line.startswith("--parallelism.module_fqns_per_model_part"))
    expected = []
    for index, stage in enumerate(stages):
        names = ["tok_embeddings"] if index == 0 else []
        names += [f"layers.{i}" for i in range(*stage.layers)]
        names += ["norm", "lm_head"] if index == len(stages) - 1 else []
        expected.append(",".join(names))
    assert line.split()[1:] == expected


# ---------------------------------------------------------------------------------------------------------------
# Refused: broken overrides by torchtitan's own checks, unrunnable plans by the adapter


def _replace(argv: list[str], option: str, value: str) -> list[str]:
    argv = list(argv)
    argv[argv.index(option) + 1] = value
    return argv


def test_torchtitan_refuses_degrees_that_miss_the_world_size():
    plan = real_plan("1f1b-even")
    layout = stock_layout(plan, "torchtitan")
    argv = _replace(override_argv(plan), "--parallelism.data_parallel_shard_degree", str(layout.dp + 1))
    parsed = parse(plan, argv)
    with pytest.raises(AssertionError, match="Invalid parallel dims"):
        ParallelDims.from_config(parsed.parallelism, world_size=layout.world_size)


def test_torchtitan_refuses_a_batch_the_microbatch_does_not_divide(capsys):
    plan = real_plan("1f1b-even")
    argv = _replace(override_argv(plan), "--parallelism.pipeline_parallel_microbatch_size",
                    str(stock_layout(plan, "torchtitan").num_microbatches + 1))
    with pytest.raises(SystemExit):
        parse(plan, argv)
    assert "must be evenly divisible by parallelism.pipeline_parallel_microbatch_size" in flat(capsys.readouterr().err)


def test_torchtitan_refuses_pipelining_with_cuda_graphs(capsys):
    plan = real_plan("1f1b-even")
    argv = [word for word in override_argv(plan) if word != "--training.disable_cuda_graphs"]
    with pytest.raises(SystemExit):
        parse(plan, argv)
    assert "CUDA graphs do not support pipeline parallelism" in flat(capsys.readouterr().err)


def test_torchtitan_refuses_expert_parallelism_with_cuda_graphs(capsys):
    """Without pipelining, the flag is there for the experts: torchtitan's all-to-all dispatcher synchronizes
    with the CPU, which CUDA graphs cannot capture."""
    plan = real_plan("hsdp-ep")
    assert plan.ep > 1 and len(plan.replicas[0].stages) == 1
    argv = [word for word in override_argv(plan) if word != "--training.disable_cuda_graphs"]
    with pytest.raises(SystemExit):
        parse(plan, argv)
    assert "CUDA graphs support only expert parallel token dispatcher" in flat(capsys.readouterr().err)


def test_torchtitan_refuses_options_after_the_checkpoint_subcommand(capsys):
    plan = real_plan("1f1b-even")
    argv = override_argv(plan)
    with pytest.raises(SystemExit):
        parse(plan, argv[-1:] + argv[:-1])
    assert "Unrecognized options" in flat(capsys.readouterr().err)


def test_torchtitan_refuses_tp_that_does_not_divide_the_heads():
    plan = real_plan("1f1b-even")  # llama2-13b: 40 heads
    argv = _replace(override_argv(plan), "--parallelism.tensor_parallel_degree", "3")
    parsed = parse(plan, argv)
    with pytest.raises(ValueError, match=r"tensor_parallel_degree \(3\) must divide n_heads \(40\)"):
        tiny_llama3(plan).update_from_config(config=parsed)


def test_torchtitan_refuses_tied_embeddings_under_pp():
    plan = real_plan("1f1b-even")
    parsed = parse(plan, override_argv(plan))
    with pytest.raises(NotImplementedError, match="Weight tying is not supported with Pipeline Parallel"):
        tiny_llama3(plan, tied=True).update_from_config(config=parsed)
    tied = plan.model_copy(update={"architecture": plan.architecture.model_copy(update={"tied_embeddings": True})})
    with pytest.raises(ExportError, match="tie embeddings under pipeline parallelism"):
        render(tied)


def test_torchtitan_refuses_a_wrong_layers_per_stage():
    plan = real_plan("interleaved")  # 2 stages x 4 chunks of 5 layers
    layout = stock_layout(plan, "torchtitan")
    per_rank = str(plan.architecture.num_layers // layout.pp)  # one chunk per rank: not interleaved
    argv = _replace(override_argv(plan), "--parallelism.pipeline_parallel_layers_per_stage", per_rank)
    parsed = parse(plan, argv)
    dims = ParallelDims.from_config(parsed.parallelism, world_size=layout.world_size)
    with pytest.raises(ValueError, match="Multi-stage schedule requires at least 2 stages per rank"):
        _get_pipeline_metadata(dims, parsed.parallelism, tiny_llama3(plan))


def test_torchtitan_refuses_interleaving_an_uneven_microbatch_count():
    plan = real_plan("interleaved")
    layout = stock_layout(plan, "torchtitan")
    odd = layout.pp * 2 + 1  # not a multiple of Interleaved1F1B's rounds
    argv = _replace(override_argv(plan), "--training.local_batch_size", str(odd * layout.micro_batch_size))
    argv = _replace(argv, "--training.global_batch_size", str(odd * layout.micro_batch_size * layout.dp))
    with pytest.raises(ValueError, match="multiple of the number of rounds"):
        build_schedule(parse(plan, argv), layout)


def test_torchtitan_refuses_a_csv_for_other_microbatches(in_tmp):
    plan = real_plan("zb-h1-uneven")
    layout = stock_layout(plan, "torchtitan")
    (in_tmp / SCHEDULE_CSV).write_text(schedule_csv(plan))
    fewer = layout.num_microbatches - 1
    argv = _replace(override_argv(plan), "--training.local_batch_size", str(fewer * layout.micro_batch_size))
    argv = _replace(argv, "--training.global_batch_size", str(fewer * layout.micro_batch_size * layout.dp))
    with pytest.raises(AssertionError, match="microbatch"):
        build_schedule(parse(plan, argv), layout)
    (in_tmp / SCHEDULE_CSV).unlink()
    with pytest.raises(FileNotFoundError):
        build_schedule(parse(plan, override_argv(plan)), layout)


def test_torchtitan_refuses_zero3_under_pipeline_parallelism():
    body = estimate_request({"tp": 1, "pp": 2, "dp": 16}, model="llama3-8b",
                            training={"global_batch_size": 64, "seq_length": 8192, "zero_stage": 3})
    plan = estimate_for(EstimateRequest.model_validate(body))
    with pytest.raises(ExportError, match="zero_stage 3 with pp 2: torchtitan's pipeline runtime keeps gradients whole"):
        torchtitan_overrides(plan)


@pytest.mark.parametrize(("layout", "training", "refused"), [
    ({"tp": 2, "pp": 1, "ep": 8}, {}, "ep 8 with tp 2: torchtitan never splits an expert over TP"),
    ({"tp": 2, "pp": 2, "ep": 8, "etp": 1}, {"zero_stage": 0}, "ep 8 with zero_stage 0"),
    ({"tp": 1, "pp": 2, "ep": 8}, {"zero_stage": 0}, "ep 8 with zero_stage 0: torchtitan forms EP groups from its FSDP"),
    ({"tp": 1, "pp": 2, "ep": 8}, {"precision": "fp8"}, "fp8 with a mixture of experts"),
    ({"tp": 2, "pp": 2, "ep": 8, "etp": 1, "virtual_stages": 2, "schedule": "interleaved", "recompute": "selective"},
     {"moe_a2a_overlap": True}, "Megatron's batch-level EP overlap"),
])
def test_torchtitan_refuses_expert_layouts_it_would_run_otherwise(layout, training, refused):
    body = estimate_request({"recompute": "full", **layout}, model="qwen3-30b-a3b", cluster=H100,
                            training={"global_batch_size": 32, "seq_length": 4096, **training})
    plan = estimate_for(EstimateRequest.model_validate(body))
    with pytest.raises(ExportError, match=refused):
        torchtitan_overrides(plan)


def test_adapter_refuses_a_non_uniform_plan():
    plan = real_plan("non-uniform")
    assert not plan.uniform
    with pytest.raises(ExportError) as refused:
        render(plan)
    message = str(refused.value)
    assert message.startswith("torchtitan cannot run this plan")
    # It names what this plan has that torchtitan cannot run (which reasons depend on the plan found).
    tp_sizes = {s.tp for r in plan.replicas for s in r.stages}
    counts = {r.num_microbatches for r in plan.replicas}
    assert ("different TP sizes" in message) == (len(tp_sizes) > 1)
    assert ("different microbatch counts" in message) == (len(counts) > 1)
    assert '"allow_non_uniform": false' in message
    with pytest.raises(ExportError):
        launch_command(plan)


def test_adapter_refuses_fp16_and_unknown_replicas():
    plan = real_plan("1f1b-even")
    with pytest.raises(ExportError, match="bfloat16 or float32, not fp16"):
        render(plan.model_copy(update={"precision": "fp16"}))
    with pytest.raises(ExportError, match="no replica 99"):
        render(plan, 99)


def test_bf16_gradients_are_refused_as_torchtitans_config_refuses_them():
    """torchtitan 0.3 reduces gradients in float32 only: its own config rejects bfloat16 (so the export cannot
    say it), and a plan priced with bf16 gradients is refused naming the fix; fp32 gradients export as its
    float32 reduce dtype and read back as the default."""
    from torchtitan.config import TORCH_DTYPE_MAP

    from adapters.torchtitan_import import import_torchtitan

    def plan_with(grad_precision: str) -> Plan:
        return estimate_for(EstimateRequest.model_validate(estimate_request(
            {"tp": 1, "pp": 1, "dp": 32}, model="llama3-8b",
            training={"global_batch_size": 64, "seq_length": 8192, "zero_stage": 3,
                      "grad_precision": grad_precision})))

    fp32 = plan_with("fp32")
    parsed = parse(fp32, override_argv(fp32))
    assert TORCH_DTYPE_MAP[parsed.training.mixed_precision_reduce] == torch.float32
    assert "grad_precision" not in import_torchtitan(launch_command(fp32), model=fp32.model).request["training"]
    with pytest.raises(SystemExit):  # tyro: invalid choice 'bfloat16' for --training.mixed-precision-reduce
        parse(fp32, [*override_argv(fp32)[:-1], "--training.mixed_precision_reduce", "bfloat16",
                     override_argv(fp32)[-1]])
    with pytest.raises(ExportError, match="bf16 gradients: torchtitan 0.3 reduces gradients in float32 only"):
        render(plan_with("bf16"))


def test_a_flex_dispatcher_plan_asks_for_torchtitans_deepep_backend():
    """A plan priced with the flex dispatcher is not torchtitan's own qwen3_30b_a3b (which exchanges tokens
    all-to-all): the launch says to build the model with DeepEP's token dispatcher, which model_spec does."""
    body = estimate_request({"tp": 1, "pp": 2, "ep": 4, "recompute": "full"}, model="qwen3-30b-a3b", cluster=H100,
                            training={"global_batch_size": 32, "seq_length": 4096, "moe_dispatcher": "flex"})
    plan = estimate_for(EstimateRequest.model_validate(body))
    assert plan.moe_dispatcher == "flex" and model_selection(plan) is None
    assert model_selection(plan.model_copy(update={"moe_dispatcher": "alltoall"})) == ("qwen3", "qwen3_30b_a3b")
    assert 'model_spec(plan.architecture, moe_comm_backend="deepep")' in launch_command(plan)
    dispatchers = {type(layer.moe.routed_experts.token_dispatcher).__qualname__
                   for layer in model_spec(plan.architecture, moe_comm_backend="deepep").model.layers}
    assert dispatchers == {"DeepEPTokenDispatcher.Config"}


def test_async_tp_is_asked_of_torchtitan_exactly_where_the_plan_priced_it(case):
    """torchtitan's CompileConfig, as its ConfigManager builds it from the overrides, runs asynchronous TP (and the
    torch.compile it needs) for the plan priced with it and for no other."""
    plan = real_plan(case)
    compiled = parsed_config(case).compile
    asked = plan.tp_comm_overlap == "async_tp" and plan.replicas[0].stages[0].tp > 1
    assert compiled.enable_async_tensor_parallel == asked
    assert compiled.enable == asked and (not asked or "model" in compiled.components)
    assert (case in ASYNC_TP) == asked


def test_torchtitan_refuses_megatron_tp_overlap():
    """Megatron's --tp-comm-overlap is not something torchtitan runs: the export says so and names the way out."""
    body = dict(ASYNC_TP["async-tp"], training={**ASYNC_TP["async-tp"]["training"], "tp_comm_overlap": "megatron"})
    plan = estimate_for(EstimateRequest.model_validate(body))
    with pytest.raises(ExportError, match="tp_comm_overlap"):
        override_argv(plan)
