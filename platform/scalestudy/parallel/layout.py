"""THE layout of a trial: world, dp, tp, pp, micro-batch, accumulation, global batch, nodes.

The only place in scalestudy that divides a world or a batch. Every consumer asks it: the spec's
expansion (degrees, nodes, infeasibility reasons), the elastic resize, the DeepSpeed config, the
trial body (process grid, which rows of the global batch a rank trains on), the performance model
(placement of each process group over nodes) and the analysis fixtures.

As in torchtitan's ParallelDims, the degrees are checked once, here, with one-line reasons; as in
picotron, every process group comes from one grid `arange(world).view(dp, pp, tp)` (tp innermost):
a tp group is tp consecutive ranks (inside a node while tp <= devices per node), pipeline neighbours
are tp ranks apart, a dp group strides tp * pp ranks. Ranks fill nodes in order (rank // devices
per node), as Ray Train and torchrun place them.

Pure Python, importing nothing else of scalestudy but its error types: the sweep, the workers and
the performance model all agree on one layout.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass
from typing import Protocol

from scalestudy.errors import InfeasibleTrial, ReasonClass

GRID_AXES = ("dp", "pp", "tp")  # the grid's dimensions, outermost first


class ModelShape(Protocol):
    """What the layout needs to know of a model (spec.catalog.ModelDims has it)."""

    architecture: str
    num_layers: int
    num_heads: int
    max_seq_len: int

    @property
    def kv_heads(self) -> int: ...

    @property
    def ffn(self) -> int: ...


@dataclass(frozen=True)
class Layout:
    world_size: int
    dp: int
    tp: int
    pp: int
    micro_batch: int
    grad_accum: int
    global_batch: int
    devices_per_node: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "dp", "tp", "pp", "micro_batch", "grad_accum", "global_batch",
                     "devices_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")

    # --- construction -------------------------------------------------------------------------
    @classmethod
    def of(cls, world_size: int, tp: int = 1, pp: int = 1, micro_batch: int = 1,
           global_batch: int | None = None, devices_per_node: int = 1) -> Layout:
        """The layout, or InfeasibleTrial naming what does not divide. global_batch None is weak
        scaling (every dp rank adds one micro-batch); an int is strong scaling (accumulation makes
        it up, so it must divide by micro_batch * dp)."""
        if world_size % (tp * pp):
            raise InfeasibleTrial(
                f"world_size {world_size} is not divisible by tp*pp = {tp}*{pp} = {tp * pp}")
        dp = world_size // (tp * pp)
        if global_batch is None:
            return cls(world_size, dp, tp, pp, micro_batch, 1, micro_batch * dp, devices_per_node)
        if global_batch % (micro_batch * dp):
            raise InfeasibleTrial(
                f"global_batch {global_batch} is not divisible by micro_batch*dp = "
                f"{micro_batch}*{dp} = {micro_batch * dp}")
        return cls(world_size, dp, tp, pp, micro_batch, global_batch // (micro_batch * dp),
                   global_batch, devices_per_node)

    @classmethod
    def lenient(cls, world_size: int, tp: int = 1, pp: int = 1, micro_batch: int = 1,
                global_batch: int | None = None, devices_per_node: int = 1) -> Layout:
        """A layout for a point that may not divide (rounded down, at least 1), so an infeasible
        trial is still recorded with every config column of the schema. Never run one."""
        try:
            return cls.of(world_size, tp, pp, micro_batch, global_batch, devices_per_node)
        except InfeasibleTrial:
            pass
        dp = max(world_size // (tp * pp), 1)
        gb = global_batch or micro_batch * dp
        return cls(world_size, dp, tp, pp, micro_batch, max(gb // (micro_batch * dp), 1), gb,
                   devices_per_node)

    def resized(self, world_size: int) -> Layout:
        """The same trial on another world size at the same global batch (an elastic trial's
        attempt): accumulation absorbs the change, or InfeasibleTrial says why it cannot."""
        return Layout.of(world_size, self.tp, self.pp, self.micro_batch, self.global_batch,
                         self.devices_per_node)

    # --- checks -------------------------------------------------------------------------------
    def check_model(self, model: ModelShape, seq_len: int, virtual_stages: int = 1,
                    fewer_first: int = 0, fewer_last: int = 0) -> None:
        """Tensor parallelism splits heads, KV heads and the FFN width; pipeline stages split
        layers (stage_layer_counts); no architecture runs a sequence longer than its positions
        (learned for GPT, the rotary range the model was configured with for Llama)."""
        for field, size in (("num_heads", model.num_heads), ("num_kv_heads", model.kv_heads),
                            ("ffn_hidden_size", model.ffn)):
            if size % self.tp:
                raise InfeasibleTrial(f"tp {self.tp} does not divide {field} {size}",
                                      ReasonClass.model)
        stage_layer_counts(model.num_layers, self.pp, virtual_stages, fewer_first, fewer_last)
        if seq_len > model.max_seq_len:
            what = "the learned positions" if model.architecture == "gpt" else "the model's max_seq_len"
            raise InfeasibleTrial(f"seq_len {seq_len} exceeds {what} ({model.max_seq_len})",
                                  ReasonClass.model)

    # --- nodes --------------------------------------------------------------------------------
    @property
    def nodes(self) -> int:
        """Nodes the world occupies (a partly filled last node counts)."""
        return math.ceil(self.world_size / self.devices_per_node)

    @property
    def ranks_per_node(self) -> int:
        return min(self.world_size, self.devices_per_node)

    def node_of(self, rank: int) -> int:
        return rank // self.devices_per_node

    @property
    def fits_one_node(self) -> bool:
        return self.world_size <= self.devices_per_node

    def check_placement(self, hardware: str = "the hardware", whole_nodes: bool = True) -> None:
        """What a measured trial needs of its nodes: a trial larger than one node takes whole
        nodes (a partly used node would share its links with another trial and put ranks where
        the layout does not expect them), and a TP group, whose collectives run every layer,
        stays inside one node."""
        per_node = self.devices_per_node
        if self.tp > per_node:
            raise InfeasibleTrial(
                f"tp {self.tp} exceeds the {per_node} devices per node of {hardware}: "
                "a TP group would cross nodes", ReasonClass.placement)
        if whole_nodes and not self.fits_one_node and self.world_size % per_node:
            raise InfeasibleTrial(
                f"world_size {self.world_size} spans nodes but is not a multiple of the "
                f"{per_node} devices per node of {hardware}: a trial larger than one node "
                "takes whole nodes", ReasonClass.placement)

    def tp_groups_off_node(self, node_of_rank: list[str]) -> list[list[int]]:
        """The TP groups whose ranks sit on more than one node, given each rank's node (as the
        workers report it at the start of a trial)."""
        return [g for g in self.tp_groups() if len({node_of_rank[r] for r in g}) > 1]

    # --- the process grid ---------------------------------------------------------------------
    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp_rank, pp_rank, tp_rank) of a global rank."""
        return rank // (self.pp * self.tp), (rank // self.tp) % self.pp, rank % self.tp

    def rank(self, dp_rank: int, pp_rank: int, tp_rank: int) -> int:
        return (dp_rank * self.pp + pp_rank) * self.tp + tp_rank

    def grid(self) -> list[list[list[int]]]:
        """`arange(world).view(dp, pp, tp)` as nested lists."""
        return [[[self.rank(d, p, t) for t in range(self.tp)] for p in range(self.pp)]
                for d in range(self.dp)]

    def tp_groups(self) -> list[list[int]]:
        return [[self.rank(d, p, t) for t in range(self.tp)]
                for d in range(self.dp) for p in range(self.pp)]

    def dp_groups(self) -> list[list[int]]:
        return [[self.rank(d, p, t) for d in range(self.dp)]
                for p in range(self.pp) for t in range(self.tp)]

    def pp_groups(self) -> list[list[int]]:
        return [[self.rank(d, p, t) for p in range(self.pp)]
                for d in range(self.dp) for t in range(self.tp)]

    def group_of(self, axis: str, rank: int = 0) -> list[int]:
        """The ranks of `rank`'s group along one grid axis ("dp", "pp" or "tp")."""
        d, p, t = self.coords(rank)
        if axis == "tp":
            return [self.rank(d, p, i) for i in range(self.tp)]
        if axis == "pp":
            return [self.rank(d, i, t) for i in range(self.pp)]
        if axis == "dp":
            return [self.rank(i, p, t) for i in range(self.dp)]
        raise ValueError(f"axis must be one of {', '.join(GRID_AXES)}, got {axis!r}")

    def group_placement(self, axis: str) -> tuple[int, int, int]:
        """(n ranks, ranks per node, nodes) of rank 0's group along `axis`: what a collective over
        that group crosses. Every group of an axis has the same shape when tp * pp and the
        devices per node divide one another, as on every cluster we model."""
        return _placement(self, axis)

    # --- data ---------------------------------------------------------------------------------
    def batch_rows(self, micro_step: int, dp_rank: int) -> slice:
        """Rows of the global batch that dp rank `dp_rank` trains on at accumulation micro-step
        `micro_step`: any layout of the same global batch trains on exactly the same rows."""
        first = (micro_step * self.dp + dp_rank) * self.micro_batch
        return slice(first, first + self.micro_batch)


