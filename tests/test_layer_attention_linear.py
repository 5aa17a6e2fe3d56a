"""LayerAttentionLinear: the head and the linear map after it, folded, against the two run in turn
(float64, fp32, bf16) and against an independent float64 loop; the folded tagger and runner."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from mhmla_fast import FusedLayerAttention
from mhmla_fast.modules.layer_attention_linear import LayerAttentionLinear

H, LAYERS, C = 24, 3, 2


def _head_and_linear(dtype=torch.float64, seed=0, **settings):
    """A head with non-zero biases (the fold must carry them) and a linear map of C outputs."""
    torch.manual_seed(seed)
    head = FusedLayerAttention(H, LAYERS, backend="torch", **settings)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.startswith("b_"):
                p.normal_(0.0, 0.3)
    linear = nn.Linear(H, C)
    return head.to(dtype).eval(), linear.to(dtype).eval()


def _hidden(dtype=torch.float64, seed=1, lead=(2, 5)):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*lead, H, generator=g, dtype=torch.float64).to(dtype)
                 for _ in range(LAYERS + 1))


def _independent(head, linear, hs):
    """y = W_o c + b_o with c from per-token, per-head, per-layer float64 loops (no fold, no
    batched ops of the library)."""
    L, J = len(head.layers), head.num_heads
    D = H // J
    hsel = [hs[i].double().reshape(-1, H) for i in head.layers]
    W_o, b_o = linear.weight.double(), linear.bias.double()
    N = hsel[0].shape[0]
    out = torch.zeros(N, C, dtype=torch.float64)
    for n in range(N):
        if head.mode == "last":
            c = hsel[-1][n]
        else:
            v = [hsel[l][n] @ head.w_v[l].double() + head.b_v[l].double() for l in range(L)]
            if head.mode == "avgl":
                c = sum(v) / L
            else:
                c = torch.zeros(H, dtype=torch.float64)
                scores = torch.zeros(L, J, dtype=torch.float64)
                for l in range(L):
                    k = torch.relu(hsel[l][n] @ head.w_k[l].double() + head.b_k[l].double())
                    for j in range(J):
                        width = k.numel() // J
                        kj = k[j * width:(j + 1) * width] if head.block_diagonal else k
                        scores[l, j] = kj @ head.w_a[l, :, j].double() + head.b_a[l, j].double()
                p = torch.softmax(scores, dim=0)
                for j in range(J):
                    c[j * D:(j + 1) * D] = sum(p[l, j] * v[l][j * D:(j + 1) * D] for l in range(L))
        out[n] = W_o @ c + b_o
    return out.reshape(*hs[0].shape[:-1], C)


CASES = [
    pytest.param(dict(mode="mhmla", num_heads=4), id="mhmla-J4"),
    pytest.param(dict(mode="mhmla", num_heads=3, key_size=12), id="mhmla-J3-K12"),
    pytest.param(dict(mode="mhmla", num_heads=4, block_diagonal=True), id="mhmla-block-diagonal"),
    pytest.param(dict(mode="mhmla", num_heads=2, layers=[0, 2]), id="mhmla-layers-0-2"),
    pytest.param(dict(mode="shmla"), id="shmla"),
    pytest.param(dict(mode="avgl"), id="avgl"),
    pytest.param(dict(mode="last"), id="last"),
]


@pytest.mark.parametrize("settings", CASES)
def test_fold_equals_head_then_linear_in_float64(settings):
    head, linear = _head_and_linear(**settings)
    hs = _hidden()
    with torch.no_grad():
        want = linear(head(hs))
        got = LayerAttentionLinear(head, linear)(hs)
        independent = _independent(head, linear, hs)
    assert got.shape == (2, 5, C) and got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(want, independent, rtol=1e-12, atol=1e-12)
    # the stacked tensor form of the hidden states gives the same
    torch.testing.assert_close(LayerAttentionLinear(head, linear)(torch.stack(hs)), got)


def _errors_from_float64(settings, dtype, tokens, reduce):
    """(folded output dtype, the folded and the unfolded logits' ``reduce``d abs error from a
    float64 computation of the same weights) in ``dtype``."""
    head64, linear64 = _head_and_linear(**settings)
    hs64 = _hidden(lead=(tokens,))
    with torch.no_grad():
        exact = linear64(head64(hs64))
        head, linear = _head_and_linear(dtype, **settings)
        hs = tuple(h.to(dtype) for h in hs64)
        unfolded = linear(head(hs)).double()
        folded = LayerAttentionLinear(head, linear)(hs)
    return (folded.dtype, reduce((folded.double() - exact).abs()).item(),
            reduce((unfolded - exact).abs()).item())


@pytest.mark.parametrize("settings", CASES)
def test_fold_in_fp32_is_as_close_to_float64_as_the_head(settings):
    dtype, err_folded, err_unfolded = _errors_from_float64(settings, torch.float32, 64, torch.max)
    assert dtype == torch.float32
    assert err_folded < 1e-5 and err_unfolded < 1e-5
    assert err_folded <= 4 * err_unfolded + 1e-7


@pytest.mark.parametrize("settings", [CASES[0], CASES[5]])
def test_fold_in_bf16_is_no_further_from_float64_than_the_head(settings):
    dtype, err_folded, err_unfolded = _errors_from_float64(settings, torch.bfloat16, 256,
                                                           torch.mean)
    assert dtype == torch.float32  # scores, softmax and the sums run in float32
    assert err_folded <= 1.5 * err_unfolded


def test_fold_is_a_snapshot_and_checks_its_inputs():
    head, linear = _head_and_linear(mode="mhmla", num_heads=4)
    hs = _hidden()
    fold = LayerAttentionLinear(head, linear)
    with torch.no_grad():
        before = fold(hs)
        head.w_v.mul_(2.0)
        torch.testing.assert_close(fold(hs), before)  # made from the weights at the time
        assert not torch.allclose(LayerAttentionLinear(head, linear)(hs), before)
    assert not list(fold.parameters())  # buffers only: nothing to train
    with pytest.raises(ValueError, match=r"linear: expected an nn.Linear\(24, C\)"):
        LayerAttentionLinear(head, nn.Linear(H + 1, C))
    with pytest.raises(ValueError, match="head: expected a FusedLayerAttention, got str"):
        LayerAttentionLinear("head", linear)
    with pytest.raises(ValueError, match=r"hidden_states: expected the encoder's 4 hidden states"):
        fold(hs[1:])


def test_folded_tagger_and_torch_runner_match_the_tagger(tiny_tagger_dir):
    from mhmla_fast.ged.model import GedTagger
    from mhmla_fast.serve.runners import TorchRunner

    tagger = GedTagger.load(tiny_tagger_dir, backend="torch")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 20000, (3, 11), generator=g)
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, 7:] = 0
    with torch.no_grad():
        want = tagger(ids, mask)
        got = tagger.folded()(ids, mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    folded = TorchRunner(tiny_tagger_dir, device="cpu", kernels="auto", threads=1)
    plain = TorchRunner(tiny_tagger_dir, device="cpu", kernels="auto", threads=1, fold=False)
    assert folded.folded and not plain.folded
    assert not TorchRunner(tiny_tagger_dir, device="cpu", kernels="triton", threads=1).folded
    a, b = folded(ids.numpy(), mask.numpy()), plain(ids.numpy(), mask.numpy())
    real = mask.numpy().astype(bool)
    np.testing.assert_allclose(a[real], b[real], atol=1e-5)
    assert np.array_equal(a[real] >= 0.5, b[real] >= 0.5)


def test_the_benchmark_writes_op_rows_that_name_the_device(tmp_path):
    import json

    from bench_scripts import load_bench_script

    bench = load_bench_script("benchmark_layer_attention_linear")
    out = tmp_path / "fold.json"
    assert bench.main(["--device", "cpu", "--no-engine", "--shapes", "minilm", "--dtypes", "fp32",
                       "--n", "64", "--op-repeats", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["header"]["commit"] and "cpu" in result["header"]["device"]
    (row,) = result["op"]
    assert (row["shape"], row["dtype"], row["n"]) == ("minilm", "fp32", 64)
    assert set(row["ms"]) == {"head+linear", "folded"} and min(row["ms"].values()) > 0
    assert row["max_abs_err"]["folded"] < 1e-4 and row["max_abs_err"]["head+linear"] < 1e-4
    assert "engine" not in result
