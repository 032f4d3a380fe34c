"""Exposed communication: interval arithmetic (pure) and a torch.profiler chrome-trace parser.

What the figures mean (README text)
-----------------------------------
``comm_exposed_s`` is the time, per optimizer step, during which at least one collective is in flight
and no compute is running, measured from a ``torch.profiler`` trace of the profiled window (never the
timed window). ``comm_time_s`` is the time during which at least one collective is in flight (the
union, so two collectives running concurrently count once). ``comm_exposed_fraction`` is exposed time
divided by the profiled step time, so it always lies in [0, 1].

* GPU / NCCL: collectives are the NCCL kernels (``nccl*`` kernel names) on their own streams; compute is
  every other kernel on any stream. Exposed = time an NCCL kernel runs while no other kernel runs on
  the device. This is the standard definition (e.g. HTA's comm/comp overlap).
* CPU / gloo: gloo runs each collective on its own worker threads; the trace shows it there as a
  ``gloo:<op>`` span from the moment a worker picks it up until it completes (this includes waiting for
  the slowest peer). The calling thread shows a short ``c10d::<op>`` span (enqueue; for gloo's
  emulated reduce_scatter also the clone/copy it needs) and then nothing while it waits. Collectives
  in flight = the ``gloo:*`` spans plus the ``c10d::*`` spans; compute = every other op on every other
  thread (the training thread's aten ops). So on CPU "exposed" means: a collective is in flight and the
  training threads are not inside an aten op. Caveats, all verified on torch 2.13 + gloo: (a) Python
  time between ops is not compute, which biases the figure up; (b) the caller's wake-up after gloo
  finishes is neither comm nor compute, so it is not counted (on an oversubscribed CPU that gap is
  several ms, which is why DeepSpeed's comms-logger latencies read 2-4x the gloo spans); (c) a gloo span
  includes waiting for the slowest peer, as an NCCL kernel does; (d) with one core per rank the gloo
  threads compete with compute for cores, so CPU overlap does not predict GPU overlap. The CPU figure
  checks the method end to end; it is not a statement about GPU clusters.

Collective kinds per span come from ``kind_of`` so the same canonical names (all_reduce, all_gather,
reduce_scatter, broadcast, send_recv, all_to_all, barrier, ...) are used by every source.
"""

from __future__ import annotations

import bisect
import json
import re
from dataclasses import dataclass, field
from typing import Any, Iterable

from scalestudy import metrics as M
from scalestudy.measure.comm_groups import GroupAnnotations

Interval = tuple[float, float]  # (start, end), same unit throughout (the trace's microseconds)


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint union of intervals; empty and inverted intervals are dropped.
    Touching intervals ([0,1] and [1,2]) merge, which does not change any measure."""
    spans = sorted((s, e) for s, e in intervals if e > s)
    out: list[Interval] = []
    for s, e in spans:
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def measure(intervals: Iterable[Interval]) -> float:
    """Total length of the union of the intervals."""
    return sum(e - s for s, e in merge(intervals))


def subtract(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """union(a) minus union(b), as sorted disjoint intervals (two-pointer sweep over merged lists)."""
    base, cut = merge(a), merge(b)
    out: list[Interval] = []
    j = 0
    for s, e in base:
        cur = s
        while j < len(cut) and cut[j][1] <= cur:
            j += 1
        k = j
        while k < len(cut) and cut[k][0] < e:
            cs, ce = cut[k]
            if cs > cur:
                out.append((cur, cs))
            cur = max(cur, ce)
            if cur >= e:
                break
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


def clip(intervals: Iterable[Interval], window: Interval) -> list[Interval]:
    lo, hi = window
    return [(max(s, lo), min(e, hi)) for s, e in intervals if min(e, hi) > max(s, lo)]


def exposed_time(comm: Iterable[Interval], compute: Iterable[Interval]) -> float:
    """Measure of (union of comm intervals) minus (union of compute intervals)."""
    return sum(e - s for s, e in subtract(comm, compute))


# --- canonical collective kinds --------------------------------------------------------------------

KINDS: tuple[str, ...] = M.COLLECTIVE_KINDS


def _pattern(kind: str) -> tuple[str, str]:
    """A kind's spelling in a lower-cased, separator-free op name ("reducescatter"), and the kind."""
    return kind.replace("_", ""), kind


