"""FusedLayerAttention: HF tuple input, layer selection, baselines, state_dict, backends."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from mhmla_fast import FusedLayerAttention
from mhmla_fast.reference import layer_attention_reference

HAS_TRITON_DEVICE = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def tiny_bert_hidden_states(batch=2, seq=7, hidden=48, layers=3, heads=4):
    """A real Hugging Face hidden_states tuple from a tiny random BERT."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=100, hidden_size=hidden, num_hidden_layers=layers,
                     num_attention_heads=heads, intermediate_size=64, max_position_embeddings=32)
    model = BertModel(cfg).eval()
    ids = torch.randint(0, 100, (batch, seq))
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    assert len(out.hidden_states) == layers + 1
    return out.hidden_states


def test_hf_tuple_input_and_embeddings_excluded_by_default():
    hs = tiny_bert_hidden_states()
    mod = FusedLayerAttention(48, 3, num_heads=4, backend="torch").eval()
    assert mod.layers == [1, 2, 3]
    c, p = mod(hs, return_weights=True)
    assert c.shape == (2, 7, 48) and p.shape == (2, 7, 3, 4)
    # the embedding output (entry 0) does not influence the result
    changed = (hs[0] + 100.0, *hs[1:])
    torch.testing.assert_close(mod(changed), c)
    # ... unless asked for
    with_emb = FusedLayerAttention(48, 3, num_heads=4, include_embeddings=True, backend="torch")
    assert with_emb.layers == [0, 1, 2, 3] and with_emb.w_v.shape == (4, 48, 48)
    # the stacked-tensor form gives the same as the tuple
    torch.testing.assert_close(mod(torch.stack(hs)), c)
    # equals the functional reference with the module's parameters
    ref, _ = layer_attention_reference(torch.stack(hs[1:]).reshape(3, 14, 48), mod.w_v, mod.b_v,
                                       mod.w_k, mod.b_k, mod.w_a, mod.b_a, 4)
    torch.testing.assert_close(c.reshape(14, 48), ref)


def test_layer_selection():
    hs = tiny_bert_hidden_states()
    mod = FusedLayerAttention(48, 3, num_heads=2, layers=[1, 3], backend="torch").eval()
    assert mod.w_v.shape == (2, 48, 48)
    changed = (hs[0], hs[1], hs[2] * 5.0, hs[3])  # layer 2 is not selected
    torch.testing.assert_close(mod(changed), mod(hs))
    with pytest.raises(ValueError, match=r"hidden_states: expected the encoder's 4 hidden states"):
        mod(hs[1:])
    with pytest.raises(ValueError, match=r"layers: expected indices in \[0, 3\]"):
        FusedLayerAttention(48, 3, layers=[1, 4])


def test_state_dict_round_trip(tmp_path):
    from safetensors.torch import load_file, save_file

    hs = tiny_bert_hidden_states()
    mod = FusedLayerAttention(48, 3, num_heads=4, key_size=24, backend="torch").eval()
    save_file(mod.state_dict(), tmp_path / "head.safetensors")
    other = FusedLayerAttention(48, 3, num_heads=4, key_size=24, backend="torch").eval()
    assert not torch.equal(other(hs), mod(hs))  # a fresh init differs...
    other.load_state_dict(load_file(tmp_path / "head.safetensors"))
    assert torch.equal(other(hs), mod(hs))  # ...until the weights are loaded
    assert set(mod.state_dict()) == {"w_v", "b_v", "w_k", "b_k", "w_a", "b_a"}


def test_baseline_configurations():
    hs = tiny_bert_hidden_states()
    last = FusedLayerAttention(48, 3, mode="last").eval()
    assert list(last.parameters()) == []
    assert torch.equal(last(hs), hs[3])

    avgl = FusedLayerAttention(48, 3, mode="avgl", backend="torch").eval()
    expect = sum(hs[l] @ avgl.w_v[l - 1] + avgl.b_v[l - 1] for l in (1, 2, 3)) / 3
    torch.testing.assert_close(avgl(hs), expect)
    assert not hasattr(avgl, "w_k")

    shmla = FusedLayerAttention(48, 3, num_heads=12, mode="shmla", backend="torch").eval()
    c, p = shmla(hs, return_weights=True)
    assert shmla.num_heads == 1 and p.shape == (2, 7, 3, 1)

    mhmla = FusedLayerAttention(48, 3, num_heads=12, backend="torch").eval()
    c, p = mhmla(hs, return_weights=True)
    assert p.shape == (2, 7, 3, 12)
    torch.testing.assert_close(p.sum(-2), torch.ones(2, 7, 12))
    # heads really differ: each has its own scorer
    assert not torch.allclose(p[..., 0], p[..., 1])

    with pytest.raises(ValueError, match="mode: expected one of"):
        FusedLayerAttention(48, 3, mode="bogus")
    with pytest.raises(ValueError, match=r"num_heads: H = 48 is not divisible by J = 5"):
        FusedLayerAttention(48, 3, num_heads=5)
    with pytest.raises(ValueError, match=r"dropout: expected a rate"):
        FusedLayerAttention(48, 3, dropout=1.5)


