"""The pieces of train/construct.py and the DeepSpeed settings that need no process group: parameters
on meta then materialised (tied weights stay tied, buffers stay real), initial weights that depend on
(seed, name) only, a ZeRO-3 partition written in DeepSpeed's layout, AutoTP shards materialised from
the full initial weights by the layer's own partition function, and the engine settings that are set
explicitly per device kind."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from scalestudy.parallel.deepspeed_config import deepspeed_config
from scalestudy.spec.catalog import get_model
from scalestudy.train import construct
from tests.conftest import trial


def _built(precision: str, zero: int = 0):
    cfg = trial([f"precision={precision}", f"zero_stage={zero}", "world_size=1"])
    return cfg, construct.build_trial_model(cfg, deepspeed_config(cfg), torch.device("cpu"))


def test_meta_build_is_materialised_in_the_training_dtype_with_real_buffers():
    _, model = _built("bf16")
    params = list(model.parameters())
    assert params and all(p.device.type == "cpu" and p.dtype == torch.bfloat16 for p in params)
    inv_freq = model.model.rotary_emb.inv_freq
    assert inv_freq.dtype == torch.float32 and torch.isfinite(inv_freq).all() and inv_freq[0] == 1.0


def test_initial_weights_depend_on_seed_and_name_only():
    _, a = _built("fp32")
    _, b = _built("bf16")
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa.to(torch.bfloat16), pb), name  # the same fp32 draw, cast
    norms = [p for n, p in a.named_parameters() if n.endswith("norm.weight")]
    assert norms and all(torch.all(p == 1) for p in norms)
    q = a.model.layers[0].self_attn.q_proj.weight
    assert abs(q.std().item() - 0.02) < 0.002  # N(0, initializer_range)


def test_tied_weights_stay_tied_through_meta():
    from scalestudy.spec.catalog import ModelDims
    from scalestudy.train.model_factory import hf_config

    dims = ModelDims(architecture="gpt", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2,
                     ffn_hidden_size=128, vocab_size=64, max_seq_len=16)
    cls = construct.model_class(get_model("gpt3-175b"))
    with construct.parameters_on_meta():
        model = cls._from_config(hf_config(dims))
    assert model.lm_head.weight.device.type == "meta"
    construct.materialise(model, torch.device("cpu"), torch.float32)
    embedding = model.get_input_embeddings().weight
    assert model.lm_head.weight is embedding and model.lm_head.weight.device.type == "cpu"


def test_autotp_shards_are_materialised_from_the_full_initial_weights_on_first_move():
    """A stand-in for AutoTP (the real one needs a TP group: tests/integration/test_construction.py):
    q_proj's weight cut to its second half of rows on meta, with the partition function and mark that
    AutoTP's column-parallel layer sets on it, and a gradient hook."""
    cfg, whole = _built("fp32")
    with construct.parameters_on_meta():
        model = construct.model_class(cfg.model_dims)._from_config(construct.hf_config(cfg.model_dims))
    construct.materialise_when_moved(model, torch.device("cpu"), torch.bfloat16, cfg.seed, 0.02)
    w = model.model.layers[0].self_attn.q_proj.weight
    rows = w.shape[0] // 2

    def second_half(params):
        params[0].data = params[0][rows:].clone()

    w.data = w[rows:]  # meta stays meta, as AutoTP's move() keeps it
    w._tp_partition, w.tensor_model_parallel = second_half, True
    seen = []
    w.register_hook(lambda g: seen.append(g.shape))
    with pytest.raises(RuntimeError, match="still on the meta device"):
        construct.check_materialised(model)
    assert model.to("cpu") is model and "to" not in model.__dict__  # one shot
    construct.check_materialised(model)
    q = model.model.layers[0].self_attn.q_proj.weight
    full = whole.model.layers[0].self_attn.q_proj.weight
    assert q is not w and q.dtype == torch.bfloat16 and q.tensor_model_parallel
    assert torch.equal(q, full[rows:].to(torch.bfloat16))
    for (name, p), (_, ref) in zip(model.named_parameters(), whole.named_parameters()):
        if name != "model.layers.0.self_attn.q_proj.weight":
            assert torch.equal(p, ref.to(torch.bfloat16)), name
    q.sum().backward()
    assert seen == [q.shape]


def test_partition_written_in_deepspeeds_layout():
    values = torch.arange(10, dtype=torch.float32).reshape(2, 5)
    got = []
    for rank in range(3):  # 10 elements over 3 ranks: pieces of 4, the last padded with zeros
        p = SimpleNamespace(ds_tensor=torch.full((4,), -1.0))
        p.ds_tensor.ds_numel = 4
        construct._write_partition(p, values, rank)
        got.append(p.ds_tensor.tolist())
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 0]]


def test_engine_settings_are_explicit_per_device_kind():
    cpu1 = deepspeed_config(trial(["zero_stage=1", "world_size=1"]))
    gpu1 = deepspeed_config(trial(["zero_stage=1", "world_size=1", "hardware=h100-80gb"]))
    gpu3 = deepspeed_config(trial(["zero_stage=3", "world_size=1", "hardware=h100-80gb"]))
    assert cpu1["optimizer"]["params"]["fused"] is False and gpu1["optimizer"]["params"]["fused"] is True
    assert cpu1["optimizer"]["params"]["torch_adam"] is True
    assert cpu1["zero_optimization"]["overlap_comm"] is False  # DeepSpeed's CPU defaults, written out
    assert deepspeed_config(trial(["zero_stage=3", "world_size=1"]))["zero_optimization"]["overlap_comm"]
    for ds in (gpu1, gpu3):
        z = ds["zero_optimization"]
        assert z["overlap_comm"] is True and z["contiguous_gradients"] is True and z["reduce_bucket_size"] > 0
    assert gpu1["zero_optimization"]["allgather_bucket_size"] > 0
    assert gpu3["zero_optimization"]["stage3_prefetch_bucket_size"] > 0
    assert set(deepspeed_config(trial(["zero_stage=0", "world_size=1"]))["zero_optimization"]) == {"stage"}
