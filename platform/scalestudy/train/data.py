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

MAX_STRIDE = 7
ACTIVE_VOCAB = 256


def global_batch(step: int, global_batch: int, seq_len: int, vocab_size: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    active = min(vocab_size, ACTIVE_VOCAB)
    start = torch.randint(0, active, (global_batch, 1), generator=gen)
    stride = torch.randint(1, MAX_STRIDE + 1, (global_batch, 1), generator=gen)
    return (start + stride * torch.arange(seq_len)) % active
