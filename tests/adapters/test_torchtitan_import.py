"""torchtitan settings read back (issue 21): the overrides `adapters.torchtitan` writes for the real plans of
`test_torchtitan.py` import to the same layout and model, a TOML job file of an older torchtitan too, and the
launch command estimates to the plan's own prediction."""

from __future__ import annotations

import shlex

import pytest

from adapters.command_line import CommandLineError
from adapters.torchtitan import CSV_SCHEDULES, launch_command, model_selection, override_argv
from adapters.torchtitan_import import import_torchtitan
from api.tasks.planning import estimate_for
from tests.adapters.test_torchtitan import EXPERT_PARALLEL, HYBRID, REQUESTS, real_plan
from wire.schemas import EstimateRequest

NAMED = sorted(name for name in REQUESTS if not any(s in name for s in ("zb-h1", "optimized")))


def _model_args(plan) -> tuple[str, dict | None]:
    selection = model_selection(plan)
    if selection is not None:
        return f"--module {selection[0]} --config {selection[1]} ", None
    return "", plan.architecture.model_dump(exclude={"name"}, exclude_none=True)


@pytest.mark.parametrize("name", NAMED)
def test_export_then_import_gives_the_same_layout_and_model(name):
    plan = real_plan(name)
    model_text, model = _model_args(plan)
    imported = import_torchtitan(model_text + shlex.join(override_argv(plan)), model=model)
    layout, training = imported.request["layout"], imported.request["training"]
    first = plan.replicas[0]
    split = [stage.layers[1] - stage.layers[0] for stage in first.stages]
    assert (layout["tp"], layout["pp"], layout["virtual_stages"]) == (first.stages[0].tp, len(first.stages),
                                                                      plan.virtual_stages)
    assert layout.get("layers_per_stage", [split[0]] * len(split)) == split
    assert (layout["micro_batch_size"], layout["recompute"], layout["schedule"]) == (
        plan.micro_batch_size, plan.recompute, plan.schedule)
    assert layout["dp"] == len(plan.replicas)
    # torchtitan's command line cannot say float8 (its config function does): an fp8 plan comes back bf16, noted
    assert training == {"global_batch_size": plan.global_batch_size, "seq_length": plan.seq_length,
                        "zero_stage": plan.zero_stage, "precision": "bf16" if plan.precision == "fp8" else plan.precision}
    assert any("float8" in note for note in imported.notes)
    if model is None:
        assert imported.request["model"] == plan.model
    assert not [entry for entry in imported.not_modelled if "not a setting resiplan knows" in entry], imported.not_modelled


@pytest.mark.parametrize("name", ["1f1b-even", "interleaved", "no-pp-selective"])
def test_the_imported_launch_command_estimates_to_the_plans_prediction(name):
    plan = real_plan(name)
    _, model = _model_args(plan)
    imported = import_torchtitan(launch_command(plan), model=model or plan.model)
    body = {**imported.request, "cluster": REQUESTS[name]["cluster"], "failures": REQUESTS[name].get("failures", {})}
    estimate = estimate_for(EstimateRequest.model_validate(body))
    assert estimate.predicted.iteration_time_s == pytest.approx(plan.predicted.iteration_time_s, rel=2e-3)


