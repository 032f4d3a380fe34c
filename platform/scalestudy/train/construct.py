"""A trial's model built at any size: never the whole fp32 model on every host.

    model = build_trial_model(cfg, ds_config, device)   # every rank, process group up

* ZeRO-3: built under ``deepspeed.zero.Init(config_dict_or_path=ds_config)``, which partitions each
  module's parameters as soon as the module is constructed, in the config's dtype on the accelerator:
  a rank holds its 1/world share plus one module's full weights at a time.
* Other stages: parameters created on the meta device (buffers such as RoPE's inv_freq stay real:
  they are small and computed in ``__init__``), then materialised in the training dtype on the
  trial's device.
* AutoTP (tp > 1, stages 0-2): the model stays on meta into ``deepspeed.initialize``, which shards it
  there (AutoTP's layers keep meta tensors meta: module_inject/layers.py, ``move``); the engine's
  first ``module.to(device)`` (``_configure_distributed_model``, before any optimizer exists) then
  materialises each rank's shards, and only its shards, in the training dtype. A TP rank never holds
  the whole model.

Initial weights are a function of (seed, parameter name) only, drawn in fp32 on the device type and
cast: every stage, world size and TP degree starts from the same weights, so their losses agree
(tests/integration/test_zero_stages.py, test_tensor_parallel.py); under ZeRO-3 and AutoTP every rank
draws each full parameter, one at a time, and keeps its own partition of it (no collective): ZeRO-3's
flat piece, or the TP shard cut by the AutoTP layer's own partition function. Norm weights are 1,
biases 0, every other weight N(0, initializer_range), Hugging Face's own rule for these models.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from scalestudy.spec.catalog import ModelDims
from scalestudy.train.host_memory import freed_tensors_returned
from scalestudy.train.model_factory import apply_recomputation, hf_config, selective_recompute

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def training_dtype(precision: Any) -> torch.dtype:
    return DTYPES[getattr(precision, "value", precision)]


def model_class(dims: ModelDims) -> type:
    """The model class, imported here and not inside zero.Init: transformers imports modeling modules
    lazily, and a first import under zero.Init breaks the `kernels` hub decorators
    (use_kernelized_func) that the module applies at import time."""
    if dims.architecture == "llama":
        from transformers.models.llama.modeling_llama import LlamaForCausalLM

        return LlamaForCausalLM
    from transformers.models.opt.modeling_opt import OPTForCausalLM

    return OPTForCausalLM  # the "gpt" blocks (model_factory.hf_config says why OPT)


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside is moved to the meta device as it is registered (one
    parameter's host copy at a time); buffers are left where their module made them."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def materialise(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Meta parameters -> uninitialised ones on ``device`` in ``dtype`` (tied ones stay tied)."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in made:
                made[id(p)] = nn.Parameter(torch.empty(p.shape, device=device, dtype=dtype),
                                           requires_grad=p.requires_grad)
            module._parameters[name] = made[id(p)]
    model.to(device)  # the buffers


def _arange_dtype_kept():
    """transformers' guard that keeps RoPE's fp32 ``arange`` out of zero.Init's dtype cast. It came
    with transformers 5.2x (a GPU image with 5.17 has none): without it, those versions compute
    inv_freq in the training dtype under ZeRO-3, as they do for every user of zero.Init."""
    try:
        from transformers.integrations.deepspeed import prevent_arange_dtype_change
    except ImportError:
        return nullcontext()
    return prevent_arange_dtype_change()


def _seed_of(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63


def _init_values(shape: torch.Size, device: torch.device, full_name: str, module: nn.Module, seed: int,
                 std: float) -> torch.Tensor:
    """A parameter's full initial values in fp32 (the module docstring's rule)."""
    if full_name.rsplit(".", 1)[-1] == "bias":
        return torch.zeros(shape, device=device)
    if "norm" in type(module).__name__.lower() and len(shape) == 1:
        return torch.ones(shape, device=device)
    gen = torch.Generator(device=device).manual_seed(_seed_of(seed, full_name))
    return torch.empty(shape, device=device).normal_(0.0, std, generator=gen)


def _write_partition(p: torch.Tensor, values: torch.Tensor, rank: int) -> None:
    """This rank's ZeRO-3 partition of a parameter whose full values are ``values``: DeepSpeed's
    layout (partition_parameters._partition_param) is the flattened tensor cut into ds_numel-long
    pieces in rank order, the last one zero-padded."""
    n = p.ds_tensor.ds_numel
    flat = values.reshape(-1)
    start = min(n * rank, flat.numel())
    piece = flat[start:start + n]
    p.ds_tensor.zero_()
    p.ds_tensor[: piece.numel()].copy_(piece)


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, std: float, zero3: bool) -> None:
    """The initial weights of the module docstring, parameter by parameter. Under ZeRO-3 each rank
    draws a parameter's full values and keeps its own partition of them: no collective, and one
    parameter's full fp32 values at a time on the host or device."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    seen: set[int] = set()
    for mod_name, module in model.named_modules():
        for local, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            name = f"{mod_name}.{local}" if mod_name else local
            if not zero3:
                p.copy_(_init_values(p.shape, p.device, name, module, seed, std))
                continue
            group = p.ds_process_group
            if group is not None and dist.get_world_size(group) != dist.get_world_size():
                raise NotImplementedError("ZeRO-3 partitions over a subgroup: not built here")
            values = _init_values(p.ds_shape, p.ds_tensor.device, name, module, seed, std)
            _write_partition(p, values.to(p.ds_tensor.dtype), rank)


