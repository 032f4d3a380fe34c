"""Step time = compute + exposed communication + pipeline bubble.

Algorithm, per micro-batch of one device (F forward, B backward incl. recomputation):
  * ZeRO-3: the wall time of each phase comes from DeepSpeed's schedule simulated module by module
    (zero3.py, parallelism.zero3_phases): exposed = phase time - its compute.
  * Otherwise forward-phase communication runs on its own stream while earlier layers compute.
    Exposed = max(first chunk, comm - F): the first unit's gather has nothing before it to hide
    behind, and what exceeds the window waits. Hidden communication still costs overlap_slowdown of
    its length in compute (its kernels take SMs and HBM bandwidth from the GEMMs it overlaps).
  * Backward-phase communication (ZeRO-3 gathers and reduce_scatters, ZeRO-2 reduce_scatters) likewise
    against B, with the last reduction exposed (nothing computes after it).
  * ZeRO-0/1 gradient all_reduce overlaps only the last micro-batch's backward; the last bucket is
    exposed.
  * Blocking communication (TP all_reduces, pipeline send/recv) adds in full.
Per step: m micro-batches of (compute + exposed); pipelines (GPipe and 1F1B alike) add (pp - 1)
micro-batch slots of bubble (Narayanan et al. 2021: bubble fraction (pp-1)/(m+pp-1)), (pp - 1) / V
with V chunks per rank (the interleaved schedule, same paper); with stages of unequal blocks, the
slowest rank paces the others and each other rank's slot is filled and drained once
(pipeline_bubble); then the optimizer step and the ZeRO-1/2 post-step weight gather, neither of
which overlaps anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from scalestudy.perfmodel import parallelism as par
from scalestudy.perfmodel.compute import ComputeTimes
from scalestudy.perfmodel.params import ModelParams


@dataclass(frozen=True)
class StepTime:
    compute_s: float   # per step, per device, including the optimizer
    comm_s: float      # all communication issued per step, hidden or not
    exposed_s: float   # communication nothing overlapped
    bubble_s: float    # pipeline fill and drain
    step_s: float


def _exposed(comms: list[par.Comm], phase: str, window_s: float) -> tuple[float, float]:
    """(exposed, hidden) seconds of one phase's communication against a compute window."""
    selected = [c for c in comms if c.phase == phase]
    if not selected:
        return 0.0, 0.0
    total = sum(c.time_s for c in selected)
    chunk = max(c.chunk_s for c in selected)
    exposed = min(total, max(chunk, total - window_s))
    return exposed, total - exposed


def fill_speedup(pp: int, shared_node_slowdown: float) -> float:
    """How much faster the fill and drain compute than the steady state: there, on average half
    the stages compute at once, where params.shared_node_slowdown prices every device of a node
    busy (CPU cores sharing caches and memory bandwidth; 1 on GPUs). Linear in the devices busy,
    1 when one is: pp = 2 fills and drains alone, at the lone device's speed."""
    if shared_node_slowdown <= 1.0 or pp < 2:
        return 1.0
    busy = max(0.0, pp / 2 - 1) / (pp - 1)  # share of the node's other devices busy with it
    return shared_node_slowdown / (1.0 + (shared_node_slowdown - 1.0) * busy)


def pipeline_bubble(slot: float, ct: ComputeTimes, m: int, pp: int, virtual: int,
                    blocks: tuple[int, ...] | None, speedup: float = 1.0) -> tuple[float, float]:
    """(pace, bubble): the slot of the pipeline rank that paces the others and the seconds of fill
    and drain per step, from ``slot``, one micro-batch's compute and blocking communication on the
    stage ct describes (the last: it runs the LM head, with num_layers / pp blocks).

    Balanced stages (no blocks given): that slot paces, bubble (pp - 1) / V slots. With each rank's
    blocks: rank r's slot is ct's less the blocks it lacks and, but for the last rank, the head
    and loss (ct's time outside its blocks); the slowest rank paces, and every other rank's slot is
    filled and drained once: the pipeline runs m * pace + (sum of the slots - pace) / V, which is
    (m + pp - 1) slots when balanced. The compute of the filled and drained slots runs ``speedup``
    times faster (fill_speedup)."""
    if pp == 1:
        return slot, 0.0
    comm = max(0.0, slot - ct.micro_batch_s)  # exposed and blocking communication of a slot
    if not blocks:
        return slot, (pp - 1) * (comm + ct.micro_batch_s / speedup) / virtual
    per_block = ct.block_forward_s + ct.block_backward_s
    if ct.stage_layers:
        per_block += ct.recompute_s / ct.stage_layers
    outside = max(0.0, ct.micro_batch_s - ct.stage_layers * per_block)  # head, loss, their ops
    compute = [n * per_block + (outside if r == pp - 1 else 0.0) for r, n in enumerate(blocks)]
    slots = [comm + c for c in compute]
    pace = max(slots)
    filled = sum(comm + c / speedup for c in compute) - (comm + compute[slots.index(pace)] / speedup)
    return pace, filled / virtual


def step_time(ct: ComputeTimes, comms: list[par.Comm], grad_accum: int, pp: int,
              p: ModelParams, z3: par.Zero3Phases | None = None,
              blocks: tuple[int, ...] | None = None, virtual_stages: int | None = None) -> StepTime:
    """``blocks``: transformer blocks per pipeline rank (parallelism.pipeline_blocks), None for
    balanced stages; ``virtual_stages``: chunks per rank (parallelism.virtual_stages), None for
    the profile's."""
    m, slow = grad_accum, p.overlap_slowdown
    bwd_window = ct.backward_s + ct.recompute_s
    if z3 is not None:
        exp_f = max(0.0, z3.forward_s - ct.forward_s)
        exp_b = max(0.0, z3.backward_s - bwd_window)
        hid_f, hid_b = z3.forward_comm_s - exp_f, z3.backward_comm_s - exp_b
    else:
        # Per-micro-batch shares of the phases that repeat every micro-batch.
        per_mb = [par.Comm(c.kind, c.phase, c.calls_per_step / m, c.bytes_per_call,
                           c.time_per_call_s, c.chunk_s)
                  for c in comms if c.phase in (par.FORWARD, par.BACKWARD)]
        exp_f, hid_f = _exposed(per_mb, par.FORWARD, ct.forward_s)
        exp_b, hid_b = _exposed(per_mb, par.BACKWARD, bwd_window)
    blocking_mb = sum(c.time_s for c in comms if c.phase == par.BLOCKING) / m
    compute_mb = ct.micro_batch_s + slow * (hid_f + hid_b)
    slot = compute_mb + exp_f + exp_b + blocking_mb
    # The last backward also hides the ZeRO-0/1 all_reduce, in what its own traffic left free.
    spare = max(0.0, bwd_window - hid_b - exp_b)
    exp_last, hid_last = _exposed(comms, par.LAST_BACKWARD, spare)
    after = sum(c.time_s for c in comms if c.phase == par.AFTER_STEP)
    pace, bubble = pipeline_bubble(slot, ct, m, pp, virtual_stages or p.pipeline_virtual_stages,
                                   blocks, fill_speedup(pp, p.shared_node_slowdown))
    compute_mb += pace - slot  # the pacing rank's compute (unequal stages; 0 when balanced)
    compute = m * compute_mb + ct.optimizer_s + slow * hid_last
    exposed = m * (exp_f + exp_b + blocking_mb) + exp_last + after
    step = compute + exposed + bubble
    return StepTime(compute, sum(c.time_s for c in comms), exposed, bubble, step)
