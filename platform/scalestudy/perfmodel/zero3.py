"""DeepSpeed ZeRO-3 as it runs one micro-batch: which parameters it gathers, in which collectives,
when, and how much of that the compute stream hides.

What DeepSpeed does (deepspeed/runtime/zero/partitioned_param_coordinator.py, stage3.py; defaults from
its ZeRO config, which the trial's DeepSpeed config keeps):
  * Parameters of at most stage3_param_persistence_threshold (1e5) elements stay gathered on every
    rank (norms, small biases): never communicated.
  * Before each module runs, fetch_sub_module all-gathers that module's parameters that are not
    available (one coalesced all_gather), waits for them, then prefetches the next parameters of the
    recorded trace until it has launched stage3_prefetch_bucket_size (5e7) elements, never more than
    stage3_max_live_parameters (1e9) gathered at once. In steady state the gathers therefore come in
    groups of >= 5e7 elements (one per large weight), each one coalesced collective, issued at most
    1e9 elements ahead of the module that needs it: a group that does not fit in that window is
    fetched on demand when its module starts, with nothing to hide it.
  * After a module runs its parameters are released unless the trace uses them again within
    stage3_max_reuse_distance (1e9) elements. So the last blocks of the forward stay gathered for the
    backward; the others are gathered again in backward -- or, under activation checkpointing, in
    the recompute forward, after which their backward reuses them (reuse distance ~0). Per
    micro-batch that is two gathers of (nearly) every weight, with or without checkpointing.
  * Gradients are reduce_scattered in buckets of reduce_bucket_size (5e8) elements on a separate
    stream; before a bucket is reused the compute stream waits for its previous reduce_scatter.
    Parameter gathers and gradient reductions share the data-parallel process group, hence one
    NCCL stream: they run one after another.
  * With gradient accumulation every micro-batch repeats all of it.

The schedule is simulated unit by unit (a unit = one gather group and the compute of its modules,
the compute split over the groups by their share of the block's weights), with two streams: compute
and communication. Identical blocks repeat, so once a block's timing repeats the rest of the segment
is extrapolated (keeps a prediction well under a millisecond).
"""

from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from scalestudy.spec.catalog import ModelDims

PERSISTENCE_THRESHOLD = 1e5
PREFETCH_BUCKET = 5e7
MAX_LIVE = 1e9
MAX_REUSE_DISTANCE = 1e9
REDUCE_BUCKET = 5e8


@functools.lru_cache(maxsize=1024)
def block_weights(dims: ModelDims, tp: int) -> tuple[float, ...]:
    """Parameters (elements per tp rank) a transformer block gathers, in the order its modules run.
    Llama (HF): q, k, v, o, gate, up, down; GPT: fused qkv (+ bias), attention output, fc1, fc2.
    Anything at or below the persistence threshold (norms, most biases) is never gathered."""
    h, f = dims.hidden_size, dims.ffn
    kv = dims.kv_heads * dims.head_dim
    if dims.architecture == "llama":
        weights = [h * h, h * kv, h * kv, h * h, h * f, h * f, f * h]
    else:
        weights = [h * (h + 2 * kv), h + 2 * kv, h * h, h, h * f, f, f * h, h]
    return tuple(w / tp for w in weights if w / tp > PERSISTENCE_THRESHOLD)


def gather_groups(weights: tuple[float, ...]) -> tuple[float, ...]:
    """Elements per coalesced all_gather: the prefetcher closes a group once it reaches the bucket."""
    groups, acc = [], 0.0
    for w in weights:
        acc += w
        if acc >= PREFETCH_BUCKET:
            groups.append(acc)
            acc = 0.0
    if acc:
        groups.append(acc)
    return tuple(groups)


class Unit(NamedTuple):
    """A gather group and the compute of its modules (a NamedTuple: a phase is memoised on its
    units, and a prediction builds dozens of them)."""

    compute_s: float
    gather_s: float = 0.0
    numel: float = 0.0
    reduce_s: float = 0.0  # reduce_scatter issued once this unit's gradients exist


