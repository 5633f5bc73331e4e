"""The inputs of an iteration estimate: hardware, workload and one parallel layout."""

from __future__ import annotations

from dataclasses import dataclass

from cost_models.hardware import GpuSpec
from cost_models.model_spec import ModelSpec


@dataclass(frozen=True)
class Hardware:
    """A homogeneous cluster's GPU and links (bandwidths unidirectional GB/s per GPU)."""

    gpu: GpuSpec
    gpus_per_node: int
    intra_node_bandwidth_gb_s: float
    inter_node_bandwidth_gb_s: float


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
    mixture of experts, its routed experts split over ep consecutive replicas (`cost_models.expert_parallel`).
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

    def num_microbatches(self, global_batch_size: int) -> int:
        return global_batch_size // (self.dp * self.micro_batch_size)

    @property
    def group_size(self) -> int:
        """GPUs of one stage: its TP group times its CP group."""
        return self.tp * self.cp

    @property
    def grad_sync_ranks(self) -> int:
        """Ranks holding the same weights, whose gradients are reduced together: replicas times CP ranks."""
        return self.dp * self.cp

    @property
    def devices(self) -> int:
        return self.group_size * self.pp * self.dp
