"""A replan's `migration`: what moves from the running layout to the new one, piece by piece."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from cost_models.transfers import Transfer


class ReplanCandidate(BaseModel):
    """One layout the replan weighed: `replan` (the new optimum on the devices that hold most of its
    state), `scratch` (the same optimum placed ignoring the running layout; for comparison, never
    chosen) or `keep` (the running layout, when all its devices are alive; its iteration time is then
    an upper bound when a device it uses got slower or faster)."""

    name: Literal["replan", "scratch", "keep"]
    iteration_time_s: float
    bytes_moved: int
    migration_s: float
    objective_ms: float = Field(description="iteration_time_s plus migration_s / amortize_iterations, in ms.")


class MigrationTransfer(BaseModel):
    """One piece of model state one device sends another."""

    # `from` is a Python keyword: the field is `sender` inside, `from` on the wire, read and written.
    model_config = ConfigDict(validate_by_name=True, validate_by_alias=True, serialize_by_alias=True)

    sender: str = Field(alias="from", description="Device that holds the piece in the running layout.")
    to: str = Field(description="Device of the new layout that receives it.")
    layers: list[int] = Field(description="Transformer layers [first, last), half-open; [n, n] when the piece "
                              "is only the embedding or the head.")
    embedding: bool = Field(default=False, description="The input embedding's share comes too.")
    head: bool = Field(default=False, description="The output head's share comes too (a separate copy of tied "
                       "embeddings when pp > 1).")
    tp_shard: list[int] = Field(description="[index, of]: the receiver's tensor-parallel shard in the new layout.")
    part: list[int] = Field(description="[lo, hi, of]: parts lo..hi of `of` equal parts of every tensor's "
                            "tensor-parallel dimension (of the whole tensor, not of the shard); optimizer state is "
                            "sharded along the same dimension.")
    state: list[Literal["weights", "optimizer"]] = Field(
        description="`weights`: bf16/fp16 parameters; `optimizer`: fp32 master weights and Adam moments (bf16 Adam "
                    "moments with training.optimizer_precision bf16).")
    bytes: int
    intra_node: bool = Field(description="Sender and receiver share a node (NVLink); else the network.")


class Migration(BaseModel):
    bytes_moved: int = Field(description="Sum of the transfers' bytes: state devices of the new plan receive "
                             "from other devices.")
    devices_changed: list[str] = Field(description="Alive devices whose state changes: receive, shed or leave.")
    estimated_s: float = Field(description="Time of the transfers over the cluster's links, every device sending "
                               "and receiving at once: the busiest NVLink or network link's bytes over its "
                               "bandwidth.")
    bytes_from_checkpoint: int = Field(
        default=0, description="State the new plan needs that only failed devices held (e.g. their ZeRO-1 "
        "optimizer shards): it must be read from the last checkpoint; not among the transfers.")
    transfers: list[MigrationTransfer] = Field(
        default_factory=list, description="Every piece that moves, from which device to which: a trainer applies "
        "the replan by executing exactly these (each receiver keeps what it held itself).")
    amortize_iterations: int | None = None
    chosen: str | None = Field(default=None, description="The candidate this plan is.")
    candidates: list[ReplanCandidate] = Field(default_factory=list)


def transfer_to_wire(transfer: Transfer, num_layers: int) -> MigrationTransfer:
    """Units (0 the embedding, 1..L the layers, L + 1 the head) as layers and flags."""
    first_layer = min(max(transfer.first_unit - 1, 0), num_layers)
    last_layer = max(min(transfer.end_unit - 1, num_layers), first_layer)
    denominator = math.lcm(transfer.part_lo.denominator, transfer.part_hi.denominator)
    return MigrationTransfer(
        sender=transfer.sender,
        to=transfer.receiver,
        layers=[first_layer, last_layer],
        embedding=transfer.first_unit == 0,
        head=transfer.end_unit == num_layers + 2,
        tp_shard=list(transfer.receiver_tp_shard),
        part=[int(transfer.part_lo * denominator), int(transfer.part_hi * denominator), denominator],
        state=list(transfer.states),
        bytes=round(transfer.bytes),
        intra_node=transfer.intra_node,
    )

