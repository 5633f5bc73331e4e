"""The closed-loop benchmark's accounting: iteration times under true speeds, checkpoints, goodput."""

from __future__ import annotations

import pytest

from benchmarks.closed_loop import (
    GLOBAL_BATCH,
    SEQ_LENGTH,
    Costs,
    Run,
    Truth,
    true_iteration_s,
    windowed_goodput,
)
from planner.plan import plan
from wire.convert import to_problem
from wire.schemas import PlanRequest


@pytest.fixture(scope="module")
def small_plan():
    return plan(to_problem(PlanRequest.model_validate({
        "cluster": {"num_nodes": 2, "gpus_per_node": 8, "gpu": "A100-80GB"},
        "model": "llama2-13b",
        "training": {"global_batch_size": 32, "seq_length": 4096},
        "options": {"time_limit_s": 2},
    })))


def test_true_iteration_is_the_prediction_when_nothing_changed(small_plan):
    assert true_iteration_s(small_plan, Truth()) == small_plan.predicted.iteration_time_s


def test_a_slowed_device_stretches_its_replica_by_the_pipeline_formula(small_plan):
    replica = small_plan.replicas[0]
    stage = max(replica.stages, key=lambda s: s.forward_ms + s.backward_ms)
    device = stage.devices[0]
    times = [s.forward_ms + s.backward_ms for s in replica.stages]
    slowed = [t * (2.0 if s is stage else 1.0) for t, s in zip(times, replica.stages)]
    m, v = replica.num_microbatches, small_plan.virtual_stages

    def makespan(ts):  # m * max + (sum - max) / v, written out here on purpose
        return m * max(ts) + (sum(ts) - max(ts)) / v

    expected = small_plan.predicted.iteration_time_s + (makespan(slowed) - makespan(times)) / 1e3
    assert true_iteration_s(small_plan, Truth(speed={device: 0.5})) == pytest.approx(expected)


def test_a_crash_rolls_back_to_the_last_checkpoint():
    run = Run("x", Costs(checkpoint_every=100))
    for _ in range(150):
        run.iterate(2.0)
    run.pause("restart", 30.0)
    run.roll_back()
    assert (run.done, run.checkpoint, run.lost_iterations) == (100, 100, 50)
    assert run.time_s == pytest.approx(330.0)
    assert run.downtime_s == {"restart": 30.0}


def test_windowed_goodput_counts_every_finished_iteration_once():
    run = Run("x", Costs())
    for _ in range(10):
        run.iterate(7.0)
    run.pause("restart", 50.0)
    for _ in range(5):
        run.iterate(7.0)
    window_s = 30.0
    points = windowed_goodput(run, window_s)
    assert sum(g * window_s for _, g in points) == pytest.approx(15 * GLOBAL_BATCH * SEQ_LENGTH)
    # The window [90, 120) s lies inside the restart: nothing finishes there.
    assert points[3][1] == 0.0
