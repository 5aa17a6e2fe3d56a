"""The layer-attention op: eager reference vs float64 NumPy, fused Triton kernels vs reference.

The Triton cases need TRITON_INTERPRET=1 in the environment on CPU (set before import, as
`.ci/run` does); without it and without CUDA they are skipped with that reason.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from mhmla_fast import layer_attention
from mhmla_fast.reference import layer_attention_reference

HAS_TRITON_DEVICE = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(
    not HAS_TRITON_DEVICE, reason="Triton kernels need CUDA or TRITON_INTERPRET=1 set before import"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ("hidden", "w_v", "b_v", "w_k", "b_k", "w_a", "b_a")


def make_inputs(L, N, H, K, J, dtype=torch.float32, device="cpu", seed=0, block_diagonal=False,
                scale=0.5):
    """Random inputs with a realistic scale (weights ~ 1/sqrt(fan_in)), as float64 leaves."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, fan_in=None):
        s = scale if fan_in is None else scale * 2.0 / fan_in**0.5
        return torch.randn(*shape, generator=g, dtype=torch.float64) * s

    Ka = K // J if block_diagonal else K
    ts = [r(L, N, H), r(L, H, H, fan_in=H), r(L, H), r(L, H, K, fan_in=H), r(L, K),
          r(L, Ka, J, fan_in=Ka), r(L, J)]
    return [t.to(device=device, dtype=dtype) for t in ts]


def leaves(ts):
    return [t.detach().clone().requires_grad_() for t in ts]


# ----------------------------------------------------------- independent float64 oracle


def numpy_mhmla(hidden, w_v, b_v, w_k, b_k, w_a, b_a, J, block_diagonal=False, masks=None,
                rates=(0.0, 0.0, 0.0)):
    """Eqs. 4-9 token by token, layer by layer, head by head, in float64 NumPy."""
    hidden, w_v, b_v, w_k, b_k, w_a, b_a = (np.asarray(t, dtype=np.float64) for t in
                                            (hidden, w_v, b_v, w_k, b_k, w_a, b_a))
    L, N, H = hidden.shape
    K = w_k.shape[2]
    D = H // J
    c = np.zeros((N, H))
    p = np.zeros((L, N, J))
    for n in range(N):
        v = np.zeros((L, H))
        a = np.zeros((L, J))
        for l in range(L):
            h = hidden[l, n].copy()
            if masks is not None:
                h = h * masks[0][l, n] / (1 - rates[0])
            v[l] = h @ w_v[l] + b_v[l]  # Eq. 4
            k = np.maximum(h @ w_k[l] + b_k[l], 0.0)  # Eq. 5
            if masks is not None:
                k = k * masks[1][l, n] / (1 - rates[1])
            for j in range(J):  # Eq. 6
                if block_diagonal:
                    kj = K // J
                    a[l, j] = k[j * kj:(j + 1) * kj] @ w_a[l, :, j] + b_a[l, j]
                else:
                    a[l, j] = k @ w_a[l, :, j] + b_a[l, j]
        for j in range(J):
            e = np.exp(a[:, j] - a[:, j].max())
            p[:, n, j] = e / e.sum()  # Eq. 7
            w = p[:, n, j] * (masks[2][:, n, j] / (1 - rates[2]) if masks is not None else 1.0)
            c[n, j * D:(j + 1) * D] = (w[:, None] * v[:, j * D:(j + 1) * D]).sum(0)  # Eqs. 8-9
    return c, p


