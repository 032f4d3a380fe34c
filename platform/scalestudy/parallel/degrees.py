"""Parallel degrees of a trial and the checks that make a combination runnable.

Every check raises InfeasibleTrial with a one-line reason: a grid point that does not divide is an
expected outcome of a sweep (recorded, not crashed on), as in picotron and calculon.
"""

from __future__ import annotations

from dataclasses import dataclass

from scalestudy.spec.catalog import ModelDims
from scalestudy.spec.errors import InfeasibleTrial


@dataclass(frozen=True)
class Degrees:
    world_size: int
    dp: int
    tp: int
    pp: int
    micro_batch: int
    grad_accum: int
    global_batch: int


def derive_degrees(
    world_size: int, tp: int, pp: int, micro_batch: int, global_batch: int | None
) -> Degrees:
    if world_size % (tp * pp):
        raise InfeasibleTrial(
            f"world_size {world_size} is not divisible by tp*pp = {tp}*{pp} = {tp * pp}"
        )
    dp = world_size // (tp * pp)
    if global_batch is None:  # weak scaling: every dp rank adds one micro-batch
        return Degrees(world_size, dp, tp, pp, micro_batch, 1, micro_batch * dp)
    if global_batch % (micro_batch * dp):
        raise InfeasibleTrial(
            f"global_batch {global_batch} is not divisible by micro_batch*dp = "
            f"{micro_batch}*{dp} = {micro_batch * dp}"
        )
    return Degrees(
        world_size, dp, tp, pp, micro_batch, global_batch // (micro_batch * dp), global_batch
    )


def check_model_split(model: ModelDims, tp: int, pp: int) -> None:
    """Tensor parallelism splits heads, KV heads and the FFN width; pipeline stages split layers."""
    for field, size in (
        ("num_heads", model.num_heads),
        ("num_kv_heads", model.kv_heads),
        ("ffn_hidden_size", model.ffn),
    ):
        if size % tp:
            raise InfeasibleTrial(f"tp {tp} does not divide {field} {size}")
    if model.num_layers % pp:
        raise InfeasibleTrial(f"pp {pp} does not divide num_layers {model.num_layers}")