# Ordered: the first pattern that matches the lower-cased, separator-free name wins, so
# "reducescatter" is tested before "reduce" and "allreduce", "allgather" before "gather".
_KIND_PATTERNS: tuple[tuple[str, str], ...] = (
    *map(_pattern, (M.REDUCE_SCATTER, M.ALL_REDUCE, M.ALL_GATHER, M.ALL_TO_ALL, M.BROADCAST,
                    M.SEND_RECV)),
    ("send", M.SEND_RECV),
    ("recv", M.SEND_RECV),
    *map(_pattern, (M.BARRIER, M.REDUCE, M.GATHER, M.SCATTER)),
)


def kind_of(name: str) -> str:
    """Canonical kind of a collective from any spelling we meet: DeepSpeed ops
    (``all_gather_into_tensor``), c10d ops (``c10d::_reduce_scatter_base_``), gloo spans
    (``gloo:all_reduce``), NCCL kernels (``ncclDevKernel_ReduceScatter_Sum_f32_RING_LL``)."""
    key = re.sub(r"[^a-z]", "", name.lower().split("(")[0])
    for pattern, kind in _KIND_PATTERNS:
        if pattern in key:
            return kind
    return M.OTHER


# --- trace parsing ---------------------------------------------------------------------------------


@dataclass
class CollectiveCall:
    """One collective as issued by the caller (a ``c10d::`` op): kind, nccl-tests size in bytes and the
    size of the group it ran in (None: unknown, see measure.comm_groups)."""

    kind: str
    bytes: int
    start_us: float
    end_us: float
    width_known: bool = True  # False: a TensorList, whose element type the trace does not record
    group_size: int | None = None


@dataclass
class TraceIntervals:
    device: str  # "gpu" when the trace has device kernels, else "cpu"
    comm: list[Interval] = field(default_factory=list)
    compute: list[Interval] = field(default_factory=list)
    comm_by_kind: dict[str, list[Interval]] = field(default_factory=dict)  # executed spans per kind
    calls: list[CollectiveCall] = field(default_factory=list)
    # The profiled units, sorted: whole steps (STEP_ANNOTATION) or micro-batches (MICRO_ANNOTATION,
    # BOUNDARY_ANNOTATION for the one that ends the step: gradient reduction, optimizer step).
    units: list[Interval] = field(default_factory=list)
    unit_boundary: list[bool] = field(default_factory=list)  # per unit: it ends an optimizer step


STEP_ANNOTATION = "scalestudy.profiled_step"
MICRO_ANNOTATION = "scalestudy.profiled_micro_batch"
BOUNDARY_ANNOTATION = "scalestudy.profiled_micro_batch.boundary"
_UNIT_BOUNDARY = {STEP_ANNOTATION: True, MICRO_ANNOTATION: False, BOUNDARY_ANNOTATION: True}
PARAM_COMMS = "record_param_comms"
_DTYPE_BYTES = {
    "float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "half": 2, "bfloat16": 2,
    "long int": 8, "int": 4, "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1,
    "c10::complex<float>": 8, "c10::complex<double>": 16,
}


