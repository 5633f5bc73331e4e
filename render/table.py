"""A plan as a table for people (`--format table`)."""

from __future__ import annotations

import re

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from wire.schemas import Plan

# Piped into a file or a pager there is no terminal to fit: rich would wrap at 80 columns.
PIPED_WIDTH = 200
# C0 and C1 controls (ESC among them): a plan's text must not steer the reader's terminal.
_CONTROLS = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _text(value: str) -> str:
    """Plan text (a model name is whatever a client sent) printed as itself: no rich markup, no controls."""
    return escape(_CONTROLS.sub("?", value))


def _console() -> Console:
    console = Console()
    return console if console.is_terminal else Console(width=PIPED_WIDTH)


def _replica_signature(replica) -> tuple:
    return tuple((s.tp, tuple(s.layers), s.speed) for s in replica.stages), replica.num_microbatches


def render_table(plan: Plan, console: Console | None = None) -> None:
    console = console or _console()
    p = plan.predicted
    console.print(
        f"[bold]{_text(plan.model or 'model')}[/bold]  status={_text(plan.status)}  uniform={plan.uniform}  "
        f"replicas={len(plan.replicas)}  stages={'/'.join(str(n) for n in sorted({len(r.stages) for r in plan.replicas}))}  "
        f"tp={'/'.join(str(t) for t in sorted({s.tp for r in plan.replicas for s in r.stages}))}  "
        f"micro_batch_size={plan.micro_batch_size}  schedule={_text(plan.schedule)}"
        f"{f' (v={plan.virtual_stages})' if plan.virtual_stages > 1 else ''}  recompute={_text(plan.recompute)}"
    )
    console.print(
        f"iteration {p.iteration_time_s:.3f} s   {p.tokens_per_s:,.0f} tokens/s   MFU {p.mfu:.1%}   "
        f"solver {_text(plan.solver.status)} in {plan.solver.wall_time_s:.2f} s (gap {plan.solver.gap:.2%})"
    )
    if p.calibration_id is not None:
        console.print(f"priced with calibration {_text(p.calibration_id)}")
        for line in p.calibration_extrapolates:  # a custom GPU's name is the client's text
            console.print(f"  extrapolates: {_text(line)}")
    breakdown = Table(title="Iteration breakdown (critical path)")
    for key in type(p.breakdown).model_fields:
        breakdown.add_column(key.removesuffix("_s"), justify="right")
    breakdown.add_row(*(f"{getattr(p.breakdown, key):.3f}" for key in type(p.breakdown).model_fields))
    console.print(breakdown)

    groups: dict[tuple, list[int]] = {}
    for replica in plan.replicas:
        groups.setdefault(_replica_signature(replica), []).append(replica.id)
    for ids in groups.values():
        replica = plan.replicas[ids[0]]
        table = Table(title=f"replicas {_ranges(ids)}: {replica.num_microbatches} microbatches each")
        for column in ("stage", "layers", f"devices (replica {replica.id})", "tp", "speed", "memory GiB", "fwd ms", "bwd ms"):
            table.add_column(column)
        for stage in replica.stages:
            devices = _text(", ".join(stage.devices) if len(stage.devices) <= 4 else f"{stage.devices[0]} .. {stage.devices[-1]}")
            chunks = f" chunks {'+'.join(map(str, stage.chunk_layers))}" if stage.chunk_layers is not None else ""
            table.add_row(str(stage.id), f"[{stage.layers[0]}, {stage.layers[1]}){chunks}", devices, str(stage.tp),
                          f"{stage.speed:g}", f"{stage.memory_gib:.1f}", f"{stage.forward_ms:.1f}", f"{stage.backward_ms:.1f}")
        console.print(table)
    console.print(f"unused devices: {len(plan.unused_devices)}   excluded (failed): {len(plan.excluded_devices)}")


def _ranges(ids: list[int]) -> str:
    return f"{ids[0]}" if len(ids) == 1 else f"{ids[0]}..{ids[-1]} ({len(ids)})"


def _layout_line(plan: Plan) -> str:
    first = plan.replicas[0]
    v = f" v={plan.virtual_stages}" if plan.virtual_stages > 1 else ""
    shape = f"tp {max(s.tp for s in first.stages)}, pp {len(first.stages)}, {len(plan.replicas)} replicas"
    return (f"{shape}{'' if plan.uniform else ' (non-uniform)'}, mbs {plan.micro_batch_size}, "
            f"{_text(plan.schedule)}{v}, recompute {_text(plan.recompute)}")


def render_comparison(comparison, console: Console | None = None) -> None:
    """`resiplan compare --format table`: the two layouts and their breakdowns side by side, then the changes
    ranked by what each buys alone."""
    console = console or _console()
    yours, best = comparison.yours, comparison.best
    side = Table(title=f"Your layout against the best plan: {comparison.speedup:.3f}x")
    for column in ("", "yours", "best"):
        side.add_column(column, justify="left" if not column else "right")
    side.add_row("layout", _layout_line(yours), _layout_line(best))
    side.add_row("iteration s", f"{yours.predicted.iteration_time_s:.3f}", f"{best.predicted.iteration_time_s:.3f}")
    side.add_row("tokens/s", f"{yours.predicted.tokens_per_s:,.0f}", f"{best.predicted.tokens_per_s:,.0f}")
    side.add_row("MFU", f"{yours.predicted.mfu:.1%}", f"{best.predicted.mfu:.1%}")
    for key in type(yours.predicted.breakdown).model_fields:
        side.add_row(key.removesuffix("_s") + " s", f"{getattr(yours.predicted.breakdown, key):.3f}",
                     f"{getattr(best.predicted.breakdown, key):.3f}")
    side.add_row("most memory GiB", f"{max(s.memory_gib for r in yours.replicas for s in r.stages):.1f}",
                 f"{max(s.memory_gib for r in best.replicas for s in r.stages):.1f}")
    console.print(side)
    if comparison.planner_slower:
        console.print("[bold red]The best plan is slower than your layout, which lies in the space it searches: "
                      "a planner bug. Please report this request.[/bold red]")
    changes = Table(title="Each change alone, applied to your layout")
    for column in ("change", "iteration s", "gain"):
        changes.add_column(column, justify="left" if column == "change" else "right")
    for change in comparison.changes:
        if change.iteration_time_s is None:
            changes.add_row(_text(change.change), "cannot run", _text(change.why or ""))
        else:
            changes.add_row(_text(change.change), f"{change.iteration_time_s:.3f}", f"{change.gain:+.1%}")
    console.print(changes)
