"""`resiplan-train`: the command line of the reference executor (under torchrun, or alone for one device)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from executor.layout import build_layout
from executor.model import GRAD_WEIGHTINGS, model_config
from executor.run import Options, run_and_save
from wire.schemas import Plan


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="resiplan-train",
        description="Train a small GPT on gloo/CPU exactly as a resiplan plan lays it out (run under "
                    "torchrun --nproc-per-node <devices the plan uses>).",
    )
    parser.add_argument("--plan", required=True, help="Plan JSON (as `resiplan plan` prints it)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate")
    parser.add_argument("--slow-rank", type=int, default=None, help="rank that sleeps to imitate a fail-slow GPU")
    parser.add_argument("--slow-factor", type=float, default=1.0, help="the slow rank's ops take this many times longer")
    parser.add_argument("--telemetry", default=None, help="write /v1/detect telemetry items here (JSON lines)")
    parser.add_argument("--grad-weighting", choices=GRAD_WEIGHTINGS, default="batch-share",
                        help="replica weights in the gradient all-reduce (uniform is wrong for unequal microbatches)")
    for name in ("layers", "hidden", "ffn", "vocab", "seq"):
        parser.add_argument(f"--{name}", type=int, default=None, help=f"override the model's {name}")
    parser.add_argument("--out-dir", default=None, help="save each rank's losses and final full parameters here")
    parser.add_argument("--timeout", type=float, default=300.0, help="collective timeout, seconds")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.slow_factor < 1.0:
        print("--slow-factor must be >= 1", file=sys.stderr)
        return 2
    plan = Plan.model_validate_json(Path(args.plan).read_text())
    options = Options(steps=args.steps, seed=args.seed, lr=args.lr, slow_rank=args.slow_rank,
                      slow_factor=args.slow_factor, grad_weighting=args.grad_weighting, layers=args.layers,
                      hidden=args.hidden, ffn=args.ffn, vocab=args.vocab, seq=args.seq)
    torch.set_num_threads(1)
    if "RANK" in os.environ:
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    elif build_layout(plan).world == 1:  # a one-device plan needs no launcher
        store = Path(tempfile.mkdtemp()) / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1,
                                timeout=timedelta(seconds=args.timeout))
    else:
        print(f"run me under torchrun --nproc-per-node {build_layout(plan).world} (the devices the plan uses)",
              file=sys.stderr)
        return 2
    try:
        result = run_and_save(plan, options, args.out_dir, args.telemetry)
        if dist.get_rank() == 0:
            cfg = model_config(plan, layers=args.layers, hidden=args.hidden, ffn=args.ffn, vocab=args.vocab,
                               seq=args.seq)
            print(json.dumps({"model": cfg.__dict__, "losses": result.losses}), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
