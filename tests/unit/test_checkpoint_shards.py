"""The pieces of sharded checkpoints without DeepSpeed: a rank's reader fetches only what it opens,
and the ZeRO-3 re-partition maps every element of every parameter from the old ranks' flats to
the new ones (train/checkpoint_store.py, train/zero3_resize.py)."""

from __future__ import annotations

import os
import random

import pyarrow.fs
import pytest
import torch

from scalestudy.train.checkpoint_store import (METADATA_BYTES, STAGING_ENV, ShardReader,
                                               StoredCheckpoint, open_stored, staging_root)
from scalestudy.train.zero3_resize import _fill, _where


def _store(tmp_path) -> StoredCheckpoint:
    """A checkpoint on a file system that is not the process's own (as an object store is)."""
    root = tmp_path / "store"
    (root / "trial").mkdir(parents=True)
    (root / "loop_state.json").write_text('{"next_step": 4}')
    for rank in range(3):
        (root / "trial" / f"zero_pp_rank_{rank}_optim_states.pt").write_bytes(
            bytes([rank]) * (METADATA_BYTES + 1000 * (rank + 1)))
    return StoredCheckpoint(pyarrow.fs.SubTreeFileSystem(str(root), pyarrow.fs.LocalFileSystem()),
                            "")


def test_reader_fetches_only_what_is_opened(tmp_path, monkeypatch):
    monkeypatch.setenv(STAGING_ENV, str(tmp_path / "nvme"))
    stored = _store(tmp_path)
    assert not stored.is_local
    with open_stored(stored) as reader:
        assert reader.directory.startswith(str(tmp_path / "nvme"))  # staged on the node's disk
        shard = os.path.join(reader.directory, "trial", "zero_pp_rank_1_optim_states.pt")
        other = os.path.join(reader.directory, "trial", "zero_pp_rank_2_optim_states.pt")
        assert os.path.getsize(other) == 0  # listed, not fetched
        assert reader.bytes_read == len('{"next_step": 4}')  # metadata comes with the listing

        class Engine:
            class checkpoint_engine:
                @staticmethod
                def load(path, map_location=None):
                    with open(path, "rb") as f:
                        return f.read()

        with reader.reading(Engine):
            data = Engine.checkpoint_engine.load(shard)
        assert data == bytes([1]) * (METADATA_BYTES + 2000)
        assert reader.bytes_read == len('{"next_step": 4}') + METADATA_BYTES + 2000
        assert os.path.getsize(other) == 0
        reader.fetch(shard)  # a second read is not counted twice
        assert reader.bytes_read == len('{"next_step": 4}') + METADATA_BYTES + 2000
        staged = reader.directory
    assert not os.path.exists(staged)  # the staging folder goes with the restore


def test_local_checkpoint_is_read_in_place(tmp_path, monkeypatch):
    monkeypatch.setenv(STAGING_ENV, str(tmp_path / "nvme"))
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "a.pt").write_bytes(b"x" * 10)
    with open_stored(StoredCheckpoint.local(tmp_path / "ck")) as reader:
        assert reader.directory == str((tmp_path / "ck").resolve())
        reader.fetch(os.path.join(reader.directory, "a.pt"))
        assert reader.bytes_read == 10
    assert staging_root() == str(tmp_path / "nvme") and not os.listdir(tmp_path / "nvme")


def _partition(flat: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """ZeRO-3's partition of one parameter: ceil(numel / world) elements, zero-padded."""
    pn = -(-flat.numel() // world)
    padded = torch.zeros(pn * world)
    padded[:flat.numel()] = flat
    return padded[rank * pn:(rank + 1) * pn]


class _Old:
    """Old ranks' flats, as zero3_resize._OldRanks returns them."""

    def __init__(self, params: dict[str, torch.Tensor], groups: list[list[str]], world: int):
        self.flats = {r: [torch.cat([_partition(params[n], world, r) for n in g]) for g in groups]
                      for r in range(world)}
        self.opened: set[int] = set()

    def flat(self, rank, sub_group, key, state_index):
        self.opened.add(rank)
        return self.flats[rank][sub_group]


@pytest.mark.parametrize("old_world,new_world", [(1, 2), (2, 1), (3, 2), (2, 5), (4, 4), (8, 3)])
def test_repartition_maps_every_element(old_world, new_world):
    rng = random.Random(old_world * 10 + new_world)
    params = {f"p{i}": torch.randn(rng.randint(1, 40)) for i in range(9)}
    names = list(params)
    old_groups, new_groups = [names[:4], names[4:]], [names[:6], names[6:]]  # sub-groups differ
    old = {"sub_groups": [[{"name": n, "numel": params[n].numel(),
                            "partition_numel": -(-params[n].numel() // old_world)} for n in g]
                          for g in old_groups], "state_index": {"0": 0, "1": 1}}
    where = _where(old)
    for rank in range(new_world):
        source = _Old(params, old_groups, old_world)
        for g in new_groups:
            pns = [-(-params[n].numel() // new_world) for n in g]
            buf, offset = torch.zeros(sum(pns)), 0
            for n, pn in zip(g, pns):
                lo, hi = rank * pn, min((rank + 1) * pn, params[n].numel())
                if hi > lo:
                    _fill(buf, offset, lo, hi, where[n], source, "fp32", old["state_index"])
                offset += pn
            want = torch.cat([_partition(params[n], new_world, rank) for n in g])
            assert torch.equal(buf, want)
        if new_world >= old_world:  # a growing rank opens at most the two old ranks it straddles
            assert len(source.opened) <= 2