def build_trial_model(cfg: Any, ds_config: dict[str, Any], device: torch.device) -> nn.Module:
    """The trial's model (``cfg``: TrialConfig), built as the module docstring says."""
    dims: ModelDims = cfg.model_dims
    cls, config = model_class(dims), hf_config(dims)
    torch.manual_seed(cfg.seed)  # module __init__ draws (then overwritten) and any dropout
    zero3 = cfg.zero_stage == 3
    std = float(getattr(config, "initializer_range", 0.02))
    if zero3:
        import deepspeed

        # Full module weights are allocated and freed on the host when the device is the CPU.
        with freed_tensors_returned() if device.type == "cpu" else nullcontext():
            # prevent_arange_dtype_change: zero.Init casts new float tensors to the training dtype,
            # RoPE's inv_freq must stay fp32; it has to be entered before zero.Init.
            with _arange_dtype_kept(), deepspeed.zero.Init(config_dict_or_path=ds_config):
                model = cls._from_config(config)
            init_weights(model, cfg.seed, std, zero3)
    else:
        with parameters_on_meta():
            model = cls._from_config(config)
        if ds_config.get("tensor_parallel", {}).get("autotp_size", 1) > 1:
            materialise_when_moved(model, device, training_dtype(cfg.precision), cfg.seed, std)
        else:
            materialise(model, device, training_dtype(cfg.precision))
            init_weights(model, cfg.seed, std, zero3)
    apply_recomputation(model, cfg.activation_checkpointing, selective_recompute(cfg))
    model.train()
    return model


def materialise_when_moved(model: nn.Module, device: torch.device, dtype: torch.dtype, seed: int,
                           std: float) -> None:
    """Leave ``model`` on meta for AutoTP to shard; its next ``.to()`` (the engine's, after the
    sharding) first materialises every meta parameter as this rank's shard of its initial weights.
    Names and full shapes are recorded now: sharding keeps each parameter object, not its shape."""
    before: dict[int, tuple[str, torch.Size, nn.Module]] = {}
    for owner_name, owner in model.named_modules():
        for local, p in owner.named_parameters(recurse=False):
            before[id(p)] = (f"{owner_name}.{local}" if owner_name else local, p.shape, owner)

    def to(*args: Any, **kwargs: Any) -> nn.Module:
        del model.to  # one shot: nn.Module.to from here on
        # On a CPU device each full weight is freed once cut: returned, as for ZeRO-3 above.
        with freed_tensors_returned() if device.type == "cpu" else nullcontext():
            materialise_shards(model, device, dtype, seed, std, before)
        return model.to(*args, **kwargs)

    model.to = to  # an instance attribute: only this model, only once


def _shard_values(module: nn.Module, before: dict, device: torch.device, seed: int,
                  std: float) -> dict[str, torch.Tensor]:
    """The initial values of an AutoTP layer's weight and bias, cut as the layer cut them: its own
    ``_tp_partition`` (the call its __init__ made on the full tensors) applied to the full values."""
    w, b = module._parameters.get("weight"), module._parameters.get("bias")
    if w is None or not w.is_meta or not callable(getattr(w, "_tp_partition", None)):
        return {}
    full = [None if p is None else _full_values(before, p, device, seed, std) for p in (w, b)]
    w._tp_partition(full)  # in place: each tensor's .data becomes this rank's shard
    return {k: v for k, v in zip(("weight", "bias"), full) if v is not None}


@torch.no_grad()
def materialise_shards(model: nn.Module, device: torch.device, dtype: torch.dtype, seed: int,
                       std: float, before: dict) -> None:
    """Every meta parameter -> a real one on ``device`` in ``dtype`` holding this rank's part of its
    initial weights (module docstring). A new Parameter object (meta tensors cannot take real data),
    with the attributes AutoTP set on the old one and its gradient hooks; tied ones stay tied."""
    made: dict[int, nn.Parameter] = {}
    for module_name, module in model.named_modules():
        shard = _shard_values(module, before, device, seed, std)
        for key, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in made:
                values = shard.get(key)
                if values is None:
                    values = _full_values(before, p, device, seed, std)
                if values.shape != p.shape:
                    raise RuntimeError(f"{module_name}.{key}: initial values of shape "
                                       f"{tuple(values.shape)} for a parameter of shape {tuple(p.shape)}")
                made[id(p)] = _replacement(p, values.to(dtype))  # drawn on the device
            module._parameters[key] = made[id(p)]


def _recorded(before: dict, p: nn.Parameter) -> tuple[str, torch.Size, nn.Module]:
    """(name, full shape, owning module) of a parameter as built, before AutoTP sharded it."""
    try:
        return before[id(p)]
    except KeyError:
        raise RuntimeError(f"a meta parameter of shape {tuple(p.shape)} that the build did not "
                           "create (DeepSpeed replaced it): its initial values are unknown") from None


def _full_values(before: dict, p: nn.Parameter, device: torch.device, seed: int,
                 std: float) -> torch.Tensor:
    name, shape, owner = _recorded(before, p)
    return _init_values(shape, device, name, owner, seed, std)


def _replacement(old: nn.Parameter, values: torch.Tensor) -> nn.Parameter:
    new = nn.Parameter(values, requires_grad=old.requires_grad)
    new.__dict__.update(old.__dict__)  # AutoTP's marks (tensor-parallel, partition functions, ...)
    for hook in (old._backward_hooks or {}).values():
        new.register_hook(hook)
    return new


def check_materialised(model: nn.Module) -> None:
    """Refuse to train a model with a parameter still on meta (a DeepSpeed that never moved it)."""
    for name, p in model.named_parameters():
        if p.is_meta:
            raise RuntimeError(f"parameter {name} is still on the meta device after deepspeed.initialize")