def test_dropout_default_and_train_eval():
    hs = tiny_bert_hidden_states()
    mod = FusedLayerAttention(48, 3, num_heads=4, backend="torch")
    assert mod.dropout == 0.3 and mod.training
    a, b = mod(hs), mod(hs)
    assert not torch.allclose(a, b), "training mode applies dropout"
    mod.eval()
    assert torch.equal(mod(hs), mod(hs))


def test_backward_reaches_every_parameter_and_casts_to_input_dtype():
    hs = tiny_bert_hidden_states()
    mod = FusedLayerAttention(48, 3, num_heads=4, block_diagonal=True, backend="torch")
    assert mod.w_a.shape == (3, 12, 4)
    mod(hs).square().sum().backward()
    for name, param in mod.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
    c = mod.eval()(tuple(h.double() for h in hs))
    assert c.dtype == torch.float64 and mod.w_v.dtype == torch.float32


@pytest.mark.skipif(not HAS_TRITON_DEVICE, reason="Triton needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("block_diagonal", [False, True])
def test_triton_backend_matches_torch_backend(block_diagonal):
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the triton backend's device
    hs = tuple(h.detach().to(device) for h in tiny_bert_hidden_states())
    torch.manual_seed(1)
    eager = FusedLayerAttention(48, 3, num_heads=4, backend="torch",
                                block_diagonal=block_diagonal).to(device).eval()
    fused = FusedLayerAttention(48, 3, num_heads=4, backend="triton",
                                block_diagonal=block_diagonal).to(device).eval()
    fused.load_state_dict(eager.state_dict())
    head = nn.Linear(48, 2).to(device)
    for mod in (eager, fused):
        head(mod(hs)).logsumexp(-1).sum().backward()
    torch.testing.assert_close(fused(hs), eager(hs), rtol=1e-5, atol=1e-5)
    for (name, a), b in zip(fused.named_parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_bad_hidden_states_are_named_in_every_mode():
    """The input, not a parameter or a constructor argument, is named for a wrong width in
    every mode; None (an encoder called without output_hidden_states=True) and a generator
    are ValueErrors saying what was expected."""
    hs = tiny_bert_hidden_states()
    for mode in ("mhmla", "shmla", "avgl", "last"):
        mod = FusedLayerAttention(48, 3, num_heads=4, mode=mode, backend="torch")
        for width in (40, 36):  # 36 is not divisible by J = 4
            with pytest.raises(ValueError, match=rf"hidden: expected layers \[\*, H\] with H = "
                                                 rf"48 .* got \[2, 7, {width}\]"):
                mod(tuple(h[..., :width] for h in hs))
        with pytest.raises(ValueError, match="got None; call the encoder with "
                                             "output_hidden_states=True"):
            mod(None)
        with pytest.raises(ValueError, match="hidden_states: expected the encoder's hidden "
                                             "states .* got generator"):
            mod(h for h in hs)


def test_the_triton_backend_is_refused_where_a_mode_has_nothing_to_fuse():
    """"triton" in the avgl and last modes (no layer attention) is an error, not eager run
    under the name; the training configs refuse it before a run starts."""
    from mhmla_fast.configs import LayerAttentionConfig
    from mhmla_fast.ged.train import TrainConfig

    for mode in ("avgl", "last"):
        with pytest.raises(ValueError, match=f"'triton' .* nothing to run in mode '{mode}'"):
            FusedLayerAttention(48, 3, mode=mode, backend="triton")
        with pytest.raises(ValueError, match=f"nothing to run in mode '{mode}'"):
            TrainConfig(out="x", train="t", dev="d", backend="triton",
                        layer_attention=LayerAttentionConfig(mode=mode))
        assert FusedLayerAttention(48, 3, mode=mode, backend="torch").mode == mode
