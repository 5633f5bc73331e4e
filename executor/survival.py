"""Fail-stop survival (`--survive`): a rank's process dies; the others notice, regroup among themselves,
ask the service for a replan without the lost device, recover its state from the replicas that hold it
and redo the interrupted step.

1. Notice, bounded. Every rank's watchdog thread touches its heartbeat file every 0.25 s
   (`ROOT/heartbeats/`, with its host and PID) and checks the others': a peer on this host is gone
   when its process has exited, one on another host when its heartbeat is older than
   `--heartbeat-timeout`. A gone peer, an alarm raised by another rank, or an error in this rank's
   own collectives (a dead peer's sockets close) raises the alarm: the rank shuts its gloo
   connections down (`shutdown(2)`, not close, so no descriptor is reused under gloo's threads).
   Gloo waits without a timeout on a pipeline receive or a DTensor collective; a shut connection
   wakes the waiter at once, on this rank and on every peer connected to it, so within one
   heartbeat period every survivor's main thread holds an error.
2. Agree who is left. Each survivor writes its arrival (`ROOT/epoch-<k>/arrivals/`) with the next
   step its optimizer would run and whether an update was half applied; once every member has
   arrived or gone stale (or a deadline passes) the first to see it publishes the member list
   atomically (a hard link: exactly one writer wins) and everyone reads the same list. A shut
   connection does not wake everything: a gloo all-reduce whose partner left it half way waits for
   the partner's receive before its own send completes (`UnboundBuffer::waitSend`, seen in gdb in a
   TP partner of the rank that failed first, 4 of 41 runs here), and only the group's timeout
   ends that wait. Every group therefore gets the job's collective timeout (`--timeout`; `new_group`
   would give 30 minutes), and the survivors wait for a member whose process still runs until that
   timeout has passed (`rendezvous_deadline_s`): it wakes with the timeout's error and arrives. A
   rank that arrives after the list is out, or is still blocked then, counts as lost and exits
   (code 75), printing its threads' stacks; its state is recovered like a killed rank's.
3. A new gloo world among the members on a file store (gloo cannot shrink a group in place), ranks
   renumbered in device order; the watchdog now watches the new members.
4. The lowest device asks the service for a replan with the lost devices failed
   (`POST /v1/plans/{id}/replan`) and broadcasts it.
5. State. No rank applies a step's update unless every replica finished its pipeline, so a step that
   lost a device changed nothing (checked: the members' next steps agree and no update was half
   applied); the survivors then execute the replan's `migration.transfers` (`migrate.py`), which take
   every lost piece from a replica that holds it. When the replan says some state only the lost
   devices held (`bytes_from_checkpoint`, e.g. their ZeRO-1 optimizer shards), or the survivors'
   states disagree, the run says so and resumes from the newest checkpoint instead, re-running the
   steps since.
6. Redo the interrupted step.

Everything under ROOT must be one directory every rank sees (one host, or a shared file system). A
launcher must not stop the others when a rank dies: torchrun does; `python -m executor.launch` does not.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from executor.layout import device_key

HEARTBEAT_PERIOD_S = 0.25
MEMBERS = "members.json"
EVICTED_EXIT_CODE = 75  # a rank the survivors went on without: `resiplan-launch` counts it as lost, not failed


def _file(device: str) -> str:
    return device.replace(":", "_")


def shut_connections() -> int:
    """Shut down every connected socket of this process (listening ones stay: gloo aborts when its
    listener fails). Returns how many."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError, ValueError):
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            # A duplicate descriptor: shutdown acts on the socket, and closing the duplicate leaves gloo's own.
            with socket.socket(fileno=os.dup(int(fd))) as sock:
                if sock.family not in (socket.AF_INET, socket.AF_INET6):
                    continue
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    continue
                sock.shutdown(socket.SHUT_RDWR)
                count += 1
    return count


