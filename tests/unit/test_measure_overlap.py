"""Exposed-communication interval arithmetic and the chrome-trace parser."""

from __future__ import annotations

import pytest

from scalestudy.measure.overlap import (
    BOUNDARY_ANNOTATION, MICRO_ANNOTATION, STEP_ANNOTATION, exposed_time, intervals_from_chrome_trace,
    kind_of, measure, merge, subtract,
)


def test_merge_joins_overlapping_nested_and_touching_and_drops_empty():
    assert merge([(5, 6), (0, 2), (1, 3), (1.5, 1.7), (3, 4), (7, 7), (9, 8)]) == [(0, 4), (5, 6)]


def test_measure_counts_concurrent_intervals_once():
    # two streams carrying collectives at the same time
    assert measure([(0, 10), (5, 15), (20, 21)]) == 16


@pytest.mark.parametrize(
    ("comm", "compute", "exposed"),
    [
        ([(0, 10)], [], 10),                        # nothing to hide behind
        ([(0, 10)], [(0, 10)], 0),                  # fully hidden
        ([(2, 4)], [(0, 10)], 0),                   # comm nested inside compute
        ([(0, 10)], [(2, 4)], 8),                   # compute nested inside comm
        ([(0, 10)], [(5, 15)], 5),                  # partial overlap at the end
        ([(0, 10)], [(-5, 3)], 7),                  # partial overlap at the start
        ([(0, 2), (8, 10)], [(3, 7)], 4),           # disjoint
        ([(0, 10)], [(1, 2), (3, 4), (5, 6)], 7),   # several holes
        ([(0, 4), (2, 6)], [(1, 3), (2, 5)], 2),    # overlapping comm streams, overlapping compute threads
        ([], [(0, 1)], 0),
    ],
)
def test_exposed_time(comm, compute, exposed):
    assert exposed_time(comm, compute) == pytest.approx(exposed)


def test_subtract_returns_the_exposed_pieces():
    assert subtract([(0, 10), (12, 14)], [(2, 3), (5, 13)]) == [(0, 2), (3, 5), (13, 14)]


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("all_reduce", "all_reduce"), ("all_gather_into_tensor", "all_gather"),
        ("reduce_scatter_tensor", "reduce_scatter"), ("c10d::_reduce_scatter_base_", "reduce_scatter"),
        ("c10d::allreduce_", "all_reduce"), ("c10d::_allgather_base_", "all_gather"),
        ("c10d::broadcast_", "broadcast"), ("c10d::barrier", "barrier"), ("gloo:all_gather", "all_gather"),
        ("c10d::send", "send_recv"), ("c10d::recv_", "send_recv"), ("c10d::alltoall_base_", "all_to_all"),
        ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "reduce_scatter"),
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "all_reduce"),
        ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "send_recv"),
        ("c10d::reduce_", "reduce"), ("mystery", "other"),
    ],
)
def test_kind_of(name, kind):
    assert kind_of(name) == kind


def _x(name, ts, dur, tid, cat="cpu_op", **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}


def test_gloo_trace_shape():
    """As recorded from gloo on CPU (torch 2.13): c10d op on the caller, gloo span on a worker thread,
    reduce_scatter executed as gloo:all_reduce, the caller idle while it waits."""
    trace = {"traceEvents": [
        _x(STEP_ANNOTATION, 0, 100, 1, cat="user_annotation"),
        _x("aten::mm", 0, 20, 1),
        _x("c10d::_reduce_scatter_base_", 20, 5, 1, **{"Input Dims": [[4], [8], [], []],
                                                    "Input type": ["float", "float", "", "Scalar"]}),
        _x("aten::clone", 21, 3, 1),  # gloo's emulation copy: part of the collective
        _x("gloo:all_reduce", 25, 30, 7, cat="user_annotation"),
        _x("aten::copy_", 30, 2, 7),  # on the gloo thread: not compute
        _x("aten::mm", 40, 10, 1),  # overlaps the collective
        _x("c10d::allreduce_", 60, 1, 1, **{"Input Dims": [[[3], [2]], [], []],
                                         "Input type": ["TensorList", "", "Scalar"]}),
        # the worker span knows the dtype the caller's TensorList does not record
        _x("gloo:all_reduce", 61, 9, 8, cat="user_annotation",
           **{"Input Dims": [[5]], "Input type": ["double"]}),
        _x("aten::mm", 80, 20, 1),
    ]}
    ti = intervals_from_chrome_trace(trace)
    assert ti.device == "cpu" and ti.units == [(0, 100)] and ti.unit_boundary == [True]
    assert [(c.kind, c.bytes) for c in ti.calls] == [("reduce_scatter", 32), ("all_reduce", 40)]
    assert ti.comm_by_kind == {"reduce_scatter": [(25, 55)], "all_reduce": [(61, 70)]}
    assert measure(ti.compute) == 50  # the three mm; not clone (inside c10d), not copy_ (gloo thread)
    # comm = [20, 55] + [60, 70]; compute covers [40, 50]
    assert exposed_time(ti.comm, ti.compute) == 35


