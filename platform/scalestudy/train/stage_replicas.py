"""Data parallelism across the replicas of a pipeline stage: what ZeRO-0 and ZeRO-1 do to them.

After the schedule (torch's schedules run every
backward themselves, so nothing can hook DeepSpeed's boundary): the gradients of every local
parameter in one flat all_reduce over the dp group, divided by dp. ZeRO-0: every rank then steps
AdamW on all its parameters. ZeRO-1 (optimizer states sharded): each parameter belongs to one dp
rank (largest first to the least loaded, as ZeroRedundancyOptimizer assigns them), only its owner
keeps Adam's states and steps it, and each owner then broadcasts its updated parameters to the
group in one flat buffer: the all_gather of the updated weights that ZeRO-1 adds (a broadcast per
owner carries the same bytes). Written here rather than torch's ZeroRedundancyOptimizer because the
tensor-parallel shards are DTensors, which it does not flatten; this works on their local tensors.
bf16: fp32 master weights and Adam states (on the owner only, under ZeRO-1), as DeepSpeed's bf16
keeps them; the gradients accumulate over micro-batches in bf16 (DeepSpeed accumulates in fp32).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from scalestudy.parallel.deepspeed_config import optimizer_config
from scalestudy.train.pipeline import local


class ReplicaOptimizer:
    """AdamW over this rank's stage parameters with their gradients averaged over the dp group;
    ZeRO-1 shards Adam's states over it (module docstring)."""

    def __init__(self, params: list[torch.nn.Parameter], cfg: Any, dp_group: Any, dp_size: int,
                 dp_rank: int):
        self.params, self.group, self.dp, self.dp_rank = params, dp_group, dp_size, dp_rank
        self.zero1 = cfg.zero_stage == 1 and dp_size > 1
        self.owner = _owners(params, dp_size) if self.zero1 else [dp_rank] * len(params)
        self.mine = [p for p, o in zip(params, self.owner) if o == dp_rank]
        # 16-bit parameters train as DeepSpeed's bf16 does: fp32 master weights and Adam states,
        # the parameters a 16-bit copy of their masters after each step (the memory too).
        self.masters = ([torch.nn.Parameter(local(p).detach().float()) for p in self.mine]
                        if self.mine and self.mine[0].dtype != torch.float32 else None)
        kwargs = {k: v for k, v in optimizer_config(cfg)["params"].items() if k != "torch_adam"}
        self.optimizer = (torch.optim.AdamW(self.masters or self.mine, **kwargs) if self.mine
                          else None)

    def reduce_gradients(self) -> None:
        """One flat all_reduce of every local gradient over the dp group, then / dp."""
        if self.dp == 1:
            return
        grads = [local(p.grad) for p in self.params]
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.group)
        flat.div_(self.dp)
        for g, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(reduced)

    def step(self) -> None:
        if self.optimizer is not None:
            if self.masters:
                for m, p in zip(self.masters, self.mine):
                    m.grad = local(p.grad).float()
            self.optimizer.step()
            if self.masters:
                with torch.no_grad():
                    for m, p in zip(self.masters, self.mine):
                        local(p).copy_(m)
        if self.zero1:
            self._gather_updated()
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def _gather_updated(self) -> None:
        """Each owner's updated parameters to the whole dp group, one flat broadcast per owner."""
        ranks = dist.get_process_group_ranks(self.group)
        for owner in range(self.dp):
            tensors = [local(p) for p, o in zip(self.params, self.owner) if o == owner]
            if not tensors:
                continue
            flat = torch._utils._flatten_dense_tensors(tensors)
            dist.broadcast(flat, src=ranks[owner], group=self.group)
            if owner != self.dp_rank:
                for t, new in zip(tensors, torch._utils._unflatten_dense_tensors(flat, tensors)):
                    t.copy_(new)


def _owners(params: list[torch.nn.Parameter], dp: int) -> list[int]:
    """The dp rank that keeps each parameter's optimizer states: largest first, to the least
    loaded rank (ties to the lowest), the same on every rank of the group."""
    load = [0] * dp
    owner = [0] * len(params)
    for i in sorted(range(len(params)), key=lambda i: (-local(params[i]).numel(), i)):
        r = min(range(dp), key=lambda k: (load[k], k))
        owner[i] = r
        load[r] += local(params[i]).numel()
    return owner
