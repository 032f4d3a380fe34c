"""A ZeRO-3 trial that changes world size (an elastic resize) re-partitions its fp32 master weights
and Adam moments: each new rank builds only its own partition, from the slices of the old ranks'
optimizer files that overlap it. No rank ever holds the full fp32 state.

DeepSpeed cannot load a ZeRO-3 checkpoint at another data-parallel size (stage3.load_state_dict:
"Support different/changing load/save DP degree" is a TODO; universal checkpoints need an offline
conversion that writes, and makes every rank read, each whole parameter). ZeRO-3 keeps, per
sub-group, one flat fp32 tensor per rank: the rank's partition of each parameter in order, a
parameter of `numel` elements split into partitions of ceil(numel / world) (zero-padded at the
end), rank r holding elements [r * pn, (r + 1) * pn). The layout (parameter names, sizes and
partition sizes per sub-group, which optimizer-state index each sub-group has) is written beside
the checkpoint at save time (`write_layout`); a new rank maps its range of every parameter onto
the old ranks that held it and copies those slices out of memory-mapped files: the pages it does
not touch are never read. The old files a new rank opens are fetched through the ShardReader
(train/checkpoint_store.py), so from an object store a rank downloads only the old ranks' files
that overlap its partition.

A checksum (sum and sum of squares of every fp32 partition, over all ranks) is saved with the loop
state and checked after a re-partition: a mismatch fails the trial rather than train on a wrong
state.
"""

from __future__ import annotations

import json
import math
import os

import torch
import torch.distributed as dist

LAYOUT_FILE = "zero3_layout.json"
FP32_FLAT_GROUPS = "fp32_flat_groups"  # deepspeed.checkpoint.constants
OPTIMIZER_STATE_DICT = "optimizer_state_dict"
CHECKSUM_RTOL = 1e-6


def applies(engine) -> bool:
    return engine.zero_optimization_stage() == 3


def _state_index(opt) -> dict[int, int]:
    """Sub-group -> index of its flat tensor in the base optimizer's state_dict, which numbers
    the fp32 flats param group by param group (stage3._set_fp32_optimizer_param_groups)."""
    order = [sg for g in range(len(opt.optimizer.param_groups))
             for sg in range(len(opt.fp16_groups)) if opt.sub_group_to_group_id[sg] == g]
    return {sg: i for i, sg in enumerate(order)}


def layout(engine) -> dict:
    """This engine's ZeRO-3 partition layout: the same on every rank of a data-parallel group."""
    opt = engine.optimizer
    names = {id(p): n for n, p in engine.module.named_parameters()}
    return {
        "world": dist.get_world_size(group=opt.dp_process_group),
        "state_index": {str(k): v for k, v in _state_index(opt).items()},
        "sub_groups": [[{"name": names[id(p)], "numel": p.ds_numel,
                         "partition_numel": p.partition_numel()} for p in group]
                       for group in opt.fp16_groups],
    }


def write_layout(engine, directory: str) -> None:
    """Rank 0 of the save: the layout a later resize reads."""
    with open(os.path.join(directory, LAYOUT_FILE), "w") as f:
        json.dump(layout(engine), f)


def checksum(engine) -> list[float]:
    """[sum, sum of squares] of the fp32 master partitions over every rank (collective)."""
    total = torch.zeros(2, dtype=torch.float64)
    for flat in engine.optimizer.fp32_partitioned_groups_flat:
        x = flat.detach().to("cpu", torch.float64)
        total += torch.stack([x.sum(), (x * x).sum()])
    total = total.to(engine.device)  # the process group's device (NCCL: the GPU)
    dist.all_reduce(total)
    return total.cpu().tolist()


class _OldRanks:
    """The old ranks' optimizer files, opened on first use, memory-mapped."""

    def __init__(self, engine, reader, tag: str):
        self.engine, self.reader, self.tag = engine, reader, tag
        self.files: dict[int, dict] = {}

    def state(self, rank: int) -> dict:
        if rank not in self.files:
            path = self.engine._get_rank_zero_ckpt_name(  # DeepSpeed's own naming of the file
                self.reader.directory, self.tag, self.engine.checkpoint_mp_rank, rank,
                self.engine.bfloat16_enabled())
            loaded = torch.load(self.reader.fetch(path), map_location="cpu", mmap=True,
                                weights_only=False)
            self.files[rank] = loaded[OPTIMIZER_STATE_DICT]
        return self.files[rank]

    def flat(self, rank: int, sub_group: int, key: str, state_index: int) -> torch.Tensor:
        sd = self.state(rank)
        if key == "fp32":
            return sd[FP32_FLAT_GROUPS][sub_group]
        return sd[OPTIMIZER_STATE_DICT]["state"][state_index][key]