def _running(pid: int) -> bool:
    """The process exists and has not exited (a killed child stays a zombie until its launcher reaps it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


class Watchdog:
    """This rank's heartbeat and its view of the members' heartbeats, in a background thread."""

    def __init__(self, root: Path, device: str, timeout_s: float) -> None:
        self.root, self.device, self.timeout_s = root, device, timeout_s
        self.beats = root / "heartbeats"
        self.beats.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._members: tuple[str, ...] = ()
        self._epoch = 0
        self._since = time.time()
        self._fired = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="resiplan-watchdog", daemon=True)
        self.host = socket.gethostname()
        (self.beats / f"{_file(device)}.pid").write_text(f"{self.host} {os.getpid()}")

    def watch(self, epoch: int, members: list[str]) -> None:
        """From now on, the world of `epoch` with these members."""
        with self._lock:
            self._epoch, self._members, self._since, self._fired = epoch, tuple(members), time.time(), False
        self._beat()
        if not self._thread.is_alive():
            self._thread.start()

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def members(self) -> list[str]:
        with self._lock:
            return list(self._members)

    def finish(self) -> None:
        """This rank is done with the run: the others must not take its silence for a loss."""
        (self.beats / f"{_file(self.device)}.done").touch()
        self._stop.set()

    def epoch_dir(self, epoch: int | None = None) -> Path:
        return self.root / f"epoch-{self._epoch if epoch is None else epoch}"

    def stale(self) -> list[str]:
        """Members that are gone: on this host, whose process has exited (a GIL-bound thread can be starved
        of its beats, a process cannot fake its exit); elsewhere, whose heartbeat is older than the timeout.
        None until every member had time to beat."""
        now = time.time()
        with self._lock:
            members, since = self._members, self._since
        if now - since < self.timeout_s:
            return []
        lost = []
        for device in members:
            if (self.beats / f"{_file(device)}.done").exists():
                continue
            try:
                host, pid = (self.beats / f"{_file(device)}.pid").read_text().split()
                if host == self.host:
                    if not _running(int(pid)):
                        lost.append(device)
                    continue
                age = now - (self.beats / _file(device)).stat().st_mtime
            except (FileNotFoundError, ValueError):
                age = float("inf")
            if age > self.timeout_s:
                lost.append(device)
        return lost

    def alarm(self, why: str) -> None:
        """Wake every rank of this epoch's world: mark the epoch broken and shut this rank's connections (once)."""
        with self._lock:
            if self._fired:
                return
            self._fired = True
            directory = self.epoch_dir()
        directory.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            (directory / "alarm").write_text(f"{self.device}: {why}")
        shut_connections()

    def _leave_if_evicted(self) -> None:
        """A main thread still blocked when the survivors have gone on without this rank (a gloo wait the shut
        connections did not wake) never returns: end the process, as the survivors already count it lost."""
        decided = self.epoch_dir() / MEMBERS
        with contextlib.suppress(OSError, ValueError):
            if decided.exists() and self.device not in json.loads(decided.read_text()):
                evicted(self.device)

    def _beat(self) -> None:
        (self.beats / _file(self.device)).touch()

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_PERIOD_S):
            self._beat()
            if self._fired:
                self._leave_if_evicted()
                continue
            stale = self.stale()
            if stale:
                self.alarm(f"no heartbeat from {stale} for {self.timeout_s} s")
            elif (self.epoch_dir() / "alarm").exists():
                self.alarm("another rank raised the alarm")


@dataclass(frozen=True)
class Arrival:
    device: str
    active: bool  # the running plan gives it state
    next_step: int  # the step its optimizer would run next
    torn: bool  # an update was half applied when the error came
    error: str  # what woke it


def rendezvous(watchdog: Watchdog, arrival: Arrival, deadline_s: float) -> dict[str, Arrival]:
    """The members of the next world (every rank gets the same answer) and their arrivals."""
    directory = watchdog.epoch_dir()
    arrivals = directory / "arrivals"
    arrivals.mkdir(parents=True, exist_ok=True)
    mine = arrivals / f"{_file(arrival.device)}.json"
    temporary = arrivals / f".{_file(arrival.device)}.tmp"
    temporary.write_text(json.dumps(arrival.__dict__))
    temporary.replace(mine)
    decided = directory / MEMBERS
    deadline = time.time() + deadline_s
    while not decided.exists():
        arrived = {path.stem.replace("_", ":") for path in arrivals.glob("*.json")}
        if set(watchdog.members) <= arrived | set(watchdog.stale()) or time.time() > deadline:
            records = [json.loads(path.read_text()) for path in arrivals.glob("*.json")]
            records = {record["device"]: record for record in records}
            proposal = directory / f".members-{_file(arrival.device)}.tmp"
            proposal.write_text(json.dumps(records))
            with contextlib.suppress(FileExistsError):
                os.link(proposal, decided)
            break
        time.sleep(0.05)
    records = json.loads(decided.read_text())
    if arrival.device not in records:
        evicted(arrival.device)
    return {device: Arrival(**record) for device, record in sorted(records.items(), key=lambda kv: device_key(kv[0]))}


def rendezvous_deadline_s(heartbeat_timeout_s: float, collective_timeout_s: float) -> float:
    """How long the survivors wait for every member: past the collective timeout, which ends the waits a shut
    connection does not (a send whose peer left the collective), with two heartbeat periods and 10 s to
    arrive in."""
    return collective_timeout_s + 2 * heartbeat_timeout_s + 10.0


def evicted(device: str) -> None:
    say(f"device {device}: the survivors went on without it (it did not reach their rendezvous in time); "
        "it counts as lost and stops; where its threads were:")
    with contextlib.suppress(Exception):  # the stacks say what held it; stderr may have no descriptor
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    os._exit(EVICTED_EXIT_CODE)


def join_world(watchdog: Watchdog, members: list[str], timeout_s: float) -> None:
    """Leave the broken world and form the members' (this rank renumbered in device order)."""
    with contextlib.suppress(Exception):  # the old world is broken; whatever it says, it is gone
        dist.destroy_process_group()
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    store = watchdog.epoch_dir() / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=members.index(watchdog.device),
                            world_size=len(members), timeout=timedelta(seconds=timeout_s))
    watchdog.watch(watchdog.epoch + 1, members)


def ask_replan(server: str, token: str | None, plan: Any, lost: list[str]) -> str:
    """On the new world's rank 0: the service's replan of `plan` with `lost` failed (JSON), broadcast to all."""
    from adapters.client import PlannerClient

    answer: list[Any] = [None]
    if dist.get_rank() == 0:
        failures = {"failed": sorted(set(plan.excluded_devices) | set(lost), key=device_key),
                    "slow": [s.model_dump(mode="json") for s in plan.slow_devices if s.device not in lost]}
        try:
            with PlannerClient(server, token) as client:
                answer[0] = (client.replan(plan.plan_id, failures).model_dump_json(), None)
        except Exception as error:  # noqa: BLE001 - every survivor must hear of it
            answer[0] = (None, f"{type(error).__name__}: {error}")
    dist.broadcast_object_list(answer, src=0)
    plan_json, error = answer[0]
    if error:
        raise RuntimeError(f"devices {lost} were lost and the replan failed: {error}")
    return plan_json


def say(message: str) -> None:
    print(f"resiplan-train: {message}", file=sys.stderr, flush=True)
