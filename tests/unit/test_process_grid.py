import itertools

import pytest

from scalestudy.parallel.grid import ProcessGrid


@pytest.mark.parametrize(
    "world, tp, tp_groups, dp_groups",
    [
        (8, 2, [[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2, 4, 6], [1, 3, 5, 7]]),
        (8, 4, [[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]]),
        (16, 8, [list(range(8)), list(range(8, 16))], [[i, i + 8] for i in range(8)]),
    ],
)
def test_groups_follow_the_grid(world, tp, tp_groups, dp_groups):
    g = ProcessGrid(world, tp)
    assert g.tp_groups() == tp_groups
    assert g.dp_groups() == dp_groups
    assert g.dp == world // tp
    for r in range(world):
        d, p, t = g.coords(r)
        assert g.rank(d, p, t) == r and r in g.tp_groups()[d] and r in g.dp_groups()[t]


def test_groups_partition_the_world_with_pp():
    g = ProcessGrid(16, tp=2, pp=2)
    for groups in (g.tp_groups(), g.dp_groups(), g.pp_groups()):
        assert sorted(itertools.chain(*groups)) == list(range(16))
    assert g.pp_groups()[0] == [0, 2]


def test_bad_degrees():
    with pytest.raises(ValueError, match="not divisible"):
        ProcessGrid(6, tp=4)
