"""Whether a Plan read from a file can be exported: a plan is the client's data, and a hand-edited one must get a
one-line error naming what is wrong, not a division by zero or a billion-line config."""

from __future__ import annotations

from adapters.registry import ExportError
from wire.schemas import Plan

MAX_MICROBATCHES = 1 << 20  # per replica: a schedule's CSV writes a few rows per microbatch and stage
MAX_LAYERS = 100_000  # per stage, where the plan carries no architecture to check layers against
ZERO_STAGES = (0, 1, 2, 3)


def check_exportable(plan: Plan) -> None:
    """Raise ExportError naming the first field no plan the service writes could hold."""
    if not plan.replicas:
        raise ExportError("the plan has no replicas")
    if plan.virtual_stages < 1:
        raise ExportError(f"virtual_stages {plan.virtual_stages} must be at least 1")
    if plan.zero_stage not in ZERO_STAGES:
        raise ExportError(f"zero_stage {plan.zero_stage} is not a ZeRO stage (0, 1, 2 or 3)")
    num_layers = plan.architecture.num_layers if plan.architecture is not None else MAX_LAYERS
    for r, replica in enumerate(plan.replicas):
        where = f"replicas[{r}]"
        if not replica.stages:
            raise ExportError(f"{where} has no stages")
        if not 1 <= replica.num_microbatches <= MAX_MICROBATCHES:
            raise ExportError(f"{where}.num_microbatches {replica.num_microbatches} is not between 1 and "
                              f"{MAX_MICROBATCHES:,}")
        for s, stage in enumerate(replica.stages):
            at = f"{where}.stages[{s}]"
            if stage.tp < 1 or stage.cp < 1:
                raise ExportError(f"{at}: tp {stage.tp} and cp {stage.cp} must be at least 1")
            first, end = stage.layers
            if not 0 <= first < end <= num_layers:
                raise ExportError(f"{at}.layers [{first}, {end}) is not a range of the model's {num_layers} layers")
