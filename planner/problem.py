"""The validated planning problem: frozen dataclasses built once from a request."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from cost_models.choices import Recompute, ScheduleName
from cost_models.efficiency import EfficiencyParams, SoftwareConfig
from cost_models.hardware import GIB
from cost_models.layout import Hardware, Workload
from cost_models.memory import DEFAULT_MEMORY_RESERVE_GIB
from planner.config import DEFAULT_CONFIG, PlannerConfig
from planner.numbers import divisors

# Most context-parallel ranks per stage a search tries unless the request says otherwise
# (`options.max_context_parallel`): Llama 3's 128k phase used 16, NVIDIA's 1M-token recipes 32. By default
# only sequences of at least DEFAULT_CP_MIN_SEQ_LENGTH tokens are split: below it the published runs train
# without CP (Llama 3 at 8k; NeMo's best Llama2-7B/Llama3-8B layouts up to 16k), the gains the model
# predicts there are within its error, and a CP plan is one DeepSpeed cannot run. A request that sets
# the option gets CP at any length.
DEFAULT_MAX_CONTEXT_PARALLEL = 32
DEFAULT_CP_MIN_SEQ_LENGTH = 16384


def default_max_context_parallel(seq_length: int) -> int:
    """`options.max_context_parallel` when the request leaves it out."""
    return DEFAULT_MAX_CONTEXT_PARALLEL if seq_length >= DEFAULT_CP_MIN_SEQ_LENGTH else 1
RECOMPUTE_CHOICES = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)
STOCK_SCHEDULES = frozenset({ScheduleName.GPIPE, ScheduleName.ONE_F_ONE_B, ScheduleName.INTERLEAVED})  # what Megatron-LM and DeepSpeed run unchanged
CHUNKED_SCHEDULES = frozenset({ScheduleName.INTERLEAVED, ScheduleName.LOOPED_BFS, ScheduleName.OPTIMIZED})  # for v > 1 chunks per stage
SINGLE_CHUNK_SCHEDULES = frozenset({ScheduleName.GPIPE, ScheduleName.ONE_F_ONE_B, ScheduleName.ZB_H1, ScheduleName.ZB_H2, ScheduleName.OPTIMIZED})


@dataclass(frozen=True)
class ClusterState:
    """Which devices exist, which are dead, how fast the slow ones still are.

    failed: (node, gpu) pairs, whole-node failures already expanded.
    slow: ((node, gpu), speed) pairs with speed in (0, 1), failed ones removed.
    """

    num_nodes: int
    gpus_per_node: int
    failed: frozenset[tuple[int, int]] = frozenset()
    slow: tuple[tuple[tuple[int, int], float], ...] = ()

    @property
    def total_devices(self) -> int:
        return self.num_nodes * self.gpus_per_node

    # Cached: a cluster may list 131,072 slow devices, and the planner asks about every GPU of every
    # damaged node several times (a scan per question took minutes at 50,000 slow devices).
    @cached_property
    def damaged_nodes(self) -> frozenset[int]:
        return frozenset(node for node, _ in self.failed) | frozenset(node for (node, _), _ in self.slow)

    @cached_property
    def _speeds(self) -> dict[tuple[int, int], float]:
        return dict(self.slow)

    def speed_of(self, node: int, gpu: int) -> float:
        return self._speeds.get((node, gpu), 1.0)

    @cached_property
    def healthy_by_speed(self) -> dict[int, tuple[tuple[int, float], ...]]:
        """Per damaged node, its healthy GPUs as (gpu, speed), fastest first, ties by GPU index."""
        speeds = self._speeds
        ranked = {}
        for node in self.damaged_nodes:
            gpus = [(g, speeds.get((node, g), 1.0)) for g in range(self.gpus_per_node) if (node, g) not in self.failed]
            gpus.sort(key=lambda item: (-item[1], item[0]))
            ranked[node] = tuple(gpus)
        return ranked

    @cached_property
    def memo(self) -> dict:
        """Figures derived from this cluster state once and read by several phases (slot inventories
        per TP size): at 16,384 damaged nodes each costs a tenth of a second."""
        return {}


@dataclass(frozen=True)
class PlanningProblem:
    """Everything the planner needs, already validated.

    micro_batch_size / recompute: None / "auto" let the planner choose; so does zero_stage_auto
        (`workload.zero_stage` is then only a placeholder).
    stock_layouts_only: restrict to layouts stock Megatron-LM, DeepSpeed and
        torchtitan run unchanged (equal middle stages, uneven first/last only).
    """

    hardware: Hardware
    cluster: ClusterState
    workload: Workload
    model_name: str
    micro_batch_size: int | None = None
    recompute: str = "auto"
    precision: str = "bf16"
    stock_layouts_only: bool = False
    zero_stage_auto: bool = False  # plan every ZeRO stage and keep the fastest (planner.zero_choice)
    time_limit_s: float = 10.0
    random_seed: int = 0
    schedules: frozenset[str] | None = None  # pipeline schedules allowed; None: all (stock ones if stock_layouts_only)
    memory_reserve_gib: float = DEFAULT_MEMORY_RESERVE_GIB  # per GPU, left free for what the model does not count
    max_context_parallel: int = DEFAULT_MAX_CONTEXT_PARALLEL  # most CP ranks per stage searched; 1: none
    max_expert_parallel: int | None = None  # most replicas a mixture of experts' experts are split over; None: any
    allow_hybrid_sharding: bool = True  # ZeRO-2/3 may shard over a node's replicas, replicated across nodes
    calibration_id: str | None = None  # the stored calibration `efficiency` comes from; None: the built-in fit
    efficiency: EfficiencyParams = field(default_factory=EfficiencyParams)
    software: SoftwareConfig = field(default_factory=SoftwareConfig)
    config: PlannerConfig = DEFAULT_CONFIG  # the planner's tuning (planner.config)

    @property
    def usable_memory_gib(self) -> float:
        """What a stage may fill on one GPU: its capacity less the memory reserve."""
        return self.hardware.gpu.memory_gib - self.memory_reserve_gib

    @property
    def usable_memory_bytes(self) -> float:
        return self.usable_memory_gib * GIB

    def capacity_text(self) -> str:
        """The usable memory in words, for messages: "a A100-80GB holds 77 GiB after the 3 GiB reserve"."""
        gpu = self.hardware.gpu
        return f"a {gpu.name} holds {self.usable_memory_gib:g} GiB ({gpu.memory_gib:g} less the {self.memory_reserve_gib:g} GiB memory reserve)"

    @property
    def recompute_modes(self) -> tuple[str, ...]:
        """Modes to search. With flash attention, selective recompute stores exactly what no
        recompute stores (the score matrix never exists) and computes more, so `auto` skips it."""
        if self.recompute != "auto":
            return (self.recompute,)
        if self.software.flash_attention:
            return tuple(mode for mode in RECOMPUTE_CHOICES if mode != Recompute.SELECTIVE)
        return RECOMPUTE_CHOICES

    @property
    def allowed_schedules(self) -> frozenset[str] | None:
        """Pipeline schedules the plan may use; None: any."""
        if self.schedules is not None:
            return self.schedules
        return STOCK_SCHEDULES if self.stock_layouts_only else None

    def allows_virtual_stages(self, virtual_stages: int) -> bool:
        """Whether some allowed schedule runs `virtual_stages` model chunks per stage."""
        allowed = self.allowed_schedules
        if allowed is None:
            return True
        return bool(allowed & (CHUNKED_SCHEDULES if virtual_stages > 1 else SINGLE_CHUNK_SCHEDULES))

    @cached_property
    def micro_batch_sizes(self) -> tuple[int, ...]:
        """Micro-batch sizes the plan may use: the request's, else every divisor of the global batch (or
        the configured ones that divide it)."""
        if self.micro_batch_size is not None:
            return (self.micro_batch_size,)
        batch = self.workload.global_batch_size
        sizes = self.config.micro_batch_sizes
        return tuple(b for b in (sizes if sizes is not None else divisors(batch)) if batch % b == 0)
