"""Deterministic synthetic token batches, defined per global batch.

Each sequence is an arithmetic progression (random start and stride) over the first ACTIVE_VOCAB
token ids, so the loss has structure to learn at two speeds: which ids occur (within a few steps)
and the stride (given context). The batch of a step depends only on the
seed and the step, and every data-parallel rank takes its rows of it (Layout.batch_rows): any
(dp, tp, micro-batch, accumulation) layout with the same global batch trains on exactly the same
tokens.
"""

from __future__ import annotations

import torch

from scalestudy.parallel.layout import Layout

MAX_STRIDE = 7
ACTIVE_VOCAB = 256


def global_batch(step: int, global_batch: int, seq_len: int, vocab_size: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    active = min(vocab_size, ACTIVE_VOCAB)
    start = torch.randint(0, active, (global_batch, 1), generator=gen)
    stride = torch.randint(1, MAX_STRIDE + 1, (global_batch, 1), generator=gen)
    return (start + stride * torch.arange(seq_len)) % active
def rank_micro_batches(step: int, layout: Layout, dp_rank: int, *, seq_len: int, vocab_size: int,
                       seed: int) -> list[torch.Tensor]:
    """This dp rank's micro-batches of one step, in order (Layout.batch_rows), each a copy with its
    own storage (a slice would keep the whole global batch alive)."""
    batch = global_batch(step, layout.global_batch, seq_len, vocab_size, seed)
    return [batch[layout.batch_rows(k, dp_rank)].clone() for k in range(layout.grad_accum)]


def stage_on_device(tensors: list[torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """Tensors moved to ``device`` ahead of the timed window, so the step timer holds no copy.

    On GPU each tensor is pinned and copied with ``non_blocking=True``, then the copying stream is
    synchronised once: the copies overlap each other, and when this returns they are on the device.
    On CPU the tensors are returned as they are (there is no copy to stage)."""
    device = torch.device(device)
    if device.type != "cuda":
        return list(tensors)
    staged = [t.pin_memory().to(device, non_blocking=True) for t in tensors]
    # The pinned sources must outlive the asynchronous copies: wait for them here, before the window.
    torch.cuda.current_stream(device).synchronize()
    return staged


def stage_window(steps: range | list[int], device: torch.device | str, layout: Layout, dp_rank: int,
                 **batch_args) -> dict[int, list[torch.Tensor]]:
    """Every micro-batch this rank trains on in ``steps`` (the timed window), generated and staged on
    ``device`` before the window starts: ``{step: [micro-batch 0, 1, ...]}``. ``batch_args`` are
    ``rank_micro_batches``' keywords. Device memory: steps x grad_accum x micro_batch x seq_len x 8
    bytes (int64 ids), e.g. 20 steps x 256 x 1 x 4096 x 8 = 168 MB, counted in the window's peak."""
    return {s: stage_on_device(rank_micro_batches(s, layout, dp_rank, **batch_args), device)
            for s in steps}
