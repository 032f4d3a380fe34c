"""Selective recomputation in the measure backend's model (train/model_factory.py): the attention
core alone runs again in the backward, through transformers' AttentionInterface; the gradients are
those of the model without recomputation, and full recomputation still runs every block again."""

from __future__ import annotations

import pytest
import torch

from scalestudy.spec import catalog
from scalestudy.train import model_factory as mf


def _model(name: str, recompute: str | None):
    dims = catalog.get_model(name)
    model = mf.build_model(dims, seed=0)
    if recompute:
        mf.apply_recomputation(model, True, selective=recompute == "selective")
    return model, dims


def _grads(model, dims):
    torch.manual_seed(1)
    ids = torch.randint(0, dims.vocab_size, (2, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("name", ["llama2-tiny", "gpt2-tiny"])
def test_selective_recomputes_the_attention_core_once_per_block_and_keeps_the_gradients(
        name, monkeypatch):
    from transformers import AttentionInterface

    calls = []
    real = AttentionInterface._global_mapping["sdpa"]

    def counted(*args, **kwargs):
        calls.append(torch.is_grad_enabled())
        return real(*args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", counted)
    plain, dims = _model(name, None)
    want = _grads(plain, dims)
    calls.clear()
    selective, _ = _model(name, "selective")
    got = _grads(selective, dims)
    # forward: once per block, without saving (under checkpoint); backward: once more per block
    assert len(calls) == 2 * dims.num_layers
    assert selective.config._attn_implementation == mf.SELECTIVE_ATTENTION
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    full, _ = _model(name, "full")
    assert full.is_gradient_checkpointing and not selective.is_gradient_checkpointing


def test_selective_needs_the_sdpa_core():
    model, _ = _model("llama2-tiny", None)
    model.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="SDPA"):
        mf.apply_recomputation(model, True, selective=True)