def _where(old: dict) -> dict[str, tuple[int, int, int, int]]:
    """Parameter name -> (old sub-group, offset in its flat, numel, old partition numel)."""
    where = {}
    for sg, group in enumerate(old["sub_groups"]):
        offset = 0
        for p in group:
            where[p["name"]] = (sg, offset, p["numel"], p["partition_numel"])
            offset += p["partition_numel"]
    return where


def _fill(dst: torch.Tensor, new_offset: int, lo: int, hi: int, place, old_ranks: _OldRanks,
          key: str, old_index: dict[str, int]) -> None:
    """dst[new_offset: ...] <- elements [lo, hi) of one parameter, from the old ranks that hold
    them (`place`: its old sub-group, offset, numel and partition numel)."""
    sg, offset, _, pn_old = place
    for r in range(lo // pn_old, (hi - 1) // pn_old + 1):
        a, b = max(lo, r * pn_old), min(hi, (r + 1) * pn_old)
        src = old_ranks.flat(r, sg, key, old_index[str(sg)])
        start = offset + a - r * pn_old
        dst[new_offset + a - lo: new_offset + b - lo].copy_(src[start: start + b - a])


def _rebuild(engine, old: dict, old_ranks: _OldRanks) -> None:
    """Each new sub-group's fp32 flat and optimizer moments, from the old ranks' slices."""
    opt = engine.optimizer
    rank = dist.get_rank(group=opt.dp_process_group)
    names = {id(p): n for n, p in engine.module.named_parameters()}
    where, old_index = _where(old), old["state_index"]
    opt._set_fp32_optimizer_param_groups()  # the base optimizer's state is keyed by these flats
    try:
        for sg, group in enumerate(opt.fp16_groups):
            fp32 = opt.fp32_partitioned_groups_flat[sg]
            state = opt.optimizer.state.get(fp32, {})
            targets = {"fp32": fp32, **{k: v for k, v in state.items()
                                        if torch.is_tensor(v) and v.numel() == fp32.numel()}}
            for key, dst in targets.items():
                buf = torch.zeros(dst.numel(), dtype=dst.dtype)  # padding stays zero
                offset = 0
                for p in group:
                    place = where[names[id(p)]]
                    pn = p.partition_numel()
                    lo, hi = rank * pn, min((rank + 1) * pn, place[2])
                    if hi > lo:
                        _fill(buf, offset, lo, hi, place, old_ranks, key, old_index)
                    offset += pn
                dst.data.copy_(buf.view_as(dst))
            for k, v in state.items():  # the step count and other scalars: any old rank's
                if not (torch.is_tensor(v) and v.numel() == fp32.numel()):
                    saved = old_ranks.state(0)[OPTIMIZER_STATE_DICT]["state"][old_index["0"]][k]
                    state[k] = saved.clone() if torch.is_tensor(saved) else saved
    finally:
        opt._clear_fp32_optimizer_param_groups()


def repartition(engine, reader, tag: str, saved_checksum: list[float] | None) -> None:
    """Load a ZeRO-3 checkpoint saved at another world size into this engine (collective)."""
    opt = engine.optimizer
    with open(reader.fetch(os.path.join(reader.directory, LAYOUT_FILE))) as f:
        old = json.load(f)
    opt.checkpoint_event_prologue()
    _rebuild(engine, old, _OldRanks(engine, reader, tag))
    for sg, fp32 in enumerate(opt.fp32_partitioned_groups_flat):  # the bit16 partitions follow
        if fp32.numel():
            opt.fp16_partitioned_groups_flat[sg].data.copy_(fp32.data)
        updated = opt.unflatten(opt.fp16_partitioned_groups_flat[sg],
                                opt.fp16_partitioned_groups[sg])
        for partitioned, q in zip(opt.fp16_partitioned_groups[sg], updated):
            partitioned.data = q.data
    if opt.persistent_parameters:
        opt.persistent_parameters[0].partition(opt.persistent_parameters)
    opt.checkpoint_event_epilogue()
    if saved_checksum is not None:
        now = checksum(engine)
        if not all(math.isclose(a, b, rel_tol=CHECKSUM_RTOL, abs_tol=1e-9)
                   for a, b in zip(now, saved_checksum)):
            raise RuntimeError(f"ZeRO-3 re-partition from {old['world']} ranks: the fp32 state's "
                               f"checksum {now} differs from the saved {saved_checksum}")
