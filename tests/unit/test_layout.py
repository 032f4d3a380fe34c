"""The layout object: degrees, accumulation, nodes, the process grid, batch rows, group placement,
and every infeasibility reason the spec checks raise, with the messages users see."""

from __future__ import annotations

import itertools

import pytest

from scalestudy.errors import InfeasibleTrial
from scalestudy.parallel.layout import Layout
from scalestudy.spec import catalog
from scalestudy.spec.catalog import ModelDims


@pytest.mark.parametrize(
    "ws, tp, pp, mb, gb, expect",
    [
        (8, 2, 1, 2, None, (4, 1, 8)),
        (8, 2, 2, 1, 16, (2, 8, 16)),
        (16, 1, 1, 4, 256, (16, 4, 256)),
        (1, 1, 1, 4, None, (1, 1, 4)),
    ],
)
def test_degrees_and_accumulation(ws, tp, pp, mb, gb, expect):
    lay = Layout.of(ws, tp, pp, mb, gb)
    assert (lay.dp, lay.grad_accum, lay.global_batch) == expect
    assert lay.dp * lay.tp * lay.pp == ws
    assert lay.micro_batch * lay.dp * lay.grad_accum == lay.global_batch


@pytest.mark.parametrize(
    "args, message",
    [
        ((6, 4, 1, 1, None), "world_size 6 is not divisible by tp*pp = 4*1 = 4"),
        ((3, 2, 1, 1, None), "world_size 3 is not divisible by tp*pp = 2*1 = 2"),
        ((8, 2, 2, 1, None, 8), None),
        ((4, 1, 1, 2, 10), "global_batch 10 is not divisible by micro_batch*dp = 2*4 = 8"),
        ((2, 1, 1, 2, 6), "global_batch 6 is not divisible by micro_batch*dp = 2*2 = 4"),
    ],
)
def test_degrees_that_do_not_divide(args, message):
    if message is None:
        assert Layout.of(*args).dp == 2
        return
    with pytest.raises(InfeasibleTrial) as exc:
        Layout.of(*args)
    assert str(exc.value) == message


def test_lenient_layout_records_an_infeasible_point():
    lay = Layout.lenient(3, 2, 1, 1, None)
    assert (lay.world_size, lay.dp, lay.grad_accum, lay.global_batch) == (3, 1, 1, 1)
    assert Layout.lenient(4, 1, 1, 2, 10).grad_accum == 1  # floor(10 / 8), at least 1
    assert Layout.lenient(8, 2, 1, 2, None) == Layout.of(8, 2, 1, 2, None)


TINY = catalog.get_model("llama2-tiny")  # 4 heads, 4 KV heads, ffn 176, 2 layers, max_seq_len 512


@pytest.mark.parametrize(
    "dims, tp, pp, seq_len, message",
    [
        (ModelDims(hidden_size=48, num_layers=2, num_heads=3), 2, 1, 128, "tp 2 does not divide num_heads 3"),
        (ModelDims(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=1), 2, 1, 128,
         "tp 2 does not divide num_kv_heads 1"),
        (ModelDims(hidden_size=64, num_layers=2, num_heads=4, ffn_hidden_size=170), 4, 1, 128,
         "tp 4 does not divide ffn_hidden_size 170"),
        (TINY, 1, 4, 128, "pp 4 does not divide num_layers 2"),
        (catalog.get_model("gpt3-175b"), 1, 1, 4096, "seq_len 4096 exceeds the learned positions (2048)"),
        # a new user's `seq_len: 100000` on llama2-tiny, which was once accepted as runnable
        (TINY, 1, 1, 100000, "seq_len 100000 exceeds the model's max_seq_len (512)"),
    ],
)
def test_model_split_and_sequence_checks(dims, tp, pp, seq_len, message):
    lay = Layout.of(tp * pp, tp, pp)
    with pytest.raises(InfeasibleTrial) as exc:
        lay.check_model(dims, seq_len)
    assert str(exc.value) == message


