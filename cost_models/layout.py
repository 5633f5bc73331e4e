"""The inputs of an iteration estimate: hardware, workload and one parallel layout."""

from __future__ import annotations

from dataclasses import dataclass

from cost_models.hardware import GpuSpec
from cost_models.model_spec import ModelSpec


@dataclass(frozen=True)
class Hardware:
    """A homogeneous cluster's GPU and links (bandwidths unidirectional GB/s per GPU).

    nvlink_mesh: a node's GPUs are linked to each other directly, with no NVSwitch (4-GPU HGX H100/H200
    boards, NVL cards with 4-way NVLink bridges): each GPU's links are split evenly among its peers, so a
    GPU reaches one peer at 1 / (gpus_per_node - 1) of `intra_node_bandwidth_gb_s` (`nvlink_group_gb_s`).
    """

    gpu: GpuSpec
    gpus_per_node: int
    intra_node_bandwidth_gb_s: float
    inter_node_bandwidth_gb_s: float
    nvlink_mesh: bool = False


def nvlink_group_gb_s(hardware: Hardware, group_gpus: int) -> float:
    """Unidirectional NVLink GB/s per GPU for traffic among `group_gpus` GPUs of one node (2: a point-to-point
    send). Through NVSwitch every GPU drives all its links whoever it talks to. In a direct mesh a GPU drives
    only the links to its group peers, 1 / (n - 1) of them per peer: NCCL's topology search builds its rings
    and trees from the NVLink paths it finds between the group's GPUs (nccl src/graph/search.cc), so a
    collective over g of a node's n GPUs gets (g - 1) / (n - 1) of the GPU's bandwidth: TP 2 on a 4-GPU board
    a third, TP 4 all of it."""
    peers = hardware.gpus_per_node - 1
    if not hardware.nvlink_mesh or peers <= 1 or not 1 < group_gpus <= peers:  # 1: nothing crosses NVLink
        return hardware.intra_node_bandwidth_gb_s
    return hardware.intra_node_bandwidth_gb_s * (group_gpus - 1) / peers


@dataclass(frozen=True)
class Workload:
    """What one iteration trains: global_batch_size sequences of seq_length tokens."""

    model: ModelSpec
    seq_length: int
    global_batch_size: int
    zero_stage: int = 1


@dataclass(frozen=True)
class ParallelShape:
    """The discrete choices of a uniform layout, everything but the layer split.

    schedule: "1f1b", or "interleaved" with virtual_stages > 1 model chunks
    per pipeline rank. num_microbatches is per replica. cp: context-parallel ranks that split each
    sequence (`cost_models.context_parallel`); a stage runs on tp x cp GPUs. ep: expert-parallel size of a
    mixture of experts, its routed experts split over ep ranks; etp: expert tensor parallelism, each expert
    split over etp ranks (None: tp, Megatron's default), so an EP group spans ep x etp / tp consecutive TP
    groups, a replica's CP ranks first (`expert_span`, `expert_replicas`, `cost_models.expert_parallel`).
    dp_shard: replicas whose ZeRO state is sharded together, dp_shard consecutive replicas to a shard group
    and dp / dp_shard groups holding the same shards (hybrid sharding, `cost_models.sharded_dp`); None: all
    dp replicas, one group.
    """

    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    recompute: str
    schedule: str = "1f1b"
    virtual_stages: int = 1
    cp: int = 1
    ep: int = 1
    dp_shard: int | None = None
    etp: int | None = None

    def __post_init__(self) -> None:
        if self.etp == self.tp:  # one spelling of Megatron's default, so equal layouts compare equal
            object.__setattr__(self, "etp", None)

    def num_microbatches(self, global_batch_size: int) -> int:
        return global_batch_size // (self.dp * self.micro_batch_size)

    @property
    def group_size(self) -> int:
        """GPUs of one stage: its TP group times its CP group."""
        return self.tp * self.cp

    @property
    def expert_tp(self) -> int:
        """Ranks each routed expert is split over."""
        return self.tp if self.etp is None else self.etp

    @property
    def expert_span(self) -> int:
        """TP groups one EP group spans (ep ranks of etp-wide experts), CP ranks of a replica first."""
        return max(1, self.ep * self.expert_tp // self.tp)

    @property
    def expert_replicas(self) -> int:
        """Consecutive replicas one EP group spans (1 when it lies within a replica's CP ranks)."""
        return max(1, self.expert_span // self.cp)

    @property
    def shard_group_holds_ep_groups(self) -> bool:
        """Whether every EP group lies inside one ZeRO shard group (always without hybrid sharding): hybrid
        sharding then shards the experts over the expert ranks of the shard group and replicates them across
        the groups, as torchtitan's (dp_replicate, efsdp, ep) mesh and megatron-core's partial expert
        data-parallel groups (`--num-distributed-optimizer-instances`) do."""
        return (self.shard_replicas * self.cp) % self.expert_span == 0

    @property
    def grad_sync_ranks(self) -> int:
        """Ranks holding the same weights, whose gradients are reduced together: replicas times CP ranks."""
        return self.dp * self.cp

    @property
    def shard_replicas(self) -> int:
        """Replicas of one ZeRO shard group."""
        return self.dp if self.dp_shard is None else self.dp_shard

    @property
    def hybrid_sharded(self) -> bool:
        """Whether shard groups are replicated: the ZeRO state is sharded over fewer than all replicas."""
        return self.shard_replicas < self.dp

    @property
    def devices(self) -> int:
        return self.group_size * self.pp * self.dp