def test_uneven_model_chunks_round_trip_as_layers_per_chunk():
    plan = real_plan("interleaved-uneven-chunks")
    imported = import_torchtitan(shlex.join(override_argv(plan)), model=plan.model)
    stages, p = plan.replicas[0].stages, len(plan.replicas[0].stages)
    assert imported.request["layout"]["layers_per_chunk"] == [
        stages[i % p].chunk_layers[i // p] for i in range(p * plan.virtual_stages)]


@pytest.mark.parametrize(("options", "parts"), [
    ("--parallelism.pipeline_parallel_degree 4", 4),  # 1F1B, torchtitan's defaults: the ends weigh a layer each
    ("--parallelism.pipeline_parallel_degree 4 --parallelism.pipeline_parallel_first_stage_less_layers 0 "
     "--parallelism.pipeline_parallel_last_stage_less_layers 3", 4),
    ("--parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_schedule Interleaved1F1B", 4),
    ("--parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_schedule Interleaved1F1B "
     "--parallelism.pipeline_parallel_layers_per_stage 3", 12),
])
def test_the_split_is_the_one_torchtitan_cuts(options, parts):
    """Without module_fqns_per_model_part torchtitan cuts the layers itself, the embedding and the output weighing
    pipeline_parallel_first/last_stage_less_layers (default 1 each): the import estimates exactly that split, as
    torchtitan's own splitter (`_generate_llm_fqn_per_model_part`) makes it for llama3-8b's 32 layers."""
    from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part

    words = options.split()
    first = int(words[words.index("--parallelism.pipeline_parallel_first_stage_less_layers") + 1]) if (
        "--parallelism.pipeline_parallel_first_stage_less_layers" in words) else 1
    last = int(words[words.index("--parallelism.pipeline_parallel_last_stage_less_layers") + 1]) if (
        "--parallelism.pipeline_parallel_last_stage_less_layers" in words) else 1
    expected = [sum(fqn.startswith("layers.") for fqn in part)
                for part in _generate_llm_fqn_per_model_part(parts, 32, first, last)]
    layout = import_torchtitan(options + " --training.global_batch_size 64 --training.seq_len 4096",
                              model="llama3-8b").request["layout"]
    pp, v = layout["pp"], layout["virtual_stages"]
    assert pp * v == parts
    got = layout.get("layers_per_chunk") or layout.get("layers_per_stage") or [32 // parts] * parts
    assert got == expected
    assert len(set(expected)) > 1, "each case is chosen for a split that is not even"


def test_a_layer_count_per_part_torchtitan_would_refuse_is_refused():
    # 32 layers + 2 for the ends in parts of 5: 7 parts, which 2 pipeline ranks cannot share.
    options = ("--parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_schedule Interleaved1F1B "
               "--parallelism.pipeline_parallel_layers_per_stage 5 --training.global_batch_size 64 --training.seq_len 4096")
    with pytest.raises(CommandLineError, match="7 model parts, not a multiple of pp 2"):
        import_torchtitan(options, model="llama3-8b")


def test_csv_schedules_say_they_do_not_round_trip():
    name = next(name for name in REQUESTS if "zb-h1" in name)
    plan = real_plan(name)
    assert plan.schedule in CSV_SCHEDULES
    _, model = _model_args(plan)
    imported = import_torchtitan(shlex.join(override_argv(plan)), model=model or plan.model)
    assert any("not read back by name" in entry for entry in imported.not_modelled)


def test_an_older_torchtitan_toml_job_file():
    toml = """
[parallelism]
tensor_parallel_degree = 2
pipeline_parallel_degree = 2
data_parallel_shard_degree = 4
pipeline_parallel_microbatch_size = 1
pipeline_parallel_schedule = "1F1B"

[training]
local_batch_size = 8
global_batch_size = 32
seq_len = 4096

[activation_checkpoint]
mode = "full"

[optimizer]
lr = 3e-4

[compile]
enable = true
"""
    imported = import_torchtitan("--parallelism.tensor_parallel_degree 4", toml=toml, model="llama3-8b")
    # [model] name and flavor name torchtitan's own model: its llama3 8B is resiplan's llama3.1-8b.
    assert import_torchtitan("", toml=toml + '[model]\nname = "llama3"\nflavor = "8B"\n').request["model"] == "llama3.1-8b"
    layout = imported.request["layout"]
    assert (layout["tp"], layout["pp"], layout["dp"], layout["recompute"]) == (4, 2, 4, "full"), "the CLI wins"
    assert imported.request["training"]["zero_stage"] == 1
    assert "--optimizer.lr" in imported.ignored
    assert any(entry.startswith("--compile.enable") for entry in imported.not_modelled)


def test_a_model_torchtitan_builds_in_python_must_be_named():
    with pytest.raises(CommandLineError, match="give the model"):
        import_torchtitan("--module mine --config my_model --training.seq_len 2048 --training.global_batch_size 8")


def test_expert_parallelism_round_trips_and_estimates_to_the_plans_prediction():
    plan = real_plan("ep-pp")
    imported = import_torchtitan(launch_command(plan))
    assert imported.request["model"] == "qwen3-30b-a3b"  # torchtitan's own qwen3_30b_a3b config
    layout = imported.request["layout"]
    assert (layout["tp"], layout["pp"], layout["dp"], layout["ep"]) == (1, 2, len(plan.replicas), plan.ep)
    body = {**imported.request, "cluster": EXPERT_PARALLEL["ep-pp"]["cluster"]}
    estimate = estimate_for(EstimateRequest.model_validate(body))
    assert estimate.ep == plan.ep
    assert estimate.predicted.iteration_time_s == pytest.approx(plan.predicted.iteration_time_s, rel=2e-3)


@pytest.mark.parametrize("name", sorted(HYBRID))
def test_hybrid_sharding_round_trips_and_estimates_to_the_plans_prediction(name):
    """data_parallel_replicate_degree x _shard_degree, both > 1, travel back as layout.dp_shard."""
    plan = real_plan(name)
    imported = import_torchtitan(launch_command(plan), model=plan.model)
    layout = imported.request["layout"]
    assert (layout["dp"], layout["dp_shard"]) == (len(plan.replicas), plan.dp_shard)
    assert not [entry for entry in imported.not_modelled if "hybrid" in entry]
    body = {**imported.request, "cluster": HYBRID[name]["cluster"]}
    estimate = estimate_for(EstimateRequest.model_validate(body))
    assert estimate.dp_shard == plan.dp_shard
    assert estimate.predicted.iteration_time_s == pytest.approx(plan.predicted.iteration_time_s, rel=2e-3)


def test_torchtitans_expert_groups_over_tp_ranks_are_read_as_whole_experts():
    """torchtitan's EP ranks include the TP ranks and hold whole experts: Megatron's expert-TP 1, read exactly."""
    text = ("--module qwen3 --config qwen3_30b_a3b --parallelism.tensor_parallel_degree 2 "
            "--parallelism.data_parallel_shard_degree 8 --parallelism.expert_parallel_degree 8 "
            "--training.seq_len 4096 --training.global_batch_size 32")
    imported = import_torchtitan(text)
    assert (imported.request["layout"]["ep"], imported.request["layout"]["etp"]) == (8, 1)
    assert not any("expert" in entry for entry in imported.not_modelled)
    uneven = import_torchtitan(text.replace("expert_parallel_degree 8", "expert_parallel_degree 3"))
    assert "ep" not in uneven.request["layout"]
    assert any("estimated without expert parallelism" in entry for entry in uneven.not_modelled)
