"""The one process grid every group comes from: ranks = arange(world).view(dp, pp, tp).

Tensor-parallel groups are consecutive ranks, so they share a node (NVLink) as long as tp divides
the GPUs per node; data-parallel groups stride across them. Pure Python so the sweep, the worker and
the performance model agree on the same layout.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProcessGrid:
    world_size: int
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1 or self.world_size % (self.tp * self.pp):
            raise ValueError(
                f"world_size {self.world_size} is not divisible by tp*pp = {self.tp}*{self.pp}"
            )

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp_rank, pp_rank, tp_rank) of a global rank."""
        return rank // (self.pp * self.tp), (rank // self.tp) % self.pp, rank % self.tp

    def rank(self, dp_rank: int, pp_rank: int, tp_rank: int) -> int:
        return (dp_rank * self.pp + pp_rank) * self.tp + tp_rank

    def tp_groups(self) -> list[list[int]]:
        return [[self.rank(d, p, t) for t in range(self.tp)]
                for d in range(self.dp) for p in range(self.pp)]

    def dp_groups(self) -> list[list[int]]:
        return [[self.rank(d, p, t) for d in range(self.dp)]
                for p in range(self.pp) for t in range(self.tp)]

    def pp_groups(self) -> list[list[int]]:
        return [[self.rank(d, p, t) for p in range(self.pp)]
                for d in range(self.dp) for t in range(self.tp)]