def _prod(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n  # a 0-d tensor (shape []) has one element


# Kinds whose nccl-tests size is the full buffer (the gathered output, the unscattered input).
_FULL_BUFFER_KINDS = (M.ALL_GATHER, M.REDUCE_SCATTER, M.ALL_TO_ALL)


def _call_bytes(kind: str, args: dict[str, Any]) -> tuple[int, bool]:
    """nccl-tests size of a c10d call (needs record_shapes=True): all_gather and reduce_scatter count
    the full (gathered / unscattered) buffer, i.e. the largest tensor argument; others the first one.

    The trace gives each argument's shape and type; a TensorList carries a list of shapes and no
    element type, so its width is taken from a typed tensor argument if any, else 4 (float32)."""
    dims = args.get("Input Dims") or []
    types = args.get("Input type") or []
    typed = [_DTYPE_BYTES[t] for t in types if t in _DTYPE_BYTES]
    sizes = []
    known = True
    for shape, t in zip(dims, types):
        if t == "TensorList":
            known = known and bool(typed)
            sizes.append(sum(_prod(s) for s in shape) * (typed[0] if typed else 4))
        elif t in _DTYPE_BYTES:
            sizes.append(_prod(shape) * _DTYPE_BYTES[t])
    if not sizes or kind == M.BARRIER:
        return 0, True
    if kind in _FULL_BUFFER_KINDS:
        return max(sizes), known
    return sizes[0], known


def _c10d_call(e: dict[str, Any], groups: GroupAnnotations) -> CollectiveCall:
    kind = kind_of(e["name"])
    nbytes, known = _call_bytes(kind, e.get("args", {}))
    end = e["ts"] + e["dur"]
    size = groups.size_at((e.get("pid"), e.get("tid")), e["ts"], end)
    return CollectiveCall(kind, nbytes, e["ts"], end, known, size)


# c10::toString names of dtypes, as record_param_comms writes them
_PARAM_COMMS_DTYPE_BYTES = {
    "Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Short": 2, "Char": 1,
    "Byte": 1, "Bool": 1, "ComplexFloat": 8, "ComplexDouble": 16, "Float8_e4m3fn": 1, "Float8_e5m2": 1,
}


def _param_comms_call(e: dict[str, Any], groups: GroupAnnotations) -> CollectiveCall:
    """A ``record_param_comms`` event (emitted by ProcessGroupNCCL, not by gloo in torch 2.13): it
    names the collective and gives element counts, dtype and group size; nccl-tests size = the larger
    buffer for all_gather / reduce_scatter / all_to_all, the input otherwise."""
    a = e.get("args", {})
    size = _int_or_none(a.get("Group size"))
    if size is None:
        size = groups.size_at((e.get("pid"), e.get("tid")), e["ts"], e["ts"] + e["dur"])
    kind = kind_of(str(a.get("Collective name", "")))
    width = _PARAM_COMMS_DTYPE_BYTES.get(str(a.get("dtype", "")).strip('"'))
    n_in, n_out = int(a.get("In msg nelems", 0) or 0), int(a.get("Out msg nelems", 0) or 0)
    nelems = max(n_in, n_out) if kind in _FULL_BUFFER_KINDS else n_in
    if kind == M.BARRIER:
        nelems = 0
    return CollectiveCall(kind, nelems * (width or 4), e["ts"], e["ts"] + e["dur"], width is not None,
                          size)


def _int_or_none(value: Any) -> int | None:
    try:
        n = int(value)
    except (TypeError, ValueError):
        return None
    return n if n >= 1 else None


def _is_kernel(ev: dict[str, Any]) -> bool:
    return ev.get("cat") in ("kernel", "Kernel")


def intervals_from_chrome_trace(trace: dict[str, Any] | list[dict[str, Any]]) -> TraceIntervals:
    """Comm and compute intervals from an exported chrome trace (``prof.export_chrome_trace``).

    The JSON is used rather than ``prof.events()`` because it has the same shape on CPU and GPU
    (kernels with streams as tids, gloo worker threads as tids) and can be re-analysed offline."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]
    units = sorted((e["ts"], e["ts"] + e["dur"], _UNIT_BOUNDARY[e["name"]]) for e in spans
                   if e.get("name") in _UNIT_BOUNDARY)
    groups = GroupAnnotations(spans)
    # Calls: record_param_comms where the backend emits it (NCCL: exact dtype), else the c10d ops.
    calls = [_param_comms_call(e, groups) for e in spans if e.get("name") == PARAM_COMMS]
    if not calls:
        calls = [_c10d_call(e, groups) for e in spans
                 if e.get("cat") == "cpu_op" and e["name"].startswith("c10d::")]
    out = TraceIntervals(device="gpu" if any(_is_kernel(e) for e in spans) else "cpu",
                         calls=sorted(calls, key=lambda c: c.start_us),
                         units=[(s, t) for s, t, _ in units], unit_boundary=[b for _, _, b in units])

    def add_comm(kind: str, iv: Interval) -> None:
        out.comm.append(iv)
        out.comm_by_kind.setdefault(kind, []).append(iv)

    if out.device == "gpu":
        for e in spans:
            if _is_kernel(e):
                iv = (e["ts"], e["ts"] + e["dur"])
                if "nccl" in e["name"].lower():
                    add_comm(kind_of(e["name"].lower().replace("nccl", "")), iv)
                else:
                    out.compute.append(iv)
        return out

    gloo_tids = {(e.get("pid"), e.get("tid")) for e in spans if e["name"].startswith("gloo:")}
    gloo_spans = sorted((e for e in spans if e["name"].startswith("gloo:")), key=lambda e: e["ts"])
    for e, match in zip(gloo_spans, _attribute_gloo(gloo_spans, out.calls)):
        call = out.calls[match] if match is not None else None
        add_comm(call.kind if call else kind_of(e["name"]), (e["ts"], e["ts"] + e["dur"]))
        # The worker span records the real tensor's dtype; it fills in a TensorList's unknown width.
        if call and not call.width_known and call.kind in (M.ALL_REDUCE, M.BROADCAST, M.REDUCE):
            nbytes, known = _call_bytes(call.kind, e.get("args", {}))
            if known and nbytes:
                call.bytes, call.width_known = nbytes, True
    # The caller's c10d spans are communication too (enqueue, and the copies of emulated ops).
    out.comm.extend((c.start_us, c.end_us) for c in out.calls)
    c10d_by_thread: dict[Any, list[Interval]] = {}
    for e in spans:
        if e.get("cat") == "cpu_op" and e["name"].startswith("c10d::"):
            c10d_by_thread.setdefault((e.get("pid"), e.get("tid")), []).append((e["ts"], e["ts"] + e["dur"]))
    # One thread's c10d spans do not overlap; merged and bisected, the nesting test is O(log n) per op.
    c10d_by_thread = {tid: merge(ivs) for tid, ivs in c10d_by_thread.items()}
    starts = {tid: [iv[0] for iv in ivs] for tid, ivs in c10d_by_thread.items()}
    for e in spans:
        tid = (e.get("pid"), e.get("tid"))
        if e.get("cat") != "cpu_op" or tid in gloo_tids or e["name"].startswith("c10d::"):
            continue
        s, t = e["ts"], e["ts"] + e["dur"]
        # Ops nested in a c10d op on the same thread (gloo's clone for reduce_scatter) are comm work.
        i = bisect.bisect_right(starts.get(tid, []), s) - 1
        if i >= 0 and t <= c10d_by_thread[tid][i][1]:
            continue
        out.compute.append((s, t))
    return out


# Kinds gloo may execute a call as: gloo has no native reduce_scatter, c10d runs it as an all_reduce.
_GLOO_EXECUTES_AS = {M.REDUCE_SCATTER: {M.REDUCE_SCATTER, M.ALL_REDUCE}}


def _attribute_gloo(gloo_spans: list[dict[str, Any]], calls: list[CollectiveCall]) -> list[int | None]:
    """Index of the call each gloo span executes. Gloo dequeues work in issue order, so each span goes
    to the earliest unmatched call issued before it whose kind gloo could execute it as; None when no
    call fits (the span then keeps its own name's kind)."""
    used = [False] * len(calls)
    matches: list[int | None] = []
    first = 0  # calls before this index are all matched: skip them (keeps the scan near-linear)
    for e in gloo_spans:
        own = kind_of(e["name"])
        while first < len(calls) and used[first]:
            first += 1
        match = None
        for i in range(first, len(calls)):
            if calls[i].start_us > e["ts"]:
                break  # calls are sorted by start: none later can have issued this span
            if not used[i] and own in _GLOO_EXECUTES_AS.get(calls[i].kind, {calls[i].kind}):
                match = i
                break
        if match is not None:
            used[match] = True
        matches.append(match)
    return matches


def load_chrome_trace(path: str) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)
