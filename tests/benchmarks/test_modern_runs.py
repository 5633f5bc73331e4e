"""The published 2023+ runs the fidelity report holds out: enough of them, from independent sources, each
layout consistent with its GPU count, and each published figure read as seconds with the source's own
FLOP count (checked against closed forms worked out here, not the module's code)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from benchmarks.fidelity import modern_table, run_feature
from cost_models.gpu_efficiency import builtin_efficiency
from benchmarks.modern_runs import (
    MODERN_RUNS_PATH,
    balanced_split,
    load_modern_runs,
    predict_iteration_s,
    slot_chunks,
    stage_split,
    published_iteration_s,
    source_flops_per_iteration,
)

ROWS = json.loads(MODERN_RUNS_PATH.read_text())["runs"]


def test_at_least_15_runs_from_3_independent_sources_on_hopper():
    assert len(ROWS) >= 15
    assert len({row["source_id"] for row in ROWS}) >= 3
    assert {row["gpu"] for row in ROWS} <= {"H100-SXM", "H200", "B200"}
    for row in ROWS:
        assert row["citation"] and row["architecture_from"], row["model"]
        assert row["tp"] * row.get("cp", 1) * row["pp"] * row["dp"] == row["gpus"], row["model"]
        assert row["global_batch"] % (row["dp"] * row["micro_batch"]) == 0, row["model"]


def test_megatron_formula_for_a_plain_gpt_is_the_closed_form():
    # Megatron's count for a GPT with ffn 4h, full multi-head attention and no gating:
    # 12 B s L h^2 (2 + s/h + 4 + V/(2 L h)) = 72 B s L h^2 (1 + s/(6h) + V/(12 L h)).
    row = next(r for r in ROWS if r["flops_formula"] == "megatron_2024")
    b, s, layers, h, vocab = row["global_batch"], row["seq_length"], row["layers"], row["hidden"], row["vocab"]
    closed = 72 * b * s * layers * h * h * (1 + s / (6 * h) + vocab / (12 * layers * h))
    assert source_flops_per_iteration(row) == pytest.approx(closed, rel=1e-12)
    # and its published TFLOP/s per GPU times GPUs times seconds gives that count back
    seconds = published_iteration_s(row)
    assert seconds * row["measured"]["tflops_per_gpu"] * 1e12 * row["gpus"] == pytest.approx(closed, rel=1e-12)


def test_palm_count_for_llama3_405b_matches_its_published_parameters():
    # PaLM's 6N + 12 L h s per token, N the non-embedding parameters: Llama 3.1 405B has 405.9B parameters,
    # of which 2 x 128,256 x 16,384 are the input and output embeddings.
    row = next(r for r in ROWS if r["flops_formula"] == "palm")
    non_embedding = 405.9e9 - 2 * 128_256 * 16_384
    per_token = 6 * non_embedding + 12 * 126 * 16_384 * row["seq_length"]
    tokens = row["global_batch"] * row["seq_length"]
    assert source_flops_per_iteration(row) == pytest.approx(tokens * per_token, rel=0.005)


def test_tokens_per_second_becomes_seconds_per_iteration():
    row = next(r for r in ROWS if "tokens_per_s_per_gpu" in r["measured"])
    tokens = row["global_batch"] * row["seq_length"]
    assert published_iteration_s(row) * row["measured"]["tokens_per_s_per_gpu"] * row["gpus"] == pytest.approx(tokens)


def test_uneven_splits_put_the_extra_layers_in_the_middle():
    assert balanced_split(126, 16) == [7] + [8] * 14 + [7]  # Llama 3 405B as Meta ran it
    assert balanced_split(10, 4) == [2, 3, 3, 2]
    assert balanced_split(12, 4) == [3, 3, 3, 3]


@pytest.mark.parametrize(("layers", "pp", "v"), [(126, 8, 8), (126, 16, 2), (94, 8, 4)])
def test_counting_the_embedding_and_the_loss_as_layers_is_megatron_cores_split(layers, pp, v):
    """Megatron-Bridge's 405B and Qwen3-235B splits and the Llama 3 paper's, against megatron-core's own
    (--account-for-embedding/loss-in-pipeline-split): the layers each (pp rank, virtual stage) builds."""
    import torch
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=layers, hidden_size=64, num_attention_heads=8, pipeline_model_parallel_size=pp,
                               virtual_pipeline_model_parallel_size=v, account_for_embedding_in_pipeline_split=True,
                               account_for_loss_in_pipeline_split=True, pipeline_dtype=torch.bfloat16, bf16=True)
    built = [get_num_layers_to_build(config, vp_stage=part // pp, pp_rank=part % pp) for part in range(pp * v)]
    assert list(slot_chunks(layers, pp, v)) == built


def test_the_runs_split_that_way_are_priced_at_their_chunks_stage_sums():
    flagged = [run for run in load_modern_runs() if run.layers_per_chunk is not None]
    assert {run.source_id for run in flagged} == {"llama3-paper-2024", "megatron-bridge-405b-h100",
                                                  "megatron-bridge-moe-h100", "torchtitan-h100-202412"}
    for run in flagged:
        p = run.shape.pp
        assert stage_split(run) == [sum(run.layers_per_chunk[s::p]) for s in range(p)]
        assert sum(run.layers_per_chunk) == run.workload.model.num_layers


def test_a_stated_split_must_cut_the_model(tmp_path):
    """A row's own layers_per_chunk must be pp x v chunks that add up to the model's layers."""
    rows = json.loads(MODERN_RUNS_PATH.read_text())
    row = next(run for run in rows["runs"] if "layers_per_chunk" in run)
    for wrong in (row["layers_per_chunk"][:-1], [row["layers_per_chunk"][0] + 1] + row["layers_per_chunk"][1:]):
        broken = dict(rows, runs=[dict(row, layers_per_chunk=wrong)])
        path = tmp_path / "runs.json"
        path.write_text(json.dumps(broken))
        with pytest.raises(ValueError, match="layers_per_chunk"):
            load_modern_runs(path)


def test_a_row_says_how_its_nodes_are_linked(tmp_path):
    """KempnerForge's 4-GPU H200 nodes are a direct NVLink mesh: its runs with groups of 2 inside a node (TP 2, or 2
    FSDP ranks to a node) pay a third of the bandwidth for them, TP 2 enough to show in the step; runs whose groups
    span the whole node or none of it pay nothing more; a row that says nothing is NVSwitch; any other word is
    refused."""
    rows = json.loads(MODERN_RUNS_PATH.read_text())
    by_label = {run.label: run for run in load_modern_runs()}
    kempner = [run for run in by_label.values() if run.source_id == "kempnerforge-2026"]
    assert kempner and all(run.hardware.nvlink_mesh and run.hardware.gpus_per_node == 4 for run in kempner)
    assert not any(run.hardware.nvlink_mesh for run in by_label.values() if run.source_id != "kempnerforge-2026")
    efficiency = builtin_efficiency(kempner[0].hardware.gpu)
    for run in kempner:
        on_switch = replace(run, hardware=replace(run.hardware, nvlink_mesh=False))
        slower = predict_iteration_s(run, efficiency) / predict_iteration_s(on_switch, efficiency)
        in_node_groups = {run.shape.tp, min(run.shape.dp, 4 // run.shape.tp)}
        if run.shape.tp == 2:
            assert slower > 1.05, run.label
        elif 2 in in_node_groups:
            assert slower > 1.0, run.label
        else:
            assert slower == 1.0, run.label
    row = next(run for run in rows["runs"] if run["source_id"] == "kempnerforge-2026")
    path = tmp_path / "runs.json"
    path.write_text(json.dumps(dict(rows, runs=[dict(row, nvlink_topology="nvswitch")])))
    with pytest.raises(ValueError, match="nvlink_topology"):
        load_modern_runs(path)


def test_the_report_prices_every_run_and_says_the_mean_error():
    lines = modern_table(builtin_efficiency)
    assert sum(line.startswith("| ") and "%" in line for line in lines) == len(load_modern_runs()) == len(ROWS)
    summary = "\n".join(lines[-2:])
    assert "all " in summary and f"({len(ROWS)} runs)" in summary
    # Mixture-of-experts, context-parallel, FP8 and sharded (ZeRO-2/3) runs reported apart from the BF16 ZeRO-0/1
    # ones, each with its count
    features = {"moe" if row.get("ep", 1) > 1 else "cp" if row.get("cp", 1) > 1 else "fp8" if row["precision"] == "fp8"
                else (f"zero-{row['zero_stage']}" if row["zero_stage"] >= 2 else "bf16") for row in ROWS}
    assert {"bf16", "fp8", "zero-3", "cp", "moe"} <= features
    for feature in features:
        count = sum(1 for run in load_modern_runs() if run_feature(run) == feature)
        assert f"{feature} " in lines[-1] and f"({count} runs)" in lines[-1]
