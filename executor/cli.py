"""`resiplan-train`: the command line of the reference executor (under torchrun, or alone for one device)."""

from __future__ import annotations

import argparse
import contextlib
import json
import faulthandler
import os
import re
import signal
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from executor.checkpoint import latest
from executor.layout import build_layout, world_devices
from executor.live import LiveOptions
from executor.model import GRAD_WEIGHTINGS, model_config, reference_train
from executor.optimizer import OPTIMIZERS
from executor.run import Options, run_and_save, segments_of
from executor.timing import Slowdown
from wire.schemas import Plan

DEFAULT_LR = {"sgd": 0.1, "adam": 1e-3}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="resiplan-train",
        description="Train a small GPT on gloo/CPU exactly as a resiplan plan lays it out (run under "
                    "torchrun --nproc-per-node <devices the plans use>).",
    )
    parser.add_argument("--plan", required=True, help="Plan JSON (as `resiplan plan` prints it)")
    parser.add_argument("--reconfigure", action="append", default=[], metavar="STEP:PLAN.json",
                        help="switch to this replan (its answer, with migration.transfers) at the start of STEP, in "
                             "the same processes; repeatable (A -> B -> A)")
    parser.add_argument("--reference", action="store_true",
                        help="train the same model on the same data in one process, no plan layout (the numbers a "
                             "distributed run must match)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd")
    parser.add_argument("--lr", type=float, default=None, help="learning rate (default: sgd 0.1, adam 1e-3)")
    parser.add_argument("--adam-eps", type=float, default=1e-8)
    parser.add_argument("--slow-device", action="append", default=[], metavar="NODE:GPU:FACTOR[@STEP]",
                        help="that device's ops take FACTOR times longer from STEP on (imitating a fail-slow GPU); "
                             "repeatable")
    parser.add_argument("--emulate-ms-per-layer", type=float, default=None, metavar="MS",
                        help="run like GPUs rather than CPU processes sharing cores: each op lasts MS per layer and "
                             "sequence of its microbatch, over its TP degree (computing, then sleeping the rest)")
    parser.add_argument("--server", default=None, metavar="URL",
                        help="close the loop live: post telemetry to URL's /v1/detect every --detect-every steps and "
                             "apply the replan a newly slow device brings (the plan must be stored there)")
    parser.add_argument("--token", default=os.environ.get("RESIPLAN_API_TOKEN"),
                        help="bearer token for --server (default: $RESIPLAN_API_TOKEN)")
    parser.add_argument("--detect-every", type=int, default=4, metavar="K", help="steps between detections")
    parser.add_argument("--telemetry", default=None, help="write /v1/detect telemetry items here (JSON lines)")
    parser.add_argument("--grad-weighting", choices=GRAD_WEIGHTINGS, default="batch-share",
                        help="replica weights in the gradient all-reduce (uniform is wrong for unequal microbatches)")
    for name in ("layers", "hidden", "ffn", "vocab", "seq"):
        parser.add_argument(f"--{name}", type=int, default=None, help=f"override the model's {name}")
    parser.add_argument("--out-dir", default=None,
                        help="write losses.jsonl, events.jsonl and each rank's final parameters (rank<R>.pt) here")
    parser.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                        help="save a per-rank sharded checkpoint after every N-th step")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="where checkpoints go (default: OUT_DIR/checkpoints)")
    parser.add_argument("--resume", default=None, metavar="DIR",
                        help="start from the newest complete checkpoint in DIR, resharded onto --plan (any plan of "
                             "the same model and batch)")
    parser.add_argument("--fail-device", default=None, metavar="NODE:GPU@STEP",
                        help="that device's process kills itself (SIGKILL) in STEP, after its first op: a lost GPU")
    parser.add_argument("--survive", action="store_true",
                        help="survive a lost rank: the others regroup, get a replan from --server without it, take "
                             "its state from the replicas that hold it (or the newest checkpoint) and redo the step; "
                             "launch with `python -m executor.launch`, which, unlike torchrun, lets them go on")
    parser.add_argument("--survive-dir", default=None, metavar="DIR",
                        help="heartbeats and the survivors' rendezvous, one directory all ranks see "
                             "(default: OUT_DIR/survival)")
    parser.add_argument("--heartbeat-timeout", type=float, default=5.0, metavar="S",
                        help="with --survive: a rank on another host whose heartbeat is this old counts as lost (on "
                             "this host a rank is lost when its process exits)")
    parser.add_argument("--timeout", type=float, default=300.0, help="collective timeout, seconds")
    return parser


def _switches(values: list[str]) -> list[tuple[int, Plan]]:
    switches = []
    for value in values:
        step, sep, path = value.partition(":")
        if not sep or not step.isdigit():
            raise ValueError(f"--reconfigure {value!r}: expected STEP:PLAN.json")
        switches.append((int(step), Plan.model_validate_json(Path(path).read_text())))
    return switches