def test_a_model_that_splits_passes():
    Layout.of(4, 4, 1).check_model(TINY, 512)
    Layout.of(2, 1, 2).check_model(TINY, 128)


def test_resized_keeps_the_global_batch():
    lay = Layout.of(4, 1, 1, 1, 12)
    assert {w: lay.resized(w).grad_accum for w in (2, 3, 4)} == {2: 6, 3: 4, 4: 3}
    assert lay.resized(3).global_batch == 12
    with pytest.raises(InfeasibleTrial, match="global_batch 12 is not divisible by micro_batch\\*dp"):
        lay.resized(5)


@pytest.mark.parametrize(
    "ws, per_node, nodes, ranks_per_node",
    [(1, 8, 1, 1), (8, 8, 1, 8), (12, 8, 2, 8), (2048, 8, 256, 8), (2, 2, 1, 2), (3, 2, 2, 2)],
)
def test_nodes_count_a_partly_filled_node(ws, per_node, nodes, ranks_per_node):
    lay = Layout.of(ws, devices_per_node=per_node)
    assert (lay.nodes, lay.ranks_per_node) == (nodes, ranks_per_node)


@pytest.mark.parametrize(
    "world, tp, tp_groups, dp_groups",
    [
        (8, 2, [[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2, 4, 6], [1, 3, 5, 7]]),
        (8, 4, [[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]]),
        (16, 8, [list(range(8)), list(range(8, 16))], [[i, i + 8] for i in range(8)]),
    ],
)
def test_groups_follow_the_grid(world, tp, tp_groups, dp_groups):
    g = Layout.of(world, tp)
    assert g.tp_groups() == tp_groups
    assert g.dp_groups() == dp_groups
    for r in range(world):
        d, p, t = g.coords(r)
        assert g.rank(d, p, t) == r and r in g.tp_groups()[d] and r in g.dp_groups()[t]
        assert r in g.group_of("tp", r) and r in g.group_of("dp", r)


def test_groups_partition_the_world_with_pp():
    g = Layout.of(16, tp=2, pp=2)
    for groups in (g.tp_groups(), g.dp_groups(), g.pp_groups()):
        assert sorted(itertools.chain(*groups)) == list(range(16))
    assert g.pp_groups()[0] == [0, 2]
    assert g.grid()[1][0] == [4, 5] and len(g.grid()) == g.dp  # arange(16).view(4, 2, 2)


@pytest.mark.parametrize(
    "ws, tp, pp, per_node, axis, placement",
    [
        (64, 8, 1, 8, "tp", (8, 8, 1)),      # a TP group fills one node
        (64, 8, 1, 8, "dp", (8, 1, 8)),      # a DP group takes one rank of each node
        (64, 2, 1, 8, "dp", (32, 4, 8)),     # 4 of its ranks per node
        (64, 2, 2, 8, "dp", (16, 2, 8)),
        (64, 2, 2, 8, "pp", (2, 2, 1)),      # pipeline neighbours tp ranks apart, same node
        (64, 8, 2, 8, "pp", (2, 1, 2)),      # a stage per node
        (64, 16, 1, 8, "tp", (16, 8, 2)),    # TP wider than a node crosses it
        (1, 1, 1, 8, "dp", (1, 1, 1)),
    ],
)
def test_group_placement_over_nodes(ws, tp, pp, per_node, axis, placement):
    assert Layout.of(ws, tp, pp, devices_per_node=per_node).group_placement(axis) == placement


def test_batch_rows_cover_the_global_batch_once():
    lay = Layout.of(4, 2, 1, 3, 12)  # dp 2, micro-batch 3, accumulation 2
    rows = [r for k in range(lay.grad_accum) for d in range(lay.dp)
            for r in range(12)[lay.batch_rows(k, d)]]
    assert sorted(rows) == list(range(12))
    assert lay.batch_rows(1, 0) == slice(6, 9)


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="tp must be a positive integer"):
        Layout(4, 4, 0, 1, 1, 1, 4)
