"""A second trial in the same process starts as clean as the first: what one trial leaves behind in
torch, DeepSpeed and the allocators, and how it is put back (warm worker groups, launch/warm.py).

    clean = reentry.snapshot()      # once, in a fresh process whose process group is up
    ... a trial (train/body.py) ...
    reentry.end_trial(clean)        # after every trial, also a failed one

What a trial leaves behind, and why each matters:
* zero.Init (ZeRO-3 construction) patches every nn.Module subclass's __init__ and _apply,
  nn.Module.__init_subclass__ and apply, torch.Tensor.__new__ and torch's tensor constructors, and
  counts nested contexts in module globals; a trial that raised inside it could leave them patched,
  and the next trial's model would be built partitioned whatever its ZeRO stage.
* Classes first imported inside zero.Init lose decorators applied after class creation: it saves
  `__init__` from __init_subclass__ and restores that copy on exit. transformers' Llama attention is
  decorated (`use_kernelized_func`) this way, so model classes are imported before any trial.
* DeepSpeed keeps its process groups (data, tensor, model parallel, a world clone, AutoTP's) and the
  mpu in module globals, and every engine makes new ones: left alone they pile up (gloo threads and
  sockets, NCCL communicators) and the next engine may pick up the previous trial's TP group.
* ZeRO-3 numbers parameters from a class counter (ds_id); a cold trial starts it at 0.
* Peak-memory counters and the allocators' caches: a small trial after a large one must report its
  own peak, so caches go back to the OS and the counters restart at the trial's start.
No Ray here (train/body.py's rule): torchrun could run trials back to back the same way.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import importlib
import sys
import types
from dataclasses import dataclass, field
from typing import Any

# Module globals in which DeepSpeed keeps per-engine state: restored to their values in a fresh
# process after every trial (dicts in place, since other modules hold references to them).
DEEPSPEED_GLOBALS = {
    "deepspeed.utils.groups": None,  # every simple global: groups, mpu, sizes, mesh
    "deepspeed.module_inject.layers": ("DEEPSPEED_AUTOTP_MODE",),
    "deepspeed.runtime.tensor_parallel.init_utils": ("_TP_MODEL_INIT_ARGS",),
    "deepspeed.runtime.zero.partition_parameters": ("zero_init_context", "top_level_context"),
}
# What zero.Init replaces outside nn.Module subclasses: (owner, attribute).
TORCH_PATCHED = ("tensor", "empty", "zeros", "ones", "full", "arange", "eye", "randn")
MODEL_MODULES = ("transformers.models.llama.modeling_llama", "transformers.models.opt.modeling_opt")
CLASS_ATTRS = ("__init__", "_apply")
ZERO_INIT_LEFTOVERS = ("_old_init", "_old_apply_of_skip_init_hook")
_MISSING = object()


@dataclass
class CleanState:
    """What a fresh process looked like, to put back after each trial."""

    module_classes: dict[type, dict[str, Any]] = field(default_factory=dict)
    functions: list[tuple[Any, str, Any]] = field(default_factory=list)
    ds_globals: dict[str, dict[str, Any]] = field(default_factory=dict)
    process_groups: set[int] = field(default_factory=set)
    param_id: int = 0


def import_model_classes() -> None:
    """Import the model classes outside zero.Init (see the module docstring)."""
    for name in MODEL_MODULES:
        importlib.import_module(name)


def _subclasses(cls: type) -> list[type]:
    seen, todo = [], [cls]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in seen:
                seen.append(sub)
                todo.append(sub)
    return seen


def _simple(value: Any) -> bool:
    """A global that holds state (a group, a dict, a size), not a function, class or module."""
    return not callable(value) and not isinstance(value, types.ModuleType)


def _module_globals(name: str, names: tuple[str, ...] | None) -> dict[str, Any]:
    module = importlib.import_module(name)
    keys = names or [k for k, v in vars(module).items() if not k.startswith("__") and _simple(v)]
    return {k: (dict(v) if isinstance(v, dict) else v)
            for k, v in ((k, getattr(module, k, _MISSING)) for k in keys) if v is not _MISSING}


def _process_group_ids() -> set[int]:
    from torch.distributed import distributed_c10d as c10d

    return {id(pg) for pg in getattr(c10d, "_world").pg_map}


def snapshot() -> CleanState:
    """The clean state of this process (call after imports and the process group, before trials)."""
    import torch

    from deepspeed.runtime.zero.partition_parameters import Init

    import_model_classes()
    state = CleanState(param_id=Init.param_id)
    for cls in [torch.nn.Module, *_subclasses(torch.nn.Module)]:
        state.module_classes[cls] = {a: cls.__dict__.get(a, _MISSING) for a in CLASS_ATTRS}
    state.module_classes[torch.nn.Module].update(
        {a: torch.nn.Module.__dict__.get(a, _MISSING) for a in ("__init_subclass__", "apply")})
    owners = [(torch, n) for n in TORCH_PATCHED] + [(torch.Tensor, "__new__")] + [
        (torch.nn.functional, n) for n in ("linear", "embedding")]
    state.functions = [(owner, n, owner.__dict__.get(n, _MISSING)) for owner, n in owners]
    state.ds_globals = {name: _module_globals(name, names) for name, names in DEEPSPEED_GLOBALS.items()}
    state.process_groups = _process_group_ids()
    return state


def _set(owner: Any, name: str, value: Any) -> None:
    if value is _MISSING:
        if name in owner.__dict__:
            delattr(owner, name)
    elif owner.__dict__.get(name, _MISSING) is not value:
        setattr(owner, name, value)


def restore_patches(state: CleanState) -> None:
    """Undo what zero.Init patched and left patched, in classes that existed in the fresh process."""
    from deepspeed.runtime.zero import partition_parameters as pp

    if pp.top_level_context is not None:  # a context that never exited: unpatch it properly first
        pp.top_level_context.unpatch_init_and_builtins()
    for cls, attrs in state.module_classes.items():
        for name, value in attrs.items():
            _set(cls, name, value)
        for leftover in ZERO_INIT_LEFTOVERS:
            if leftover in cls.__dict__ and leftover not in attrs:
                delattr(cls, leftover)
    for owner, name, value in state.functions:
        _set(owner, name, value)
    pp.Init.param_id = state.param_id


def destroy_new_process_groups(state: CleanState) -> int:
    """Destroy every process group made since the snapshot (DeepSpeed's, AutoTP's), through
    deepspeed.comm so DeepSpeed drops its references too; the world group stays. Returns how many."""
    import deepspeed.comm as ds_dist
    from torch.distributed import distributed_c10d as c10d

    new = [pg for pg in list(getattr(c10d, "_world").pg_map) if id(pg) not in state.process_groups]
    for pg in new:
        ds_dist.destroy_process_group(pg)
    return len(new)


def restore_globals(state: CleanState) -> None:
    for name, values in state.ds_globals.items():
        module = sys.modules.get(name)
        if module is None:
            continue
        for key, value in values.items():
            current = getattr(module, key, _MISSING)
            if isinstance(value, dict) and isinstance(current, dict):
                current.clear()
                current.update(value)
            else:
                setattr(module, key, value)
    from deepspeed.comm import comm

    getattr(comm.comms_logger, "comms_dict", {}).clear()
    comm.timer_summary.clear()


def release_memory() -> None:
    """Free what the trial's objects held and hand cached memory back, then restart the peak
    counters, so the next trial's peak is its own (measure/memory.py reads them)."""
    import torch

    from scalestudy.measure.memory import reset_process_peak

    sys.last_traceback = sys.last_value = sys.last_exc = None  # a failed trial's frames hold tensors
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    _malloc_trim()
    reset_process_peak()


def _malloc_trim() -> None:
    """Return the heap's free pages to the OS (glibc): host_memory.py keeps them between steps."""
    try:
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass


def end_trial(state: CleanState) -> None:
    """Everything above, in the order it can be done: patches, groups, globals, memory."""
    restore_patches(state)
    destroy_new_process_groups(state)
    restore_globals(state)
    release_memory()
