"""`resiplan-launch --nproc-per-node N ARGS...`: start N `resiplan-train ARGS...` ranks on this host.

torchrun stops every worker as soon as one dies, which is right for a job that restarts from a
checkpoint and wrong for one that survives a lost rank (`--survive`): here each rank runs to its own
end. The launch succeeds when every rank exits 0 except lost ones (killed by SIGKILL, as `--fail-device`
imitates, or evicted by the survivors, exit 75), and at least one rank finished.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys

from executor.survival import EVICTED_EXIT_CODE

LOST_CODES = (-signal.SIGKILL, EVICTED_EXIT_CODE)

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="resiplan-launch", description=__doc__.splitlines()[0].split(": ", 1)[1])
    parser.add_argument("--nproc-per-node", type=int, required=True, metavar="N")
    parser.add_argument("--master-port", type=int, default=None, help="default: a free port")
    parser.add_argument("--log-dir", default=None, help="write rank R's output to LOG_DIR/rank<R>.log")
    args, train_args = parser.parse_known_args(argv)
    if args.nproc_per_node < 1:
        parser.error("--nproc-per-node must be >= 1")
    port = str(args.master_port or _free_port())
    ranks = []
    for rank in range(args.nproc_per_node):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(args.nproc_per_node),
               "LOCAL_WORLD_SIZE": str(args.nproc_per_node), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        log = None
        if args.log_dir:
            os.makedirs(args.log_dir, exist_ok=True)
            log = open(os.path.join(args.log_dir, f"rank{rank}.log"), "w")  # noqa: SIM115 - closed below
        ranks.append((subprocess.Popen([sys.executable, "-m", "executor.cli", *train_args], env=env, stdout=log,
                                       stderr=subprocess.STDOUT if log else None), log))
    codes = []
    for process, log in ranks:
        codes.append(process.wait())
        if log is not None:
            log.close()
    lost = [rank for rank, code in enumerate(codes) if code in LOST_CODES]
    failed = [(rank, code) for rank, code in enumerate(codes) if code != 0 and code not in LOST_CODES]
    if lost:
        print(f"resiplan-launch: ranks {lost} were lost (killed by SIGKILL, or evicted by the survivors: exit "
              f"{EVICTED_EXIT_CODE}); the others ran on", file=sys.stderr)
    if failed or len(lost) == len(codes):
        print(f"resiplan-launch: ranks failed (rank, exit code): {failed or [(r, codes[r]) for r in lost]}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