@functools.lru_cache(maxsize=4096)
def _placement(layout: Layout, axis: str) -> tuple[int, int, int]:
    members = layout.group_of(axis, 0)
    per_node = Counter(layout.node_of(r) for r in members)
    return len(members), max(per_node.values()), len(per_node)


def stage_layer_counts(num_layers: int, pp: int, virtual_stages: int = 1, fewer_first: int = 0,
                       fewer_last: int = 0) -> list[int]:
    """Transformer blocks of each pipeline stage, in stage order (pp * virtual_stages stages; stage
    s runs on pipeline rank s % pp, the interleaved schedule's loop placement), or InfeasibleTrial.

    As torchtitan splits a model: the first stage also runs the embedding and the last the final
    norm, LM head and loss, so either may take `fewer_first` / `fewer_last` blocks than the others.
    The blocks plus those "missing" ones are split evenly (they must divide), then the first and
    last stages give theirs up; every stage keeps at least one block. At the defaults this is the
    even split, refused with the historic message when pp does not divide the layers."""
    stages = pp * virtual_stages
    effective = num_layers + fewer_first + fewer_last
    if effective % stages:
        if stages == pp and not (fewer_first or fewer_last):
            raise InfeasibleTrial(f"pp {pp} does not divide num_layers {num_layers}",
                                  ReasonClass.model)
        extra = f" + fewer first/last {fewer_first}+{fewer_last}" if fewer_first or fewer_last else ""
        raise InfeasibleTrial(
            f"{stages} pipeline stages (pp {pp} x virtual_stages {virtual_stages}) do not divide "
            f"num_layers {num_layers}{extra}", ReasonClass.model)
    counts = [effective // stages] * stages
    counts[0] -= fewer_first
    counts[-1] -= fewer_last
    if min(counts) < 1:
        raise InfeasibleTrial(
            f"pipeline stages of {counts} blocks: every stage needs at least one (num_layers "
            f"{num_layers}, {stages} stages, fewer first/last {fewer_first}+{fewer_last})",
            ReasonClass.model)
    return counts


def stage_ranges(counts: list[int]) -> list[range]:
    """Block indices of each stage (consecutive, in stage order) from stage_layer_counts."""
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return [range(a, a + n) for a, n in zip(starts, counts)]
