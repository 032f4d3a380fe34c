"""Bus bandwidth from each collective's own group, on a real 4-process gloo trace with tp = 2, dp = 2.

Four processes (torch.multiprocessing, gloo, no Ray or DeepSpeed; a few seconds) build the tp groups
{0,1} {2,3} and the dp groups {0,2} {1,3} and run a 16-micro-batch "step" through the profiled window
capped at 8 micro-batches: every micro-batch a matmul, a tp all_reduce and a dp all_gather; the last one
also a world all_reduce and a dp reduce_scatter (as gradient reduction does). The per-step figures must
count every call of the whole step with bus bytes from the call's own group size.
"""

from __future__ import annotations

import json
import os
import socket

import pytest

GRAD_ACCUM, CAP = 16, 8
TP_NUMEL, WORLD_NUMEL, GATHER_IN, SCATTER_IN = 4096, 1024, 512, 2048  # float32 elements


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    from scalestudy.measure.profiled_window import reduce_across_ranks, run_profiled_micro_batches

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    tp = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    dp = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    a = torch.randn(64, 64)
    calls = []

    def micro_batch(step: int, k: int) -> None:
        calls.append((step, k))
        (a @ a).sum()
        dist.all_reduce(torch.ones(TP_NUMEL), group=tp)
        dist.all_gather_into_tensor(torch.empty(2 * GATHER_IN), torch.ones(GATHER_IN), group=dp)
        if k == GRAD_ACCUM - 1:
            dist.all_reduce(torch.ones(WORLD_NUMEL))
            dist.reduce_scatter_tensor(torch.empty(SCATTER_IN // 2), torch.ones(SCATTER_IN), group=dp)

    pw = run_profiled_micro_batches(micro_batch, GRAD_ACCUM, cap=CAP, first_step=5)
    reduced = reduce_across_ranks(pw)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": pw.summary(), "reduced": reduced.summary(), "calls": calls}, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def windows(tmp_path_factory):
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("groups")
    mp.spawn(_worker, args=(4, _free_port(), str(out)), nprocs=4, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


def test_whole_step_runs_but_only_the_capped_micro_batches_are_traced(windows):
    for w in windows:
        assert w["calls"] == [[5, k] for k in range(GRAD_ACCUM)]
        assert w["rank"]["micro_batches_profiled"] == CAP and w["rank"]["profiled_grad_accum"] == GRAD_ACCUM


def test_counts_and_bytes_extrapolate_to_the_whole_step(windows):
    for w in windows:
        comm = w["rank"]["comm"]
        assert comm["all_reduce"]["count"] == GRAD_ACCUM + 1  # tp every micro-batch, world once
        assert comm["all_reduce"]["bytes"] == 4 * (GRAD_ACCUM * TP_NUMEL + WORLD_NUMEL)
        assert comm["all_gather"]["count"] == GRAD_ACCUM
        assert comm["all_gather"]["bytes"] == GRAD_ACCUM * 4 * 2 * GATHER_IN  # the gathered buffer
        assert comm["reduce_scatter"]["count"] == 1 and comm["reduce_scatter"]["bytes"] == 4 * SCATTER_IN
        for st in comm.values():
            assert st["time_s"] > 0


def test_bus_bytes_use_each_calls_group_size(windows):
    from scalestudy.metrics import busbw_factor

    tp_bytes, world_bytes = 4 * GRAD_ACCUM * TP_NUMEL, 4 * WORLD_NUMEL
    want = tp_bytes * busbw_factor("all_reduce", 2) + world_bytes * busbw_factor("all_reduce", 4)
    for w in windows:
        for view in ("rank", "reduced"):
            comm = w[view]["comm"]
            ar = comm["all_reduce"]
            assert ar["bus_bytes"] == pytest.approx(want)
            # the world-size rule (factor 1.5 for every all_reduce) would overstate it
            assert ar["bus_bytes"] < ar["bytes"] * busbw_factor("all_reduce", 4)
            assert ar["busbw_gbps"] == pytest.approx(ar["algbw_gbps"] * want / ar["bytes"])
            for kind in ("all_gather", "reduce_scatter"):  # dp groups of 2: factor 1/2, not 3/4
                assert comm[kind]["bus_bytes"] == pytest.approx(comm[kind]["bytes"] * 0.5)


def test_exposed_fraction_is_a_fraction(windows):
    for w in windows:
        s = w["rank"]
        assert 0 <= s["comm_exposed_fraction"] <= 1
        assert 0 < s["comm_exposed_s"] <= s["comm_time_s"] <= s["step_time_s_profiled"] * 1.05, s