def test_gpu_trace_uses_kernels_only():
    trace = {"traceEvents": [
        _x(STEP_ANNOTATION, 0, 100, 1, cat="user_annotation"),
        _x("c10d::allreduce_", 0, 1, 1, **{"Input Dims": [[[1024]]], "Input type": ["TensorList"]}),
        _x("aten::mm", 0, 90, 1),  # host time of a launch is not device compute
        _x("ampere_sgemm_128x64", 10, 30, 7, cat="kernel"),
        _x("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 20, 40, 13, cat="kernel"),
        _x("elementwise_kernel", 50, 5, 7, cat="kernel"),
    ]}
    ti = intervals_from_chrome_trace(trace)
    assert ti.device == "gpu"
    assert ti.comm == [(20, 60)] and ti.comm_by_kind == {"all_reduce": [(20, 60)]}
    assert ti.calls[0].bytes == 4096
    assert exposed_time(ti.comm, ti.compute) == 15  # [40, 50] and [55, 60]


def test_record_param_comms_gives_sizes_with_dtype():
    """ProcessGroupNCCL's record_param_comms: nccl-tests size is the gathered buffer, in bf16 bytes."""
    meta = {"Collective name": "_allgather_base", "dtype": "BFloat16", "In msg nelems": 1000,
            "Out msg nelems": 8000, "Group size": 8}
    trace = [
        _x("c10d::_allgather_base_", 0, 2, 1),
        _x("record_param_comms", 0, 1, 1, **meta),
        _x("ncclDevKernel_AllGather_RING_LL", 5, 10, 20, cat="kernel", **meta),
    ]
    ti = intervals_from_chrome_trace(trace)
    assert [(c.kind, c.bytes) for c in ti.calls] == [("all_gather", 16000)]  # not double-counted
    assert ti.comm_by_kind == {"all_gather": [(5, 15)]}


def test_group_sizes_from_annotations_on_gloo_and_record_param_comms_on_nccl():
    """Gloo: the size comes from the scalestudy.comm_group annotation enclosing the c10d op on the same
    thread (an annotation on another thread does not count). NCCL: from record_param_comms."""
    from scalestudy.measure.comm_groups import annotation_name

    gloo = {"traceEvents": [
        _x(MICRO_ANNOTATION, 0, 50, 1, cat="user_annotation"),
        _x(BOUNDARY_ANNOTATION, 50, 50, 1, cat="user_annotation"),
        _x(annotation_name(2), 10, 5, 1, cat="user_annotation"),
        _x("c10d::allreduce_", 11, 3, 1, **{"Input Dims": [[[4]]], "Input type": ["TensorList"]}),
        _x(annotation_name(4), 60, 5, 1, cat="user_annotation"),
        _x("c10d::allreduce_", 61, 3, 1, **{"Input Dims": [[[4]]], "Input type": ["TensorList"]}),
        _x(annotation_name(8), 70, 9, 2, cat="user_annotation"),  # another thread
        _x("c10d::broadcast_", 71, 3, 1, **{"Input Dims": [[[4]]], "Input type": ["TensorList"]}),
    ]}
    ti = intervals_from_chrome_trace(gloo)
    assert [(c.kind, c.group_size) for c in ti.calls] == [("all_reduce", 2), ("all_reduce", 4),
                                                          ("broadcast", None)]
    assert ti.units == [(0, 50), (50, 100)] and ti.unit_boundary == [False, True]
    nccl = [_x("record_param_comms", 0, 1, 1, **{"Collective name": "allreduce", "dtype": "Float",
                                                   "In msg nelems": 8, "Out msg nelems": 8,
                                                   "Group size": 2, "Process Group Ranks": "[0, 1]"})]
    assert [(c.bytes, c.group_size) for c in intervals_from_chrome_trace(nccl).calls] == [(32, 2)]
