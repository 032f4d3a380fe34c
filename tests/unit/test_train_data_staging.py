"""Staging the timed window's batches before it starts (CPU here; the GPU path is in tests/gpu)."""

from __future__ import annotations

import torch

from scalestudy.parallel.layout import Layout
from scalestudy.train.data import global_batch, rank_micro_batches, stage_window

# dp 2 x micro-batch 2 x accumulation 4 = global batch 16
LAYOUT = Layout.of(world_size=2, micro_batch=2, global_batch=16)
ARGS = dict(seq_len=8, vocab_size=1000, seed=3)


def test_staged_window_is_each_ranks_own_micro_batches_in_order():
    for dp_rank in (0, 1):
        staged = stage_window(range(5, 8), "cpu", LAYOUT, dp_rank, **ARGS)
        assert sorted(staged) == [5, 6, 7]
        for step, mbs in staged.items():
            batch = global_batch(step, 16, 8, 1000, 3)
            assert len(mbs) == 4
            for k, ids in enumerate(mbs):
                assert torch.equal(ids, batch[LAYOUT.batch_rows(k, dp_rank)])
                assert ids._base is None  # its own storage, not a view keeping the global batch alive


def test_ranks_together_cover_the_global_batch_once():
    rows = [r for dp_rank in (0, 1) for mb in rank_micro_batches(0, LAYOUT, dp_rank, **ARGS) for r in mb]
    assert torch.equal(torch.stack(sorted(rows, key=lambda r: r.tolist())),
                       torch.stack(sorted(global_batch(0, 16, 8, 1000, 3), key=lambda r: r.tolist())))