def _reference(plan: Plan, options: Options, out_dir: str | None) -> int:
    cfg = model_config(plan, layers=options.layers, hidden=options.hidden, ffn=options.ffn, vocab=options.vocab,
                       seq=options.seq)
    gbs = build_layout(plan, cfg.num_layers).global_batch_size
    losses, _, _ = reference_train(cfg, gbs, options.steps, options.seed, options.lr, options.optimizer,
                                   options.adam_eps)
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        with open(Path(out_dir) / "losses.jsonl", "w") as out:
            out.writelines(json.dumps({"step": step, "loss": loss, "plan_id": None}) + "\n"
                           for step, loss in enumerate(losses))
    print(json.dumps({"model": cfg.__dict__, "losses": losses}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    with contextlib.suppress(OSError, ValueError):  # stderr without a file descriptor (captured): no dumps
        faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` prints where every thread of a stuck rank is
    try:
        plan = Plan.model_validate_json(Path(args.plan).read_text())
        switches = _switches(args.reconfigure)
        slowdowns = tuple(Slowdown.parse(value) for value in args.slow_device)
        segments_of(plan, switches, args.steps)
    except (OSError, ValueError) as error:
        print(f"resiplan-train: {error}", file=sys.stderr)
        return 2
    checkpoint_dir = args.checkpoint_dir or (str(Path(args.out_dir) / "checkpoints") if args.out_dir else None)
    if args.checkpoint_every is not None and (args.checkpoint_every < 1 or checkpoint_dir is None):
        print("resiplan-train: --checkpoint-every needs N >= 1 and --checkpoint-dir or --out-dir", file=sys.stderr)
        return 2
    fail_device, survive_dir = None, None
    if args.fail_device:
        device, sep, step = args.fail_device.rpartition("@")
        if not sep or not step.isdigit() or not re.fullmatch(r"\d+:\d+", device):
            print(f"resiplan-train: --fail-device {args.fail_device!r}: expected NODE:GPU@STEP, e.g. 1:0@3",
                  file=sys.stderr)
            return 2
        fail_device = (device, int(step))
    if args.survive:
        survive_dir = args.survive_dir or (str(Path(args.out_dir) / "survival") if args.out_dir else None)
        if not args.server or survive_dir is None or not args.heartbeat_timeout > 0:
            print("resiplan-train: --survive needs --server (the replan), --survive-dir or --out-dir, and a positive "
                  "--heartbeat-timeout", file=sys.stderr)
            return 2
    first_step = 0
    if args.resume:
        try:
            first_step = latest(args.resume)[1]["next_step"]
            segments_of(plan, switches, args.steps, first_step)
        except ValueError as error:
            print(f"resiplan-train: {error}", file=sys.stderr)
            return 2
    if args.detect_every < 3:
        print("resiplan-train: --detect-every must be >= 3 (/v1/detect wants 3 iterations)", file=sys.stderr)
        return 2
    live = LiveOptions(args.server, args.token, args.detect_every) if args.server else None
    lr = args.lr if args.lr is not None else DEFAULT_LR[args.optimizer]
    options = Options(steps=args.steps, seed=args.seed, lr=lr, optimizer=args.optimizer, adam_eps=args.adam_eps,
                      slowdowns=slowdowns, emulate_ms_per_layer=args.emulate_ms_per_layer,
                      checkpoint_every=args.checkpoint_every, checkpoint_dir=checkpoint_dir, resume=args.resume,
                      fail_device=fail_device, survive_dir=survive_dir, heartbeat_timeout_s=args.heartbeat_timeout,
                      timeout_s=args.timeout,
                      grad_weighting=args.grad_weighting, layers=args.layers,
                      hidden=args.hidden, ffn=args.ffn, vocab=args.vocab, seq=args.seq)
    torch.set_num_threads(1)
    if args.reference:
        return _reference(plan, options, args.out_dir)
    world = len(world_devices([plan, *(p for _, p in switches)]))
    if "RANK" in os.environ:
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    elif world == 1:  # a one-device plan needs no launcher
        store = Path(tempfile.mkdtemp()) / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1,
                                timeout=timedelta(seconds=args.timeout))
    else:
        print(f"run me under torchrun --nproc-per-node {world} (the devices the plans use)", file=sys.stderr)
        return 2
    try:
        result = run_and_save(plan, options, args.out_dir, args.telemetry, switches, live)
        if dist.get_rank() == 0:
            cfg = model_config(plan, layers=args.layers, hidden=args.hidden, ffn=args.ffn, vocab=args.vocab,
                               seq=args.seq)
            print(json.dumps({"model": cfg.__dict__, "losses": result.losses}), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
