"""Peak memory of a training process: the CUDA caching allocator on GPU, peak RSS on CPU."""

from __future__ import annotations

import resource
import sys

import torch

GIB = 1024**3


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_memory_gib() -> tuple[float, str]:
    """(peak GiB, source). The CPU figure is the whole process's high-water mark since start
    (Python, libraries and the model together), which is what bounds a CPU trial."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / GIB, "cuda_allocator"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return rss * scale / GIB, "process_peak_rss"
