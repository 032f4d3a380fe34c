"""Which process group each collective in a profiler trace ran in: its group size, for bus bandwidth.

NCCL says it itself: ProcessGroupNCCL emits a ``record_param_comms`` event per collective whose args
(torch 2.13, names from libtorch's ParamCommsUtils) include "Collective name", "dtype",
"In msg nelems", "Out msg nelems", "Group size", "Process Group Name", "Process Group Description"
and "Process Group Ranks"; Kineto copies them onto the NCCL kernel events too.

Gloo does not (verified on torch 2.13 with a 4-process gloo trace: no ``record_param_comms`` event at
all, and the ``c10d::*`` op records its ProcessGroup argument as an empty, untyped input). So while
the profiled window runs, ``annotate_group_sizes()`` wraps the collective methods of
``torch.distributed.ProcessGroup``, the one object every Python-issued collective goes through
(torch.distributed's functions, DeepSpeed's comm backend and its cached function references alike),
so that each call runs inside a profiler annotation ``scalestudy.comm_group:<size>``. The parser takes
the annotation that encloses a ``c10d::*`` op on the same thread. The wrappers are removed when the
window ends; outside it nothing is patched. Collectives issued from C++ (DDP's reducer) bypass them;
their group stays unknown and their bus bandwidth NaN.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

GROUP_ANNOTATION = "scalestudy.comm_group"

# ProcessGroup methods that issue a collective (torch 2.13; names a version lacks are skipped).
_METHODS = (
    "allreduce", "allreduce_coalesced", "reduce", "broadcast", "allgather", "all_gather_single",
    "_allgather_base", "allgather_coalesced", "all_gather_single_coalesced",
    "allgather_into_tensor_coalesced", "gather", "scatter", "reduce_scatter", "reduce_scatter_single",
    "_reduce_scatter_base", "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced",
    "all_to_all_single", "alltoall_base", "alltoall", "send", "recv", "recv_anysource", "barrier",
)
_active = False


def annotation_name(group_size: int) -> str:
    return f"{GROUP_ANNOTATION}:{int(group_size)}"


def group_size_of(name: str) -> int | None:
    """The group size an annotation names, None for any other event name."""
    prefix = GROUP_ANNOTATION + ":"
    if not name.startswith(prefix):
        return None
    try:
        return int(name[len(prefix):])
    except ValueError:
        return None


def _wrap(method: Any) -> Any:
    from torch.autograd.profiler import record_function

    def wrapped(self, *args, **kwargs):
        with record_function(annotation_name(self.size())):
            return method(self, *args, **kwargs)

    wrapped.__wrapped__ = method
    return wrapped


@contextmanager
def annotate_group_sizes() -> Iterator[None]:
    """Annotate every collective issued while active with its group size (see the module docstring).
    Re-entrant: an inner use leaves the outer one's wrappers in place."""
    global _active
    if _active:
        yield
        return
    import torch.distributed as dist

    pg = dist.ProcessGroup
    saved = {name: pg.__dict__[name] for name in _METHODS if name in pg.__dict__}
    for name, method in saved.items():
        setattr(pg, name, _wrap(method))
    _active = True
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(pg, name, method)
        _active = False


class GroupAnnotations:
    """Group-size annotations of a trace, per thread, for 'which one encloses this op' lookups."""

    def __init__(self, spans: list[dict[str, Any]]) -> None:
        by_thread: dict[Any, list[tuple[float, float, int]]] = {}
        for e in spans:
            size = group_size_of(str(e.get("name", "")))
            if size is not None:
                by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(
                    (e["ts"], e["ts"] + e["dur"], size))
        self._spans = {k: sorted(v) for k, v in by_thread.items()}
        self._starts = {k: [s for s, _, _ in v] for k, v in self._spans.items()}

    def size_at(self, thread: Any, start: float, end: float) -> int | None:
        """Group size of the annotation on ``thread`` that encloses [start, end], if any. Annotations
        on one thread never overlap (a collective call returns before the next one starts)."""
        spans = self._spans.get(thread)
        if not spans:
            return None
        i = bisect.bisect_right(self._starts[thread], start) - 1
        if i >= 0 and spans[i][1] >= end - 1e-3:  # the trace rounds to 1 ns
            return spans[i][2]
        return None