@dataclass(slots=True)  # slots: the simulation reads and writes these fields per unit
class _State:
    compute_end: float = 0.0
    comm_free: float = 0.0     # the communication stream is free from here (pending reduction aside)
    reduce_end: float = 0.0    # the last committed reduce_scatter ends
    pending: tuple[float, float] | None = None  # a reduce_scatter (launch, seconds) not yet placed
    busy: float = 0.0
    # Recent gathers, (fetch time - history_base, elements): the base moves when the rest of a
    # segment is extrapolated, so shifting the clock leaves the entries untouched.
    history: deque | None = None
    history_base: float = 0.0
    # Elements the prefetcher may hold gathered ahead of the running unit, its own included
    # (DeepSpeed: stage3_max_live_parameters; FSDP: two blocks, see block_prefetch_window).
    max_live: float = MAX_LIVE

    def shift(self, dt: float, busy: float) -> None:
        self.compute_end += dt
        self.comm_free += dt
        self.reduce_end += dt
        if self.pending:
            self.pending = (self.pending[0] + dt, self.pending[1])
        self.busy += busy
        self.history_base += dt

    def commit(self) -> None:
        """Place the pending reduction on the communication stream (launch order)."""
        if self.pending:
            launch, secs = self.pending
            self.reduce_end = self.comm_free = max(self.comm_free, launch) + secs
            self.pending = None


def _issue_time(s: _State, fetch_t: float, numel: float) -> float:
    """Earliest time the prefetcher launches this unit's gather: at the fetch of the earliest
    preceding unit from which everything up to this one fits in the live-parameter window."""
    earliest, live = fetch_t - s.history_base, numel
    for t, n in reversed(s.history):
        live += n
        if live > s.max_live:
            break
        earliest = t
    return earliest + s.history_base


def _run_unit(s: _State, u: Unit, prefetch: bool) -> None:
    """One unit on the two streams. Collectives run in the order they were launched: a prefetched
    gather launched before a pending reduction goes ahead of it."""
    # Conditional expressions rather than max(): this runs for every unit of every simulated block.
    fetch_t = ready = s.compute_end
    compute_s, gather_s, numel, reduce_s = u
    if gather_s > 0:
        issue = _issue_time(s, fetch_t, numel) if prefetch else fetch_t
        if s.pending and s.pending[0] <= issue:
            s.commit()
        free = s.comm_free
        s.comm_free = free = (free if free > issue else issue) + gather_s
        s.busy += gather_s
        if free > ready:
            ready = free
    else:
        numel = 0.0
    end = ready + compute_s
    if reduce_s > 0:
        s.commit()
        if s.reduce_end > end:  # bucket reuse waits for the last reduction
            end = s.reduce_end
        s.pending = (end, reduce_s)
        s.busy += reduce_s
    s.compute_end = end
    s.history.append((fetch_t - s.history_base, numel))


def _same_period(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    """Two blocks' timings equal to 1e-9 relative (a loop: this runs once per simulated block)."""
    for x, y in zip(a, b):
        if abs(x - y) > 1e-9 * max(1e-6, abs(x)):
            return False
    return True


MAX_SIMULATED_BLOCKS = 8  # transients of the window settle within a few blocks


def _run_segment(s: _State, units: tuple[Unit, ...], repeat: int, prefetch: bool) -> None:
    """Run `repeat` copies of a block; once a block's timing repeats (or after a few blocks, when
    the window's transient has settled), extrapolate the rest at the last block's period."""
    last = None
    for i in range(repeat):
        t0, b0 = s.compute_end, s.busy
        for u in units:
            _run_unit(s, u, prefetch)
        pend = s.pending[0] - s.compute_end if s.pending else 0.0
        sig = (s.compute_end - t0, s.comm_free - s.compute_end, s.reduce_end - s.compute_end,
               pend, s.busy - b0)
        settled = last is not None and _same_period(sig, last)
        if settled or i + 1 >= MAX_SIMULATED_BLOCKS:
            rest = repeat - i - 1
            s.shift(rest * sig[0], rest * sig[4])
            return
        last = sig


@functools.lru_cache(maxsize=4096)
def run_phase(segments: tuple[tuple[tuple[Unit, ...], int], ...],
              prefetch: bool = True, max_live: float = MAX_LIVE) -> tuple[float, float, float]:
    """(phase seconds, communication seconds issued, compute seconds) of one phase: segments of
    units repeated (a block's units x number of blocks). The phase ends when both streams are idle.
    prefetch False: every gather is launched when its module starts (no trace-based prefetch)."""
    s = _State(history=deque(maxlen=64), max_live=max_live)
    compute = 0.0
    for units, repeat in segments:
        if repeat > 0:
            _run_segment(s, units, repeat, prefetch)
            compute += repeat * sum(u.compute_s for u in units)
    s.commit()
    return max(s.compute_end, s.comm_free), s.busy, compute


def retained_blocks(block_numel: float, head_numel: float, blocks: int) -> int:
    """Blocks whose forward parameters are reused by the backward within the reuse distance (the
    elements gathered in between: the blocks after it, the head, and those blocks again in backward)."""
    if block_numel <= 0:
        return blocks
    room = MAX_REUSE_DISTANCE - head_numel
    return max(0, min(blocks, int(room // (2 * block_numel)) + 1)) if room >= 0 else 0