@pytest.mark.parametrize("block_diagonal", [False, True])
@pytest.mark.parametrize("L,N,H,K,J", [(1, 5, 12, 8, 4), (3, 7, 12, 9, 3), (4, 6, 8, 8, 1)])
def test_reference_matches_float64_numpy(L, N, H, K, J, block_diagonal):
    if block_diagonal and K % J:
        pytest.skip("block-diagonal scoring needs J | K")
    ts = make_inputs(L, N, H, K, J, dtype=torch.float64, block_diagonal=block_diagonal)
    c, p = layer_attention_reference(*ts, J, block_diagonal=block_diagonal)
    c_np, p_np = numpy_mhmla(*ts, J, block_diagonal=block_diagonal)
    np.testing.assert_allclose(c.numpy(), c_np, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(p.numpy(), p_np, rtol=1e-12, atol=1e-12)
    # the public API on the torch backend is the reference, leading dims restored
    c2, p2 = layer_attention(ts[0].reshape(L, 1, N, H), *ts[1:], J, backend="torch",
                             return_weights=True, block_diagonal=block_diagonal)
    np.testing.assert_allclose(c2.reshape(N, H).numpy(), c_np, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(p2.reshape(N, L, J).permute(1, 0, 2).numpy(), p_np, rtol=1e-12)


def test_reference_dropout_masks_match_float64_numpy():
    L, N, H, K, J = 3, 5, 12, 6, 3
    rates = (0.3, 0.2, 0.5)
    ts = make_inputs(L, N, H, K, J, dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    masks = [(torch.rand(shape, generator=g) >= r).to(torch.int8)
             for shape, r in zip(((L, N, H), (L, N, K), (L, N, J)), rates)]
    c, p = layer_attention_reference(*ts, J, dropout_h=rates[0], dropout_k=rates[1],
                                     dropout_p=rates[2], training=True, masks=masks)
    c_np, p_np = numpy_mhmla(*ts, J, masks=[m.numpy() for m in masks], rates=rates)
    np.testing.assert_allclose(c.numpy(), c_np, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(p.numpy(), p_np, rtol=1e-12, atol=1e-12)


def test_scalar_mix_is_a_special_case():
    """W_k = 0, W_a = 0, b_a = s (shared by heads), W_v = I: c = sum_l softmax(s)_l h^l."""
    L, N, H, J = 4, 6, 8, 2
    g = torch.Generator().manual_seed(3)
    h = torch.randn(L, N, H, generator=g, dtype=torch.float64)
    s = torch.randn(L, generator=g, dtype=torch.float64)
    eye = torch.eye(H, dtype=torch.float64).expand(L, H, H)
    c = layer_attention(h, eye, torch.zeros(L, H, dtype=torch.float64),
                        torch.zeros(L, H, 5, dtype=torch.float64),
                        torch.zeros(L, 5, dtype=torch.float64),
                        torch.zeros(L, 5, J, dtype=torch.float64), s[:, None].expand(L, J),
                        J, backend="torch")
    w = np.exp(s.numpy()) / np.exp(s.numpy()).sum()
    np.testing.assert_allclose(c.numpy(), np.einsum("l,lnh->nh", w, h.numpy()), rtol=1e-12)


def test_reference_gradcheck_float64():
    ts = leaves(make_inputs(2, 3, 6, 4, 3, dtype=torch.float64))
    fn = lambda *a: layer_attention(*a, 3, backend="torch", return_weights=True)  # noqa: E731
    assert torch.autograd.gradcheck(fn, ts)


# --------------------------------------------------------------- fused kernels vs eager


def assert_close_to_oracle(name, fused, eager, oracle, factor, floor):
    """flash-attention's rule: |fused - oracle| <= factor * |eager - oracle| + floor."""
    fused, eager, oracle = (t.detach().double().cpu() for t in (fused, eager, oracle))
    err_fused = (fused - oracle).abs().max().item()
    err_eager = (eager - oracle).abs().max().item()
    bound = factor * err_eager + floor * max(1.0, oracle.abs().max().item())
    if not err_fused <= bound:
        idx = np.unravel_index((fused - oracle).abs().argmax().item(), tuple(fused.shape))
        raise AssertionError(
            f"{name}: fused error {err_fused:.3e} > {bound:.3e} (eager error {err_eager:.3e}); "
            f"worst at {idx}: fused {fused[idx].item():.6g}, oracle {oracle[idx].item():.6g}"
        )


def skip_where_fused_refuses(dtype, H, K):
    """Skip a direct kernel call on a shape the fused op refuses on this device (16-bit CUDA
    with H or K not a multiple of 16: :func:`mhmla_fast.dispatch.fused_unsupported`); the
    interpreter still runs it."""
    from mhmla_fast.dispatch import fused_unsupported

    why = fused_unsupported(torch.device(DEVICE).type, dtype, H, K)
    if why:
        pytest.skip(why)


def run(ts, J, backend, grad_c, grad_p=None, **kw):
    ts = leaves(ts)
    c, p = layer_attention(*ts, J, backend=backend, return_weights=True, **kw)
    loss = (c.double() * grad_c).sum()
    if grad_p is not None:
        loss = loss + (p.double() * grad_p).sum()
    grads = torch.autograd.grad(loss, ts)
    return [c, p, *grads]


GRID = [
    # L, N, H, K, J, dtype
    (1, 37, 120, 72, 3, torch.float32),
    (6, 70, 120, 200, 12, torch.float32),
    (13, 37, 120, 96, 1, torch.float32),
    (6, 45, 384, 160, 12, torch.float32),
    (13, 19, 384, 256, 3, torch.float16),
    (6, 70, 120, 72, 1, torch.float16),
    (1, 130, 384, 64, 12, torch.float16),
]


@needs_triton
@pytest.mark.parametrize("L,N,H,K,J,dtype", GRID)
def test_triton_matches_reference(L, N, H, K, J, dtype):
    from mhmla_fast.dispatch import fused_unsupported

    base = make_inputs(L, N, H, K, J, dtype=torch.float64, device=DEVICE, seed=L * N + J)
    if fused_unsupported(torch.device(DEVICE).type, dtype, H, K):  # 16-bit CUDA, H or K % 16
        with pytest.raises(ValueError, match="multiples of 16"):
            layer_attention(*[t.to(dtype) for t in base], J, backend="triton")
        return
    g = torch.Generator().manual_seed(5)
    grad_c = torch.randn(N, H, generator=g, dtype=torch.float64).to(DEVICE)
    grad_p = torch.randn(N, L, J, generator=g, dtype=torch.float64).to(DEVICE)
    oracle = run(base, J, "torch", grad_c, grad_p)
    eager = run([t.to(dtype) for t in base], J, "torch", grad_c, grad_p)
    fused = run([t.to(dtype) for t in base], J, "triton", grad_c, grad_p)
    assert fused[0].dtype == dtype and fused[0].shape == (N, H)
    # absolute floor for entries eager gets exactly (e.g. L = 1: da == 0 by construction,
    # which the fused kernel reaches only up to the cancellation dp - delta)
    floor = 1e-5 if dtype == torch.float32 else 1e-3
    for i, name in enumerate(("c", "p") + tuple(f"d{n}" for n in NAMES)):
        factor = 2.0 if i < 2 else 3.0
        assert_close_to_oracle(name, fused[i], eager[i], oracle[i], factor, floor)


GPU_BF16_GRID = [
    # L, N, H, K, J: MiniLM and BERT-base head shapes with N not a multiple of any tile
    (6, 333, 384, 384, 12),
    (12, 517, 768, 768, 12),
    (13, 70, 112, 80, 7),  # D = 16; (13, 70, 120, 72, 3) faulted on an H100 (now refused)
]


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="bf16 kernels run on a GPU (the interpreter's bf16 arithmetic is unreliable)")
@pytest.mark.parametrize("dropout", [False, True])
@pytest.mark.parametrize("L,N,H,K,J", GPU_BF16_GRID)
def test_triton_matches_reference_bf16_on_gpu(L, N, H, K, J, dropout, monkeypatch):
    """bf16 on the GPU, by the same rule as fp32/fp16; with dropout, against the reference on
    the kernels' own masks (forward and all seven gradients, several backward layer groups)."""
    import mhmla_fast.kernels.layer_attention as kernels

    monkeypatch.setattr(kernels, "BWD_GROUP_ELEMENTS", N * (H + K) * 5)  # groups of 5 layers
    base = make_inputs(L, N, H, K, J, dtype=torch.float64, device="cuda", seed=L + N)
    g = torch.Generator().manual_seed(9)
    grad_c = torch.randn(N, H, generator=g, dtype=torch.float64).cuda()
    grad_p = torch.randn(N, L, J, generator=g, dtype=torch.float64).cuda()
    if not dropout:
        oracle = run(base, J, "torch", grad_c, grad_p)
        eager = run([t.bfloat16() for t in base], J, "torch", grad_c, grad_p)
        fused = run([t.bfloat16() for t in base], J, "triton", grad_c, grad_p)
    else:
        rates = (0.3, 0.3, 0.3)
        masks = kernels.layer_attention_dropout_masks((L, N, H), (L, N, K), (L, N, J), rates, 5,
                                                      "cuda")

        def go(ts, fused_op):
            ts = leaves(ts)
            if fused_op:
                c, p = kernels.layer_attention_triton(*ts, J, dropout=rates, seed=5)
            else:
                c, p = layer_attention_reference(*ts, J, dropout_h=rates[0], dropout_k=rates[1],
                                                 dropout_p=rates[2], training=True, masks=masks)
            p = p.permute(1, 0, 2)
            loss = (c.double() * grad_c).sum() + (p.double() * grad_p).sum()
            return [c, p, *torch.autograd.grad(loss, ts)]

        oracle = go(base, False)
        eager = go([t.bfloat16() for t in base], False)
        fused = go([t.bfloat16() for t in base], True)
    for i, name in enumerate(("c", "p") + tuple(f"d{n}" for n in NAMES)):
        assert_close_to_oracle(name, fused[i], eager[i], oracle[i], 2.0 if i < 2 else 3.0, 4e-3)


@needs_triton
def test_triton_block_diagonal_matches_reference():
    L, N, H, K, J = 3, 21, 48, 36, 3
    base = make_inputs(L, N, H, K, J, dtype=torch.float64, device=DEVICE, block_diagonal=True)
    grad_c = torch.randn(N, H, dtype=torch.float64, device=DEVICE)
    oracle = run(base, J, "torch", grad_c, block_diagonal=True)
    fused = run([t.float() for t in base], J, "triton", grad_c, block_diagonal=True)
    assert fused[7].shape == (L, K // J, J)
    for i, name in enumerate(("c", "p") + tuple(f"d{n}" for n in NAMES)):
        torch.testing.assert_close(fused[i].double(), oracle[i], rtol=1e-4, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")


@needs_triton
def test_triton_gradcheck_float64():
    ts = leaves(make_inputs(2, 3, 6, 4, 3, dtype=torch.float64, device=DEVICE))
    fn = lambda *a: layer_attention(*a, 3, backend="triton", return_weights=True)  # noqa: E731
    assert torch.autograd.gradcheck(fn, ts, atol=1e-7, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("grouped", [False, True])
def test_triton_weight_gradients_are_deterministic(monkeypatch, grouped):
    import mhmla_fast.kernels.layer_attention as kernels

    if grouped:
        monkeypatch.setattr(kernels, "BWD_GROUP_ELEMENTS", 150 * (64 + 48))
    ts = make_inputs(3, 150, 64, 48, 4, device=DEVICE)
    grad_c = torch.randn(150, 64, dtype=torch.float64, device=DEVICE)
    first = run(ts, 4, "triton", grad_c)
    second = run(ts, 4, "triton", grad_c)
    for i, name in enumerate(("c", "p") + NAMES):
        assert torch.equal(first[i], second[i]), f"{name} differs between identical runs"


@needs_triton
def test_leading_dims_and_hf_tuple_input():
    L, B, T, H, K, J = 3, 2, 5, 24, 16, 4
    ts = make_inputs(L, B * T, H, K, J, device=DEVICE)
    layers = list(ts[0].reshape(L, B, T, H).unbind(0))  # a tuple of [B, T, H] like HF's
    for backend in ("torch", "triton"):
        c, p = layer_attention(layers, *ts[1:], J, backend=backend, return_weights=True)
        assert c.shape == (B, T, H) and p.shape == (B, T, L, J)
        torch.testing.assert_close(p.sum(-2), torch.ones(B, T, J, device=DEVICE))
        flat = layer_attention(ts[0], *ts[1:], J, backend=backend)
        torch.testing.assert_close(c.reshape(B * T, H), flat)


@needs_triton
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_non_finite_inputs_stay_at_their_token(backend):
    L, N, H, K, J = 3, 40, 24, 16, 4
    ts = make_inputs(L, N, H, K, J, device=DEVICE)
    ts[0][1, 7, 3] = float("nan")
    ts[0][0, 21, 0] = float("inf")
    c, p = layer_attention(*ts, J, backend=backend, return_weights=True)
    bad = ~torch.isfinite(c).all(-1)
    assert bad[7] and bad[21]
    assert bad.sum() == 2, f"non-finite rows {bad.nonzero().flatten().tolist()}"
    assert torch.isfinite(p[[i for i in range(N) if i not in (7, 21)]]).all()


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_large_scores_stay_finite(dtype):
    """Scores of magnitude 1e4 (far outside exp's range) give finite, correct weights."""
    L, N, H, K, J = 4, 33, 32, 16, 4  # H, K multiples of 16: fp16 runs fused on CUDA too
    ts = make_inputs(L, N, H, K, J, dtype=torch.float64, device=DEVICE)
    ts[6] = torch.tensor([[1e4, -1e4, 5e3, 0.0], [9.99e3, 1e4, -5e3, 0.0],
                          [-1e4, 9.9e3, 1e4, 1.0], [0.0, 0.0, 0.0, -1e4]],
                         dtype=torch.float64, device=DEVICE)
    ref_c, ref_p = layer_attention(*ts, J, backend="torch", return_weights=True)
    c, p = layer_attention(*[t.to(dtype) for t in ts], J, backend="triton", return_weights=True)
    assert torch.isfinite(c).all() and torch.isfinite(p).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(p.double(), ref_p, rtol=0, atol=tol)
    torch.testing.assert_close(c.double(), ref_c, rtol=tol, atol=tol * 10)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_backward_in_layer_groups_matches_reference(monkeypatch, dtype):
    """The backward over several layer groups (uneven last group) meets the one-group rule."""
    import mhmla_fast.kernels.layer_attention as kernels

    L, N, H, K, J = 5, 150, 48, 48, 4  # H, K multiples of 16: fp16 runs fused on CUDA too
    monkeypatch.setattr(kernels, "BWD_GROUP_ELEMENTS", N * (H + K) * 2)
    assert kernels._bwd_layer_groups(L, N, H, K) == [(0, 2), (2, 4), (4, 5)]
    base = make_inputs(L, N, H, K, J, dtype=torch.float64, device=DEVICE, seed=11)
    g = torch.Generator().manual_seed(6)
    grad_c = torch.randn(N, H, generator=g, dtype=torch.float64).to(DEVICE)
    grad_p = torch.randn(N, L, J, generator=g, dtype=torch.float64).to(DEVICE)
    oracle = run(base, J, "torch", grad_c, grad_p)
    eager = run([t.to(dtype) for t in base], J, "torch", grad_c, grad_p)
    fused = run([t.to(dtype) for t in base], J, "triton", grad_c, grad_p)
    floor = 1e-5 if dtype == torch.float32 else 1e-3
    for i, name in enumerate(("c", "p") + tuple(f"d{n}" for n in NAMES)):
        assert_close_to_oracle(name, fused[i], eager[i], oracle[i], 2.0 if i < 2 else 3.0, floor)
    monkeypatch.setattr(kernels, "BWD_GROUP_ELEMENTS", 1)  # at least one layer per group
    assert kernels._bwd_layer_groups(L, N, H, K) == [(i, i + 1) for i in range(L)]
    monkeypatch.setattr(kernels, "BWD_GROUP_ELEMENTS", 1 << 40)
    assert kernels._bwd_layer_groups(L, N, H, K) == [(0, L)]


@needs_triton
@pytest.mark.parametrize("H,K,block_n,block_o,block_k,dropout", [
    (120, 72, 64, 128, 128, False),  # one bwd_values tile over both 64-column dp slots
    (200, 136, 128, 256, 256, True),  # one tile over 4 slots, the last one partial; 128 x 64-token
    #                                   slots, the second one partial; dropout
    (384, 96, 128, 128, 64, False),  # 3 tiles of 2 column slots each, 2 token slots each
    (256, 64, 64, 128, 64, True),  # J = 4, D = 64: whole heads, dp written without slots
])
def test_triton_backward_tiles_over_several_slots_read_nothing_unwritten(
        monkeypatch, H, K, block_n, block_o, block_k, dropout):
    """Backward tiles wider than one 64-column or 64-token slot of partial sums leave the
    slots past their first at zero, and no kernel reads memory it has not written: every
    buffer the op allocates with torch.empty starts as NaN."""
    import mhmla_fast.kernels.layer_attention as kernels

    L, N, J = 3, 70, 4 if H % 4 == 0 else 3
    monkeypatch.setitem(kernels._FIXED, "bwd_values",
                        (dict(BLOCK_N=block_n, BLOCK_O=block_o, BLOCK_I=64), 4, 3))
    monkeypatch.setitem(kernels._FIXED, "bwd_keys",
                        (dict(BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_I=32), 4, 3))
    empty, empty_like = torch.empty, torch.empty_like

    def nan(t):
        return t.fill_(float("nan")) if t.dtype.is_floating_point else t

    base = make_inputs(L, N, H, K, J, dtype=torch.float64, device=DEVICE, seed=H)
    g = torch.Generator().manual_seed(3)
    grad_c = torch.randn(N, H, generator=g, dtype=torch.float64).to(DEVICE)
    grad_p = torch.randn(N, L, J, generator=g, dtype=torch.float64).to(DEVICE)
    rates = (0.3, 0.2, 0.25) if dropout else (0.0, 0.0, 0.0)
    masks = kernels.layer_attention_dropout_masks((L, N, H), (L, N, K), (L, N, J), rates, 7, DEVICE)

    def go(ts, fused):
        ts = leaves(ts)
        if fused:
            monkeypatch.setattr(torch, "empty", lambda *a, **k: nan(empty(*a, **k)))
            monkeypatch.setattr(torch, "empty_like", lambda *a, **k: nan(empty_like(*a, **k)))
            c, p = kernels.layer_attention_triton(*ts, J, dropout=rates, seed=7)
        else:
            c, p = layer_attention_reference(
                *ts, J, dropout_h=rates[0], dropout_k=rates[1], dropout_p=rates[2],
                training=dropout, masks=masks if dropout else None)
        loss = (c.double() * grad_c).sum() + (p.permute(1, 0, 2).double() * grad_p).sum()
        out = [c, p, *torch.autograd.grad(loss, ts)]
        monkeypatch.setattr(torch, "empty", empty)
        monkeypatch.setattr(torch, "empty_like", empty_like)
        return out

    oracle = go(base, False)
    eager = go([t.float() for t in base], False)
    fused = go([t.float() for t in base], True)
    for i, name in enumerate(("c", "p") + tuple(f"d{n}" for n in NAMES)):
        assert torch.isfinite(fused[i]).all(), name
        assert_close_to_oracle(name, fused[i], eager[i], oracle[i], 2.0 if i < 2 else 3.0, 1e-5)


@needs_triton
@pytest.mark.parametrize("kernels", [("triton", "torch"), ("torch", "triton"), ("torch", "torch")])
def test_mixed_directions_match_the_fused_op(kernels):
    """A fused forward with an eager backward (or the reverse) replays the same dropout masks,
    so every direction mix gives the fused op's outputs and gradients."""
    from mhmla_fast.kernels.layer_attention import layer_attention_triton

    L, N, H, K, J = 3, 45, 48, 40, 4
    rates = (0.3, 0.2, 0.4)
    ts = make_inputs(L, N, H, K, J, device=DEVICE, seed=4)
    grad_c = torch.randn(N, H, device=DEVICE)
    grad_p = torch.randn(L, N, J, device=DEVICE)

    def go(kern):
        xs = leaves(ts)
        c, p = layer_attention_triton(*xs, J, dropout=rates, seed=77, kernels=kern)
        return [c, p, *torch.autograd.grad((c * grad_c).sum() + (p * grad_p).sum(), xs)]

    fused, mixed = go(("triton", "triton")), go(kernels)
    for name, a, b in zip(("c", "p") + NAMES, fused, mixed):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    with pytest.raises(ValueError, match="kernels: expected"):
        layer_attention_triton(*ts, J, kernels=("triton", "cuda"))


def test_auto_backend_follows_the_measured_table(monkeypatch):
    from mhmla_fast import dispatch

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    rule = dispatch.AutoRule("triton", "torch", min_fused_work=1000)
    monkeypatch.setitem(dispatch.AUTO_KERNELS, "cuda", rule)
    kernels = dispatch.layer_attention_kernels
    assert kernels("auto", cpu) == ("torch", "torch")  # not in the table: eager
    assert kernels("auto", cuda) == ("triton", "torch")
    assert kernels("auto", cuda, work=1000) == ("triton", "torch")
    assert kernels("auto", cuda, work=999) == ("torch", "torch")  # below the crossover
    assert kernels("auto", cuda, needs_grad=True, work=10**9) == ("torch", "torch")
    assert kernels("auto", cuda, work=10**9, unsupported="odd shape") == ("torch", "torch")
    monkeypatch.setitem(dispatch.AUTO_KERNELS, "cuda", dispatch.AutoRule("triton", "triton"))
    assert kernels("auto", cuda, needs_grad=True, work=1, dtype=torch.float16) == ("triton", "triton")
    # a fused backward from its own crossover up, for 16-bit inputs only
    rule = dispatch.AutoRule("triton", "triton", min_fused_work=1000, min_fused_backward_work=5000)
    monkeypatch.setitem(dispatch.AUTO_KERNELS, "cuda", rule)
    bf16 = torch.bfloat16
    assert kernels("auto", cuda, needs_grad=True, work=5000, dtype=bf16) == ("triton", "triton")
    assert kernels("auto", cuda, needs_grad=True, work=4999, dtype=bf16) == ("torch", "torch")
    assert kernels("auto", cuda, needs_grad=True, work=10**9, dtype=torch.float32) == ("torch", "torch")
    assert kernels("auto", cuda, needs_grad=True, work=10**9) == ("torch", "torch")  # dtype unknown
    assert kernels("auto", cuda, work=4999, dtype=bf16) == ("triton", "torch")  # no gradient
    assert kernels("triton", cpu) == ("triton", "triton")
    assert kernels("torch", cuda, work=10**9) == ("torch", "torch")
    with pytest.raises(ValueError, match="backend: expected one of"):
        kernels("fast", cpu)
    with pytest.raises(ValueError, match="forward: expected one of"):
        dispatch.AutoRule("cuda", "torch")


def test_fused_kernels_refuse_16_bit_cuda_shapes_that_faulted():
    """H or K not a multiple of 16 in fp16/bf16 on CUDA: the fused path is refused (an H100
    run faulted at H=120, K=72); fp32, CPU and multiples of 16 are taken."""
    from mhmla_fast.dispatch import fused_unsupported

    assert "H=120, K=72" in fused_unsupported("cuda", torch.bfloat16, 120, 72)
    assert fused_unsupported("cuda", torch.float16, 768, 72) is not None
    assert fused_unsupported("cuda", torch.float16, 120, 768) is not None
    assert fused_unsupported("cuda", torch.bfloat16, 768, 768) is None
    assert fused_unsupported("cuda", torch.float32, 120, 72) is None
    assert fused_unsupported("cpu", torch.float16, 120, 72) is None


@needs_triton
def test_auto_backend_runs_the_pair_the_table_names(monkeypatch):
    """With the table saying (fused forward, eager backward) for this device, "auto" runs
    exactly that: the forward equals the fused op bit for bit, the gradients eager's."""
    from mhmla_fast import dispatch

    L, N, H, K, J = 2, 30, 32, 16, 4
    ts = [t.half() for t in make_inputs(L, N, H, K, J, device=DEVICE, seed=8)]  # a fused
    grad_c = torch.randn(N, H, device=DEVICE, dtype=torch.float64)  # backward is 16-bit only
    monkeypatch.setitem(dispatch.AUTO_KERNELS, torch.device(DEVICE).type,
                        dispatch.AutoRule("triton", "triton"))
    auto = run(ts, J, "auto", grad_c)
    fused = run(ts, J, "triton", grad_c)
    for name, a, b in zip(("c", "p", *NAMES), auto, fused):
        assert torch.equal(a, b), name


@needs_triton
def test_auto_with_an_eager_backward_runs_eager_when_a_gradient_is_needed(monkeypatch):
    """Table (fused forward, eager backward): without autograd "auto" runs the fused forward
    bit for bit; with a backward to run it is eager end to end (output and gradients equal to
    eager's bit for bit), since the eager backward would recompute the eager forward anyway."""
    from mhmla_fast import dispatch, layer_attention

    L, N, H, K, J = 2, 30, 24, 16, 4
    ts = make_inputs(L, N, H, K, J, device=DEVICE, seed=8)
    grad_c = torch.randn(N, H, device=DEVICE, dtype=torch.float64)
    monkeypatch.setitem(dispatch.AUTO_KERNELS, torch.device(DEVICE).type,
                        dispatch.AutoRule("triton", "torch"))
    import mhmla_fast.functional as functional
    calls = []
    reference = functional.layer_attention_reference
    monkeypatch.setattr(functional, "layer_attention_reference",
                        lambda *a, **k: calls.append("eager") or reference(*a, **k))
    with torch.no_grad():
        auto_c = layer_attention(*ts, J, backend="auto")
        fused_c = layer_attention(*ts, J, backend="triton")
    assert torch.equal(auto_c, fused_c) and calls == []
    auto = run(ts, J, "auto", grad_c)
    assert calls == ["eager"]
    eager = run(ts, J, "torch", grad_c)
    for name, a, b in zip(("c", "p", *NAMES), auto, eager):
        assert torch.equal(a, b), name


# ------------------------------------------------------------------------------ dropout


@needs_triton
@pytest.mark.parametrize("grouped", [False, True])
def test_triton_dropout_backward_replays_forward_masks(monkeypatch, grouped):
    """With the kernels' masks, the reference reproduces the fused forward and every gradient.

    A backward that drew different masks than its forward (in any layer group) would fail this.
    """
    import mhmla_fast.kernels.layer_attention as kernels
    from mhmla_fast.kernels.layer_attention import (layer_attention_dropout_masks,
                                                    layer_attention_triton)

    L, N, H, K, J = 3, 70, 48, 40, 4
    if grouped:
        monkeypatch.setattr(kernels, "BWD_GROUP_ELEMENTS", N * (H + K) * 2)
        assert len(kernels._bwd_layer_groups(L, N, H, K)) == 2
    rates = (0.3, 0.2, 0.4)
    ts = leaves(make_inputs(L, N, H, K, J, device=DEVICE))
    grad_c = torch.randn(N, H, device=DEVICE)
    grad_p = torch.randn(L, N, J, device=DEVICE)
    c, p = layer_attention_triton(*ts, J, dropout=rates, seed=1234)
    fused = torch.autograd.grad((c * grad_c).sum() + (p * grad_p).sum(), ts)
    masks = layer_attention_dropout_masks((L, N, H), (L, N, K), (L, N, J), rates, 1234, DEVICE)
    ts2 = leaves(ts)
    c2, p2 = layer_attention_reference(*ts2, J, dropout_h=rates[0], dropout_k=rates[1],
                                       dropout_p=rates[2], training=True, masks=masks)
    ref = torch.autograd.grad((c2 * grad_c).sum() + (p2 * grad_p).sum(), ts2)
    torch.testing.assert_close(c, c2, rtol=1e-5, atol=1e-5)
    for name, a, b in zip(NAMES, fused, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    # and the masks really drop something in each stream
    assert all(0 < m.float().mean() < 1 for m in masks)


@needs_triton
@pytest.mark.parametrize("rate", [0.1, 0.3, 0.5])
def test_triton_dropout_rate(rate):
    from mhmla_fast.kernels.layer_attention import layer_attention_dropout_masks

    shape = (4, 128, 96)
    keep = layer_attention_dropout_masks(shape, shape, shape, (rate,) * 3, 99, DEVICE)
    n = keep[0].numel()
    for m in keep:
        kept = m.double().mean().item()
        assert abs(kept - (1 - rate)) < 4 * ((rate * (1 - rate) / n) ** 0.5) + 1e-3
    # the three streams are different masks
    assert not torch.equal(keep[0], keep[1]) and not torch.equal(keep[1], keep[2])


@needs_triton
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_dropout_train_vs_eval(backend):
    L, N, H, K, J = 3, 40, 24, 16, 4
    ts = make_inputs(L, N, H, K, J, device=DEVICE)
    kw = dict(dropout_h=0.3, dropout_k=0.3, dropout_p=0.3, backend=backend)
    ev1 = layer_attention(*ts, J, training=False, **kw)
    ev2 = layer_attention(*ts, J, training=False, **kw)
    plain = layer_attention(*ts, J, backend=backend)
    assert torch.equal(ev1, ev2) and torch.equal(ev1, plain)
    torch.manual_seed(0)
    tr1 = layer_attention(*ts, J, training=True, **kw)
    tr2 = layer_attention(*ts, J, training=True, **kw)
    torch.manual_seed(0)
    tr3 = layer_attention(*ts, J, training=True, **kw)
    assert not torch.allclose(tr1, tr2) and not torch.allclose(tr1, ev1)
    assert torch.equal(tr1, tr3), "torch.manual_seed must fix the dropout masks"


# --------------------------------------------------------------------- torch.compile


@needs_triton
def test_compiles_without_graph_breaks():
    L, N, H, K, J = 2, 20, 24, 16, 4
    ts = leaves(make_inputs(L, N, H, K, J, device=DEVICE))

    def step(*a):
        c = layer_attention(*a, J, backend="triton", training=True, dropout_p=0.2)
        return (c * c).sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    loss = compiled(*ts)
    grads = torch.autograd.grad(loss, ts)
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads)
    assert grads[0].shape == (L, N, H)


@needs_triton
@pytest.mark.parametrize("kernel", ["fwd_values", "fwd_scores"])
@pytest.mark.parametrize("L,N,H,K,J", [(1, 37, 120, 72, 3), (13, 37, 120, 96, 1), (6, 70, 384, 64, 12)])
def test_the_flat_loops_give_the_nested_loops_bits(monkeypatch, kernel, L, N, H, K, J):
    """fwd_values and fwd_scores with FLAT (one loop over all layer (key block) x H-block
    steps, the weighting (scores) at each layer's (block's) last step) against the nested
    loops: the same sums in the same order, with dropout on k and p, so bit-identical under
    the interpreter."""
    import mhmla_fast.kernels.layer_attention as kernels

    ts = make_inputs(L, N, H, K, J, device=DEVICE, seed=L + H)
    tiles, warps, stages = kernels._FIXED[kernel]
    if kernel == "fwd_scores":  # two key blocks where K allows, the last one partial
        tiles = {**tiles, "BLOCK_K": 32 if K <= 96 else 64}
    out = {}
    for flat in (False, True):
        monkeypatch.setitem(kernels._FIXED, kernel, ({**tiles, "FLAT": flat}, warps, stages))
        out[flat] = kernels.layer_attention_fwd(*ts, J, (0.0, 0.2, 0.3), 17)
    assert torch.equal(out[True][0], out[False][0]) and torch.equal(out[True][1], out[False][1])


_ON_GPU = pytest.mark.skipif(not torch.cuda.is_available(),
                             reason="bf16 and full head shapes: on a GPU (interpreter: bf16 "
                                    "unreliable, large shapes slow)")
ROWSCALE_GRID = [
    # L, N, H, K, J, BLOCK_O, BLOCK_I, dtype
    *[(*shape, dt) for dt in (torch.float32, torch.float16) for shape in (
        (3, 70, 128, 64, 4, 32, 64),  # D = 32: four one-head column tiles, two H steps a layer
        (2, 37, 128, 48, 2, 64, 128),  # D = 64: one H step per layer
        (4, 33, 128, 40, 2, 32, 64))],  # D = 64, two tiles per head
    pytest.param(3, 70, 128, 64, 4, 32, 64, torch.bfloat16, marks=_ON_GPU),
    pytest.param(6, 333, 384, 384, 12, 32, 128, torch.bfloat16, marks=_ON_GPU),  # MiniLM
    pytest.param(12, 517, 768, 768, 12, 64, 64, torch.bfloat16, marks=_ON_GPU),  # BERT-base
]


@needs_triton
@pytest.mark.parametrize("L,N,H,K,J,block_o,block_i,dtype", ROWSCALE_GRID)
def test_rowscale_values_match_the_layer_by_layer_weighting(monkeypatch, dtype, L, N, H, K, J,
                                                            block_o, block_i):
    """fwd_values with ROWSCALE (the tile inside one head, whose weights p~^{l,j} scale h's
    rows: one GEMM over L x H) against the layer-by-layer weighting of the default config, with
    dropout on k and p: fp32 equal to rounding; in fp16 (the weighted h tile rounded to fp16)
    no further from a float64 computation than eager is (bf16 likewise, on a GPU)."""
    import mhmla_fast.kernels.layer_attention as kernels

    skip_where_fused_refuses(dtype, H, K)
    ts = make_inputs(L, N, H, K, J, dtype=dtype, device=DEVICE, seed=L + N)
    tiles, warps, stages = kernels._FIXED["fwd_values"]
    rowscale = {**tiles, "BLOCK_O": block_o, "BLOCK_I": block_i, "FLAT": True, "ROWSCALE": True}
    out = {}
    for name, t in (("layers", tiles), ("rowscale", rowscale)):
        monkeypatch.setitem(kernels._FIXED, "fwd_values", (t, warps, stages))
        out[name] = kernels.layer_attention_fwd(*ts, J, (0.0, 0.2, 0.3), 23)
    assert torch.equal(out["rowscale"][1], out["layers"][1])  # p: the same scores kernel
    if dtype == torch.float32:
        torch.testing.assert_close(out["rowscale"][0], out["layers"][0], rtol=1e-5, atol=1e-5)
    else:
        oracle, _ = kernels._reference_replaying_masks([t.double() for t in ts], J,
                                                       (0.0, 0.2, 0.3), 23)
        eager, _ = kernels._reference_replaying_masks(ts, J, (0.0, 0.2, 0.3), 23)
        assert_close_to_oracle("c", out["rowscale"][0], eager, oracle, 2.0, 1e-5)


@needs_triton
@pytest.mark.parametrize("L,N,H,K,J,dropout,dtype", [
    *[(*shape, dt) for dt in (torch.float32, torch.float16) for shape in (
        (3, 70, 128, 64, 4, (0.0, 0.0, 0.0)),  # D = 32
        (2, 130, 128, 48, 2, (0.1, 0.2, 0.3)),  # D = 64, dropout everywhere
        (3, 33, 64, 40, 2, (0.0, 0.0, 0.3)))],  # D = 32, dropout on p
    pytest.param(12, 517, 768, 768, 12, (0.1, 0.1, 0.1), torch.bfloat16, marks=_ON_GPU),
])
def test_rowscale_backward_matches_the_one_hot_epilogue(monkeypatch, L, N, H, K, J, dropout,
                                                        dtype):
    """bwd_values with ROWSCALE (the tile one head whole: dp a row sum, dv = p~ dc row-scaled)
    against the one-hot head maps of the default config: all seven gradients, equal to fp32
    rounding; in fp16 within the same rounding as the default (fp32 sums of the same
    products)."""
    import mhmla_fast.kernels.layer_attention as kernels

    skip_where_fused_refuses(dtype, H, K)
    ts = make_inputs(L, N, H, K, J, dtype=dtype, device=DEVICE, seed=L * N)
    _, p = kernels.layer_attention_fwd(*ts, J, dropout, 9)
    dc = torch.randn(N, H, generator=torch.Generator().manual_seed(3)).to(dtype).to(DEVICE)
    tiles, warps, stages = kernels._FIXED["bwd_values"]
    grads = {}
    for rowscale in (False, True):
        t = {**tiles, "BLOCK_N": 128, "BLOCK_O": H // J, "ROWSCALE": True} if rowscale else tiles
        monkeypatch.setitem(kernels._FIXED, "bwd_values", (t, warps, stages))
        grads[rowscale] = kernels.layer_attention_bwd(dc, None, *ts, p, J, dropout, 9)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}[dtype]
    for name, a, b in zip(("dh", *NAMES[1:]), grads[True], grads[False]):
        scale = b.float().abs().max().item()
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * scale, msg=name)


def test_rowscale_configs_keep_to_one_head_per_tile():
    """The keep rule admits ROWSCALE only where BLOCK_O divides D (the tile's columns in one
    head), as wide as the head up to 64, and where the accumulator and the weighted h tile fit
    (BERT-base: D = 64; MiniLM: D = 32)."""
    import mhmla_fast.kernels.layer_attention as kernels

    def kept(name, H, J):  # what layer_attention_configs gives on a GPU
        return [(t, w) for t, w, s in kernels._candidates(name) if t["ROWSCALE"]
                and kernels._keep(name, {**kernels._shape_constexprs(H, J), **t,
                                         "DROP_K": False, "HEAD_DIM": H // J}, w, s)]

    def rowscale_tiles(H, J):
        return {(t["BLOCK_N"], t["BLOCK_O"], t["BLOCK_I"], w) for t, w in kept("fwd_values", H, J)}

    bert, minilm, odd = rowscale_tiles(768, 12), rowscale_tiles(384, 12), rowscale_tiles(120, 3)
    assert {o for _, o, _, _ in bert} == {64} and {o for _, o, _, _ in minilm} == {32}
    assert not odd  # D = 40: no power-of-two column tile within a head
    assert (256, 64, 64, 8) in bert and (256, 32, 128, 8) in minilm

    def backward_tiles(H, J):
        return {(t["BLOCK_N"], t["BLOCK_O"], w) for t, w in kept("bwd_values", H, J)}

    assert {o for _, o, _ in backward_tiles(768, 12)} == {64}  # exactly one head per tile
    assert {o for _, o, _ in backward_tiles(384, 12)} == {32} and not backward_tiles(120, 3)
    assert (256, 64, 8) in backward_tiles(768, 12)

    def keeps(name, n, o, i, warps, stages=3, head_dim=64):
        tiles = dict(BLOCK_N=n, BLOCK_O=o, BLOCK_I=i, FLAT=True, ROWSCALE=True,
                     HEAD_DIM=head_dim, BLOCK_J=16, DROP_K=False)
        return kernels._keep(name, tiles, warps, stages)

    # the next larger tiles spilled in the sm_90 compile report (bytes, dropout on)
    assert not keeps("fwd_values", 256, 64, 64, 4)  # 16-32
    assert not keeps("fwd_values", 256, 32, 128, 4, head_dim=32)  # 88-152
    assert not keeps("bwd_values", 256, 64, 64, 4)  # 40-80
    assert not keeps("bwd_values", 64, 32, 64, 4)  # a tile of half a head: dp would be partial
    assert not keeps("fwd_values", 256, 64, 128, 8, stages=4)  # 320 KB of shared memory


def test_config_choice_restricts_the_value_kernels_to_one_form(monkeypatch):
    """MHMLA_TRITON_CONFIGS=rowscale / no-rowscale (an A/B of the value kernels' forms on a
    GPU) keeps only those forms of fwd_values and bwd_values, leaves the other kernels alone,
    and refuses a shape without ROWSCALE forms or an unknown value."""
    import mhmla_fast.kernels.layer_attention as kernels

    monkeypatch.setattr(kernels, "_interpreting", lambda: False)  # the GPU's lists
    every = {n: kernels.layer_attention_configs(n) for n in kernels._KERNELS}
    for choice, flag in (("rowscale", True), ("no-rowscale", False)):
        monkeypatch.setenv("MHMLA_TRITON_CONFIGS", choice)
        for name, configs in every.items():
            got = kernels.layer_attention_configs(name)
            if name in ("fwd_values", "bwd_values"):
                assert got and got == [c for c in configs if c[0]["ROWSCALE"] == flag]
            else:
                assert got == configs
    monkeypatch.setenv("MHMLA_TRITON_CONFIGS", "rowscale")
    with pytest.raises(ValueError, match="no such config at H = 120, J = 3"):
        kernels.layer_attention_configs("fwd_values", 120, 3)
    monkeypatch.setenv("MHMLA_TRITON_CONFIGS", "fast")
    with pytest.raises(ValueError, match="MHMLA_TRITON_CONFIGS"):
        kernels.layer_attention_configs("fwd_values")


def _fake_tuning(monkeypatch, kernel, autotuner) -> None:
    """fwd_scores launched as on a GPU (no interpreter, autotuned configs) through fakes of
    Triton's kernel and autotuner, with no picks yet."""
    import mhmla_fast.kernels.layer_attention as kernels

    monkeypatch.setattr(kernels, "_interpreting", lambda: False)
    monkeypatch.delenv("MHMLA_TRITON_CONFIGS", raising=False)
    monkeypatch.setitem(kernels._KERNELS, "fwd_scores", kernel)
    monkeypatch.setattr(kernels, "_tuned", lambda name: autotuner)
    monkeypatch.setattr(kernels, "_PICKS", {})
    kernels._key_positions.cache_clear()


def test_autotuned_launches_reuse_the_pick_of_their_key(monkeypatch):
    """On a GPU the autotuner takes the first launch of each key (its key arguments, the
    tensors' dtypes, and the config choice); later launches of that key go to the kernel
    itself with the autotuner's pick, and a new key goes back to the autotuner. Fakes stand in
    for Triton's autotuner and kernel, so this runs on any CPU."""
    import triton

    import mhmla_fast.kernels.layer_attention as kernels

    calls = []

    class FakeKernel:  # the @triton.jit kernel: kernel[grid](*args, **kwargs)
        arg_names = kernels._KERNELS["fwd_scores"].arg_names

        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append(("kernel", grid, args, kwargs))

    class FakeAutotuner:
        best_config = None

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                calls.append(("autotuner", grid, args, kwargs))
                FakeAutotuner.best_config = triton.Config(
                    {"BLOCK_N": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3)
            return run

    _fake_tuning(monkeypatch, FakeKernel(), FakeAutotuner())
    h16, h32, out = torch.zeros(2, dtype=torch.float16), torch.zeros(2), torch.zeros(2)

    def grid(meta):
        return (meta["BLOCK_N"],)

    def launch(hidden, H=768, n_bucket=4096):
        # the positional arguments of fwd_scores up to H, K, J (the key's H, K, J among them)
        args = (hidden, hidden, hidden, hidden, hidden, out, 4096, H, 768, 12, 0, 0.0, 1.0)
        kernels._launch("fwd_scores", grid, *args, DROP_K=False, N_BUCKET=n_bucket)

    launch(h16)
    launch(h16)
    assert [c[0] for c in calls] == ["autotuner", "kernel"]
    assert calls[0][1] is grid and calls[1][1] == (128,) and calls[1][2] == calls[0][2]
    assert calls[1][3] == {"DROP_K": False, "N_BUCKET": 4096, "BLOCK_N": 128, "BLOCK_K": 64,
                           "num_warps": 8, "num_ctas": 1, "num_stages": 3}
    for new_key in (lambda: launch(h32), lambda: launch(h16, H=384),
                    lambda: launch(h16, n_bucket=8192)):
        calls.clear()
        new_key()
        new_key()
        assert [c[0] for c in calls] == ["autotuner", "kernel"]
    calls.clear()
    monkeypatch.setenv("MHMLA_TRITON_CONFIGS", "rowscale")  # prunes differently: a new key
    launch(h16)
    monkeypatch.setenv("MHMLA_TRITON_CONFIGS", "fixed")  # the fixed config, no autotuner
    launch(h16)
    assert [c[0] for c in calls] == ["autotuner", "kernel"]
    tiles, warps, stages = kernels._FIXED["fwd_scores"]
    assert calls[1][1] == grid(tiles)
    assert calls[1][3] == {"DROP_K": False, "N_BUCKET": 4096, **tiles, "num_warps": warps,
                           "num_stages": stages}
    kernels._key_positions.cache_clear()


def test_two_threads_tuning_two_keys_at_once_keep_their_own_picks(monkeypatch):
    """The autotuner keeps one ``best_config`` per kernel, not per key: two threads tuning two
    keys of one kernel at once must each store the pick of their own key (a fake autotuner
    that picks by H and yields the CPU mid-tuning, so the two interleave without the lock)."""
    import threading
    import time

    import triton

    import mhmla_fast.kernels.layer_attention as kernels

    class FakeKernel:
        arg_names = kernels._KERNELS["fwd_scores"].arg_names

        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    class FakeAutotuner:
        best_config = None

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                FakeAutotuner.best_config = triton.Config({"BLOCK_N": args[7] // 6},
                                                          num_warps=4, num_stages=2)
                time.sleep(0.2)  # the other thread's tuning runs meanwhile, if it may
            return run

    _fake_tuning(monkeypatch, FakeKernel(), FakeAutotuner())
    hidden, out = torch.zeros(2, dtype=torch.float16), torch.zeros(2)

    def launch(H):
        args = (hidden, hidden, hidden, hidden, hidden, out, 4096, H, 768, 12, 0, 0.0, 1.0)
        kernels._launch("fwd_scores", lambda meta: (1,), *args, DROP_K=False, N_BUCKET=4096)

    threads = [threading.Thread(target=launch, args=(H,)) for H in (384, 768)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    h_at = [k for k, _ in kernels._key_positions("fwd_scores")].index("H")  # in a key's values
    picks = {key[2][h_at]: cfg["BLOCK_N"] for key, cfg in kernels._PICKS.items()}
    assert picks == {384: 64, 768: 128}
    kernels._key_positions.cache_clear()


@needs_triton
def test_direct_calls_and_the_custom_ops_give_the_same_bits(monkeypatch):
    """Outside torch.compile the autograd Function calls the launchers directly; through the
    registered custom ops (what tracing uses) output and gradients are bit-identical, with
    dropout."""
    import mhmla_fast.kernels.layer_attention as kernels

    L, N, H, K, J = 3, 21, 24, 16, 4
    base = make_inputs(L, N, H, K, J, device=DEVICE, seed=4)
    grad_c = torch.randn(N, H, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    out = {}
    for direct in (True, False):
        monkeypatch.setattr(kernels, "_direct", lambda t, direct=direct: direct)
        ts = leaves(base)
        c, p = kernels.layer_attention_triton(*ts, J, dropout=(0.2, 0.2, 0.2), seed=11)
        out[direct] = [c, p, *torch.autograd.grad((c * grad_c).sum() + p.sum(), ts)]
    for a, b in zip(out[True], out[False]):
        assert torch.equal(a, b)


@needs_triton
def test_inference_skips_the_autograd_function_with_the_same_bits(monkeypatch):
    """Without a gradient to compute (no_grad, or no input requiring one) and without dropout,
    the fused forward runs its launchers without the autograd Function: the same bits as
    through it."""
    import mhmla_fast.kernels.layer_attention as kernels

    L, N, H, K, J = 3, 21, 24, 16, 4
    ts = leaves(make_inputs(L, N, H, K, J, device=DEVICE, seed=4))
    c_grad, p_grad = kernels.layer_attention_triton(*ts, J)
    assert c_grad.requires_grad
    applied = []
    apply = kernels.LayerAttentionFunction.apply
    monkeypatch.setattr(kernels.LayerAttentionFunction, "apply",
                        lambda *a: applied.append(1) or apply(*a))
    with torch.no_grad():
        c, p = kernels.layer_attention_triton(*ts, J)
    c2, p2 = kernels.layer_attention_triton(*(t.detach() for t in ts), J)
    assert not applied and not c.requires_grad
    for a in (c, c2):
        assert torch.equal(a, c_grad.detach())
    for a in (p, p2):
        assert torch.equal(a, p_grad.detach())
    with torch.no_grad():  # dropout still goes through the Function (its seed and masks)
        kernels.layer_attention_triton(*ts, J, dropout=(0.1, 0.0, 0.0), seed=3)
    assert applied


@needs_triton
def test_the_kernels_read_the_dropout_seed_from_its_tensor_when_they_run(monkeypatch):
    """The seed is an int64 scalar tensor the kernels read at launch, never read on the host
    (a CUDA graph's replays then take its current value, not the one at capture): a forward +
    backward with dropout, seed drawn or given, makes no ``Tensor.item`` call; writing another
    value into the seed tensor gives that seed's results."""
    import mhmla_fast.kernels.layer_attention as kernels

    L, N, H, K, J = 3, 21, 24, 16, 4
    ts = leaves(make_inputs(L, N, H, K, J, device=DEVICE, seed=4))
    dropout = (0.2, 0.2, 0.2)

    def refuse(self):
        raise AssertionError("the seed was read on the host")

    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "item", refuse)
        for seed in (None, 5):
            c, p = kernels.layer_attention_triton(*ts, J, dropout=dropout, seed=seed)
            torch.autograd.grad((c.sum(), p.sum()), ts)
    plain = [t.detach() for t in ts]
    seed = torch.tensor(5, device=DEVICE)
    first = kernels.layer_attention_fwd(*plain, J, dropout, seed)
    seed.fill_(6)
    second = kernels.layer_attention_fwd(*plain, J, dropout, seed)
    for a, b, c in zip(first, second, kernels.layer_attention_fwd(*plain, J, dropout, 6)):
        assert not torch.equal(a, b) and torch.equal(b, c)
    with pytest.raises(ValueError, match="int64 scalar"):
        kernels.layer_attention_fwd(*plain, J, dropout, torch.tensor([5]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graph_replays_draw_new_dropout_masks():
    """A fused forward + backward with dropout captured in a CUDA graph: each replay draws a
    new seed on the device, so its outputs differ from the previous replay's, and one replay
    equals an uncaptured call with the seed it drew."""
    import mhmla_fast.kernels.layer_attention as kernels

    L, N, H, K, J = 3, 64, 64, 48, 4
    ts = leaves(make_inputs(L, N, H, K, J, dtype=torch.float16, device="cuda", seed=4))
    dropout = (0.2, 0.2, 0.2)
    seeds = []

    def step():
        seed = torch.randint(0, 2**31 - 3, (), dtype=torch.int64, device="cuda")
        seeds.append(seed)
        c, p = kernels.LayerAttentionFunction.apply(*ts, J, *dropout, seed, ("triton", "triton"))
        return (c, *torch.autograd.grad(c.float().sum(), ts))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    graph.replay()
    first = [t.clone() for t in outs]
    graph.replay()
    second = [t.clone() for t in outs]
    torch.cuda.synchronize()
    assert not torch.equal(first[0], second[0])
    seed = seeds[-1].clone()  # the graph's seed tensor holds the last replay's draw
    c, p = kernels.LayerAttentionFunction.apply(*ts, J, *dropout, seed, ("triton", "triton"))
    again = (c, *torch.autograd.grad(c.float().sum(), ts))
    for a, b in zip(second, again):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------- bad input


def test_bad_input_raises_value_error_naming_the_argument():
    L, N, H, K, J = 2, 5, 12, 8, 3
    ts = make_inputs(L, N, H, K, J)

    def call(*a, **kw):
        return layer_attention(*a, **{"backend": "torch", **kw})

    def expect(match, *a, **kw):
        with pytest.raises(ValueError, match=match):
            call(*a, **kw)

    expect(r"w_v: expected shape \[L, H, H\]", ts[0], ts[1][:, :, :5], *ts[2:], J)
    expect(r"b_k: expected shape \[L, K\] = \[2, 8\]", *ts[:4], ts[4][:, :3], *ts[5:], J)
    expect(r"w_a: expected shape", *ts[:5], ts[5][:1], ts[6], J)
    expect(r"hidden: expected a tensor \[L, \*, H\]", ts[0][0, 0], *ts[1:], J)
    expect(r"num_heads: H = 12 .* not divisible by J = 5", *ts[:5], ts[5][..., :1].expand(L, K, 5),
           ts[6][:, :1].expand(L, 5), 5)
    expect(r"num_heads: expected a positive int", *ts, 0)
    expect(r"w_k: dtype torch.float64 differs", *ts[:3], ts[3].double(), *ts[4:], J)
    expect(r"hidden: empty input", ts[0][:, :0], *ts[1:], J)
    expect(r"hidden: empty sequence", [], *ts[1:], J)
    expect(r"hidden\[1\]: every layer must have the same shape", [ts[0][0], ts[0][1, :3]],
           *ts[1:], J)
    expect(r"dropout_p: expected a rate in \[0, 1\)", *ts, J, dropout_p=1.0, training=True)
    expect(r"backend: expected one of", *ts, J, backend="cuda")
    expect(r"w_k: block-diagonal scoring needs K = 8 divisible by J = 3", *ts, J,
           block_diagonal=True)
    if torch.cuda.is_available():
        expect(r"w_v: device cuda", ts[0], ts[1].cuda(), *ts[2:], J)
    else:
        meta = [t.to("meta") for t in ts]
        expect(r"w_v: device meta:?0? differs", ts[0], meta[1], *ts[2:], J)
    for flag in ("training", "return_weights", "block_diagonal"):  # "no" would be true
        expect(rf"{flag}: expected a bool, got 'no'", *ts, J, **{flag: "no"})
    # meta tensors (shape passes): autocast, which knows no meta device, is not in the way
    for backend in ("torch", "auto"):
        c = layer_attention(*[t.to("meta") for t in ts], J, backend=backend)
        assert c.device.type == "meta" and c.shape == (N, H)


@needs_triton
def test_the_cached_zero_seed_outlives_inference_mode_and_fake_tensor_mode():
    """The zero seed of calls without dropout is made once and cached: a first call under
    ``torch.inference_mode`` (a validation pass) or ``FakeTensorMode`` (a shape estimate) must
    not cache an inference or fake tensor that a later training call then saves or reads."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mhmla_fast.kernels import layer_attention as kernels

    L, N, H, K, J = 2, 5, 16, 16, 2
    ts = make_inputs(L, N, H, K, J, device=DEVICE)
    for first in (torch.inference_mode, lambda: FakeTensorMode(allow_non_fake_inputs=True)):
        kernels._constant_seed.cache_clear()
        with first():
            layer_attention(*ts, J, backend="triton")
        args = leaves(ts)
        layer_attention(*args, J, backend="triton").sum().backward()
        want = leaves(ts)
        layer_attention(*want, J, backend="torch").sum().backward()
        for name, a, b in zip(NAMES, args, want):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)


@needs_triton
def test_the_fused_path_runs_in_autocasts_dtype_as_eager_does():
    """Under autocast, float32 hidden states (an encoder's, whose LayerNorms run in float32)
    and weights run the fused kernels in autocast's dtype, as eager's matmuls do: c in that
    dtype on both backends, near each other, gradients back in float32; bf16 on the
    interpreter (whose bf16 dot products are wrong) is refused, not computed."""
    L, N, H, K, J = 3, 9, 32, 16, 4
    base = make_inputs(L, N, H, K, J, device=DEVICE)
    half = torch.float16 if DEVICE == "cpu" else torch.bfloat16
    out = {}
    for backend in ("torch", "triton"):
        ts = leaves(base)
        with torch.autocast(DEVICE, dtype=half):
            c = layer_attention(*ts, J, backend=backend)
        c.float().square().sum().backward()
        out[backend] = (c, [t.grad for t in ts])
    (c_t, g_t), (c_f, g_f) = out["torch"], out["triton"]
    assert c_t.dtype == c_f.dtype == half
    torch.testing.assert_close(c_f, c_t, rtol=2e-2, atol=2e-2)
    for name, a, b in zip(NAMES, g_f, g_t):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-2, msg=name)
    if DEVICE == "cpu":
        with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(
                ValueError, match="cannot take bf16"):
            layer_attention(*base, J, backend="triton")


@needs_triton
def test_a_second_order_gradient_through_the_fused_backward_raises():
    """backend="triton": a backward with create_graph=True raises, whatever the loss (a
    constant incoming gradient, as of c.sum(), gave gradients without history before, so a
    gradient penalty's second-order term was silently dropped)."""
    L, N, H, K, J = 2, 3, 8, 8, 2
    for loss_of in (torch.sum, lambda c: c.square().sum()):
        ts = leaves(make_inputs(L, N, H, K, J, device=DEVICE))
        c = layer_attention(*ts, J, backend="triton")
        with pytest.raises(RuntimeError, match="differentiable once.*create_graph=True"):
            torch.autograd.grad(loss_of(c), ts[0], create_graph=True)
        (g,) = torch.autograd.grad(loss_of(c), ts[0])  # first order: as before
        assert g.grad_fn is None


@needs_triton
@pytest.mark.parametrize("kernels", [("triton", "triton"), ("triton", "torch"), ("torch", "triton")])
@pytest.mark.parametrize("rate", [0.0, 0.3])
def test_a_gradient_penalty_through_autos_kernels_equals_the_references(kernels, rate):
    """backend="auto" (second_order "torch"): with create_graph=True the backward is the eager
    reference's on the saved inputs and the fused kernels' masks, so a gradient penalty's
    gradients of all seven inputs equal eager's (on the same masks), for every mix of
    directions, with and without dropout, for losses of c and of p."""
    from mhmla_fast.kernels.layer_attention import layer_attention_dropout_masks, layer_attention_triton

    L, N, H, K, J, seed = 2, 5, 16, 8, 2, 11
    dropout = (rate, rate, rate)
    masks = None
    if rate:
        masks = layer_attention_dropout_masks((L, N, H), (L, N, K), (L, N, J), dropout, seed,
                                              DEVICE)
    grads = {}
    for path in ("fused", "reference"):
        ts = leaves(make_inputs(L, N, H, K, J, device=DEVICE))
        if path == "fused":
            c, p = layer_attention_triton(*ts, J, dropout=dropout, seed=seed, kernels=kernels,
                                          second_order="torch")
        else:
            c, p = layer_attention_reference(*ts, J, dropout_h=rate, dropout_k=rate,
                                             dropout_p=rate, training=bool(rate), masks=masks)
        first = torch.autograd.grad(c.sum() + (p * p).sum(), ts, create_graph=True)
        loss = c.square().sum() + sum(g.square().sum() for g in first)
        grads[path] = torch.autograd.grad(loss, ts)
    for name, a, b in zip(NAMES, grads["fused"], grads["reference"]):
        assert b.abs().sum() > 0, name
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


def test_a_loss_of_the_layer_weights_alone_leaves_w_v_and_b_v_without_a_gradient():
    """p does not depend on W_v or b_v: with c unused, eager leaves their .grad None, and so
    do the fused backward and the mixed directions (they returned zeros, on which Adam's
    momentum and AdamW's weight decay still act, so the backends trained differently); the
    other gradients agree."""
    L, N, H, K, J = 2, 5, 16, 8, 2
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(s, generator=g) * 0.3 for s in
          [(L, N, H), (L, H, H), (L, H), (L, H, K), (L, K), (L, K, J), (L, J)]]
    grads = {}
    for backend, kernels in (("torch", None), ("triton", None), ("triton", ("triton", "torch")),
                             ("triton", ("torch", "triton"))):
        x = [t.clone().to(DEVICE).requires_grad_() for t in ts]
        if kernels is None:
            _, p = layer_attention(*x, J, backend=backend, return_weights=True)
        else:
            from mhmla_fast.kernels.layer_attention import layer_attention_triton

            _, p = layer_attention_triton(*x, J, kernels=kernels)
        (p * p).sum().backward()
        assert x[1].grad is None and x[2].grad is None, (backend, kernels)
        grads[backend, kernels] = [x[i].grad for i in (0, 3, 4, 5, 6)]
    want = grads["torch", None]
    for key, got in grads.items():
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
