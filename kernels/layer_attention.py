"""Fused Triton kernels for multi-head multi-layer attention (MHMLA), forward and backward.

    v^l = h^l W_v^l + b_v^l,  k^l = relu(h^l W_k^l + b_k^l),  a^l = k^l W_a^l + b_a^l
    p^{l,j} = softmax_l(a^{l,j}),  c_j = sum_l p^{l,j} v^{l,j},  c = concat_j c_j

Shapes: L layers, N tokens (B x T flattened), H hidden, J heads, D = H / J, K key width.

Plan (see DESIGN.md section 3):

* forward, scores kernel (grid: token tiles x L): z = h W_k + b_k tiled over K, relu,
  key dropout, a = k W_a + b_a accumulated on chip; writes only the [L, N, J] scores.
* softmax over the L layers of the tiny [L, N, J] score tensor (torch).
* forward, values kernel (grid: token tiles x H column tiles): for every layer the
  value GEMM tile h^l W_v^l, scaled by that row's and column's head weight, accumulated
  on chip; one write of c. Neither the L x N x H values nor the L x N x K keys are
  ever written to memory.
* backward: one score-gradient kernel (recomputes v to get dp [L, N, J] and writes the
  pre-activation z [L, N, K] it recomputed), the softmax backward on [L, N, J] (torch),
  one input-gradient kernel (dh = dv W_v'
  + dz W_k' with dv and dz built on chip from p, dc, da, z) and one weight-gradient
  kernel per weight (reductions over N inside one program: deterministic, no atomics).

Dropout masks are never stored: each is regenerated with ``tl.rand(seed, offset)`` from
the element's flat offset in its [L, N, H], [L, N, K] or [L, N, J] tensor, identically in
forward and backward. Accumulation is fp32 (fp64 for fp64 inputs).

This module registers the torch custom ops ``mhmla_fast::layer_attention_fwd`` and
``mhmla_fast::layer_attention_bwd`` when imported; import it only when the Triton
backend is wanted (``mhmla_fast.layer_attention`` does so lazily).
"""

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = [
    "LayerAttentionFunction",
    "layer_attention_triton",
    "layer_attention_fwd",
    "layer_attention_bwd",
    "layer_attention_dropout_masks",
]


# ----------------------------------------------------------------------------- helpers


@triton.jit
def _dropout(x, seed, offsets, rate, scale, DROP: tl.constexpr):
    """x * keep / (1 - rate) with keep = rand(seed, offset) >= rate; identity if not DROP."""
    if DROP:
        keep = tl.rand(seed, offsets) >= rate
        x = tl.where(keep, x * scale, 0.0)
    return x


@triton.jit
def _load_hidden(
    H_ptr,  # [L, N, H] hidden states
    l, rows, i0, N, H, seed, rate, scale,
    DROP: tl.constexpr, BLOCK_I: tl.constexpr,
):
    """The [BLOCK_N, BLOCK_I] tile of h^l (with its dropout mask) in the input dtype."""
    ii = i0 + tl.arange(0, BLOCK_I)
    offs = (l * N + rows[:, None]) * H + ii[None, :]
    h = tl.load(H_ptr + offs, mask=(rows[:, None] < N) & (ii[None, :] < H), other=0.0)
    if DROP:
        h = _dropout(h.to(tl.float32), seed, offs, rate, scale, True).to(H_ptr.dtype.element_ty)
    return h


@triton.jit
def _load_head_weights(
    P_ptr,  # [L, N, J] layer weights p
    l, rows, cols, N, H, J, D, seed, rate, scale,
    DROP: tl.constexpr,
):
    """[BLOCK_N, BLOCK_C] tile of p~^{l, head(col)} (attention dropout applied) per column."""
    offs = (l * N + rows[:, None]) * J + cols[None, :] // D
    p = tl.load(P_ptr + offs, mask=(rows[:, None] < N) & (cols[None, :] < H), other=0.0)
    return _dropout(p, seed, offs, rate, scale, DROP)


@triton.jit
def _key_grad(
    da,  # [BLOCK_N, BLOCK_J] score gradients of layer l
    WA_ptr,  # [L, K, J] scorer weights
    Z_ptr,  # [L, N, K] key pre-activations (recomputed by the score-gradient kernel)
    l, rows, kk, N, K, J, seed, rate, scale,
    DROP: tl.constexpr, BLOCK_J: tl.constexpr, ACC: tl.constexpr,
):
    """dz = (da W_a') * keep_k / (1 - rate) * [z > 0], a [BLOCK_N, BLOCK_K] tile (ACC)."""
    jj = tl.arange(0, BLOCK_J)
    wa_t = tl.load(
        WA_ptr + (l * K + kk[None, :]) * J + jj[:, None],
        mask=(jj[:, None] < J) & (kk[None, :] < K), other=0.0,
    )  # [BLOCK_J, BLOCK_K] = W_a[kk, :]'
    dk = tl.dot(da, wa_t.to(ACC), input_precision="ieee", out_dtype=ACC)
    offs = (l * N + rows[:, None]) * K + kk[None, :]
    z = tl.load(Z_ptr + offs, mask=(rows[:, None] < N) & (kk[None, :] < K), other=0.0)
    dk = tl.where(z > 0, dk, 0.0)
    return _dropout(dk, seed, offs, rate, scale, DROP)


# ------------------------------------------------------------------ forward kernels


@triton.jit
def _layer_attention_fwd_scores_kernel(
    H_ptr,  # [L, N, H] hidden states
    WK_ptr,  # [L, H, K] key weights
    BK_ptr,  # [L, K] key biases
    WA_ptr,  # [L, K, J] scorer weights
    BA_ptr,  # [L, J] scorer biases
    S_ptr,  # [L, N, J] scores a (out, ACC)
    N, H, K, J,
    seed_h, rate_h, scale_h, seed_k, rate_k, scale_k,
    DROP_H: tl.constexpr, DROP_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_J: tl.constexpr,
    PREC: tl.constexpr, ACC: tl.constexpr,
):
    pid_n = tl.program_id(0)
    l = tl.program_id(1).to(tl.int64)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    jj = tl.arange(0, BLOCK_J)
    a = tl.zeros((BLOCK_N, BLOCK_J), ACC)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        z = tl.zeros((BLOCK_N, BLOCK_K), ACC)
        for i0 in range(0, H, BLOCK_I):
            h = _load_hidden(H_ptr, l, rows, i0, N, H, seed_h, rate_h, scale_h, DROP_H, BLOCK_I)
            ii = i0 + tl.arange(0, BLOCK_I)
            w = tl.load(
                WK_ptr + (l * H + ii[:, None]) * K + kk[None, :],
                mask=(ii[:, None] < H) & (kk[None, :] < K), other=0.0,
            )
            z = tl.dot(h, w, z, input_precision=PREC, out_dtype=ACC)
        z += tl.load(BK_ptr + l * K + kk, mask=kk < K, other=0.0).to(ACC)[None, :]
        k = tl.maximum(z, 0.0)
        k = _dropout(k, seed_k, (l * N + rows[:, None]) * K + kk[None, :], rate_k, scale_k, DROP_K)
        wa = tl.load(
            WA_ptr + (l * K + kk[:, None]) * J + jj[None, :],
            mask=(kk[:, None] < K) & (jj[None, :] < J), other=0.0,
        )
        a = tl.dot(k.to(WA_ptr.dtype.element_ty), wa, a, input_precision=PREC, out_dtype=ACC)
    a += tl.load(BA_ptr + l * J + jj, mask=jj < J, other=0.0).to(ACC)[None, :]
    tl.store(
        S_ptr + (l * N + rows[:, None]) * J + jj[None, :], a,
        mask=(rows[:, None] < N) & (jj[None, :] < J),
    )


@triton.jit
def _layer_attention_fwd_values_kernel(
    H_ptr,  # [L, N, H] hidden states
    WV_ptr,  # [L, H, H] value weights
    BV_ptr,  # [L, H] value biases
    P_ptr,  # [L, N, J] layer weights p (ACC)
    C_ptr,  # [N, H] output c
    L, N, H, J, D,
    seed_h, rate_h, scale_h, seed_p, rate_p, scale_p,
    DROP_H: tl.constexpr, DROP_P: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr,
    PREC: tl.constexpr, ACC: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_o = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    oo = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
    acc = tl.zeros((BLOCK_N, BLOCK_O), ACC)
    for layer in range(0, L):
        l = tl.cast(layer, tl.int64)
        v = tl.zeros((BLOCK_N, BLOCK_O), ACC)
        for i0 in range(0, H, BLOCK_I):
            h = _load_hidden(H_ptr, l, rows, i0, N, H, seed_h, rate_h, scale_h, DROP_H, BLOCK_I)
            ii = i0 + tl.arange(0, BLOCK_I)
            w = tl.load(
                WV_ptr + (l * H + ii[:, None]) * H + oo[None, :],
                mask=(ii[:, None] < H) & (oo[None, :] < H), other=0.0,
            )
            v = tl.dot(h, w, v, input_precision=PREC, out_dtype=ACC)
        v += tl.load(BV_ptr + l * H + oo, mask=oo < H, other=0.0).to(ACC)[None, :]
        pw = _load_head_weights(P_ptr, l, rows, oo, N, H, J, D, seed_p, rate_p, scale_p, DROP_P)
        acc += pw * v
    tl.store(
        C_ptr + rows[:, None] * H + oo[None, :], acc.to(C_ptr.dtype.element_ty),
        mask=(rows[:, None] < N) & (oo[None, :] < H),
    )


# ------------------------------------------------------------------ backward kernels
#
# Per token, with z^l = h^l W_k^l + b_k^l, p~ = p * keep_p / (1 - r_p) the weights the
# forward used, and dc_j the incoming gradient's slice for head j:
#
#   dv^{l,j} = p~^{l,j} dc_j                      dW_v^l = sum_n h^l' dv^l, db_v^l = sum_n dv^l
#   dp~^{l,j} = <dc_j, v^{l,j}>,  dp = dp~ keep_p / (1 - r_p)  (+ the gradient of p if returned)
#   delta_j = sum_l p^{l,j} dp^{l,j}  (from dp itself, not <dc_j, c_j>: exact where c was
#             rounded to a 16-bit dtype, e.g. da == 0 exactly for L = 1)
#   da^{l,j} = p^{l,j} (dp^{l,j} - delta_j)       dW_a^l = sum_n k^l' da^l,  db_a^l = sum_n da^l
#   dz^l = (da^l W_a^l') * keep_k / (1 - r_k) * [z^l > 0]
#                                                dW_k^l = sum_n h^l' dz^l, db_k^l = sum_n dz^l
#   dh^l = (dv^l W_v^l' + dz^l W_k^l') * keep_h / (1 - r_h)
#
# where h^l in the weight gradients is the dropped-out input the forward used.


@triton.jit
def _layer_attention_bwd_scores_kernel(
    H_ptr,  # [L, N, H] hidden states
    WV_ptr,  # [L, H, H] value weights
    BV_ptr,  # [L, H] value biases
    WK_ptr,  # [L, H, K] key weights
    BK_ptr,  # [L, K] key biases
    DC_ptr,  # [N, H] gradient of c
    DP_ptr,  # [L, N, J] gradient of the undropped layer weights p (out, ACC)
    Z_ptr,  # [L, N, K] recomputed key pre-activations (out, input dtype)
    N, H, K, J, D,
    seed_h, rate_h, scale_h, seed_p, rate_p, scale_p,
    DROP_H: tl.constexpr, DROP_P: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_J: tl.constexpr,
    PREC: tl.constexpr, ACC: tl.constexpr,
):
    pid_n = tl.program_id(0)
    l = tl.program_id(1).to(tl.int64)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    jj = tl.arange(0, BLOCK_J)
    # dp~[n, j] = sum over head j's columns of dc * v, v recomputed tile by tile
    dp = tl.zeros((BLOCK_N, BLOCK_J), ACC)
    for o0 in range(0, H, BLOCK_O):
        oo = o0 + tl.arange(0, BLOCK_O)
        v = tl.zeros((BLOCK_N, BLOCK_O), ACC)
        for i0 in range(0, H, BLOCK_I):
            h = _load_hidden(H_ptr, l, rows, i0, N, H, seed_h, rate_h, scale_h, DROP_H, BLOCK_I)
            ii = i0 + tl.arange(0, BLOCK_I)
            w = tl.load(
                WV_ptr + (l * H + ii[:, None]) * H + oo[None, :],
                mask=(ii[:, None] < H) & (oo[None, :] < H), other=0.0,
            )
            v = tl.dot(h, w, v, input_precision=PREC, out_dtype=ACC)
        v += tl.load(BV_ptr + l * H + oo, mask=oo < H, other=0.0).to(ACC)[None, :]
        dc = tl.load(
            DC_ptr + rows[:, None] * H + oo[None, :],
            mask=(rows[:, None] < N) & (oo[None, :] < H), other=0.0,
        ).to(ACC)
        head_of = ((oo[:, None] // D) == jj[None, :]) & (oo[:, None] < H)  # [BLOCK_O, BLOCK_J]
        dp = tl.dot(v * dc, head_of.to(ACC), dp, input_precision="ieee", out_dtype=ACC)
    offs_p = (l * N + rows[:, None]) * J + jj[None, :]
    mask_p = (rows[:, None] < N) & (jj[None, :] < J)
    dp = _dropout(dp, seed_p, offs_p, rate_p, scale_p, DROP_P)
    tl.store(DP_ptr + offs_p, dp, mask=mask_p)
    # z = h W_k + b_k, stored for the input- and weight-gradient kernels
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        z = tl.zeros((BLOCK_N, BLOCK_K), ACC)
        for i0 in range(0, H, BLOCK_I):
            h = _load_hidden(H_ptr, l, rows, i0, N, H, seed_h, rate_h, scale_h, DROP_H, BLOCK_I)
            ii = i0 + tl.arange(0, BLOCK_I)
            w = tl.load(
                WK_ptr + (l * H + ii[:, None]) * K + kk[None, :],
                mask=(ii[:, None] < H) & (kk[None, :] < K), other=0.0,
            )
            z = tl.dot(h, w, z, input_precision=PREC, out_dtype=ACC)
        z += tl.load(BK_ptr + l * K + kk, mask=kk < K, other=0.0).to(ACC)[None, :]
        tl.store(
            Z_ptr + (l * N + rows[:, None]) * K + kk[None, :], z.to(Z_ptr.dtype.element_ty),
            mask=(rows[:, None] < N) & (kk[None, :] < K),
        )


@triton.jit
def _layer_attention_bwd_hidden_kernel(
    WV_ptr,  # [L, H, H] value weights
    WK_ptr,  # [L, H, K] key weights
    WA_ptr,  # [L, K, J] scorer weights
    P_ptr,  # [L, N, J] layer weights p (ACC)
    DC_ptr,  # [N, H] gradient of c
    DA_ptr,  # [L, N, J] score gradients (ACC)
    Z_ptr,  # [L, N, K] key pre-activations
    DH_ptr,  # [L, N, H] gradient of the hidden states (out)
    N, H, K, J, D,
    seed_h, rate_h, scale_h, seed_k, rate_k, scale_k, seed_p, rate_p, scale_p,
    DROP_H: tl.constexpr, DROP_K: tl.constexpr, DROP_P: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_O: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_J: tl.constexpr,
    PREC: tl.constexpr, ACC: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_i = tl.program_id(1)
    l = tl.program_id(2).to(tl.int64)
    dtype = DH_ptr.dtype.element_ty
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ii = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    jj = tl.arange(0, BLOCK_J)
    acc = tl.zeros((BLOCK_N, BLOCK_I), ACC)
    # dv W_v', dv = p~ dc built on chip
    for o0 in range(0, H, BLOCK_O):
        oo = o0 + tl.arange(0, BLOCK_O)
        pw = _load_head_weights(P_ptr, l, rows, oo, N, H, J, D, seed_p, rate_p, scale_p, DROP_P)
        dc = tl.load(
            DC_ptr + rows[:, None] * H + oo[None, :],
            mask=(rows[:, None] < N) & (oo[None, :] < H), other=0.0,
        ).to(ACC)
        w_t = tl.load(
            WV_ptr + (l * H + ii[None, :]) * H + oo[:, None],
            mask=(ii[None, :] < H) & (oo[:, None] < H), other=0.0,
        )  # [BLOCK_O, BLOCK_I] = W_v[ii, oo]'
        acc = tl.dot((pw * dc).to(dtype), w_t, acc, input_precision=PREC, out_dtype=ACC)
    # dz W_k', dz rebuilt from da, W_a and z
    da = tl.load(
        DA_ptr + (l * N + rows[:, None]) * J + jj[None, :],
        mask=(rows[:, None] < N) & (jj[None, :] < J), other=0.0,
    )
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        dz = _key_grad(da, WA_ptr, Z_ptr, l, rows, kk, N, K, J, seed_k, rate_k, scale_k,
                       DROP_K, BLOCK_J, ACC)
        w_t = tl.load(
            WK_ptr + (l * H + ii[None, :]) * K + kk[:, None],
            mask=(ii[None, :] < H) & (kk[:, None] < K), other=0.0,
        )  # [BLOCK_K, BLOCK_I] = W_k[ii, kk]'
        acc = tl.dot(dz.to(dtype), w_t, acc, input_precision=PREC, out_dtype=ACC)
    offs = (l * N + rows[:, None]) * H + ii[None, :]
    acc = _dropout(acc, seed_h, offs, rate_h, scale_h, DROP_H)
    tl.store(DH_ptr + offs, acc.to(dtype), mask=(rows[:, None] < N) & (ii[None, :] < H))


@triton.jit
def _layer_attention_bwd_weights_kernel(
    H_ptr,  # [L, N, H] hidden states
    WA_ptr,  # [L, K, J] scorer weights
    P_ptr,  # [L, N, J] layer weights p (ACC)
    DC_ptr,  # [N, H] gradient of c
    DA_ptr,  # [L, N, J] score gradients (ACC)
    Z_ptr,  # [L, N, K] key pre-activations
    DW_ptr,  # [L, I, O] weight gradient (out, ACC): dW_v, dW_k or dW_a by MODE
    DB_ptr,  # [L, O] bias gradient (out, ACC)
    N, H, K, J, D, I, O,
    seed_h, rate_h, scale_h, seed_k, rate_k, scale_k, seed_p, rate_p, scale_p,
    MODE: tl.constexpr,  # 0: value (I=H, O=H), 1: key (I=H, O=K), 2: scorer (I=K, O=J)
    DROP_H: tl.constexpr, DROP_K: tl.constexpr, DROP_P: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_J: tl.constexpr,
    PREC: tl.constexpr, ACC: tl.constexpr,
):
    pid_i = tl.program_id(0)
    pid_o = tl.program_id(1)
    l = tl.program_id(2).to(tl.int64)
    dtype = H_ptr.dtype.element_ty
    ii = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    oo = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
    jj = tl.arange(0, BLOCK_J)
    acc = tl.zeros((BLOCK_I, BLOCK_O), ACC)
    bias = tl.zeros((BLOCK_O,), ACC)
    for n0 in range(0, N, BLOCK_N):
        rows = n0 + tl.arange(0, BLOCK_N)
        row_ok = rows[:, None] < N
        if MODE == 2:
            offs = (l * N + rows[:, None]) * K + ii[None, :]
            z = tl.load(Z_ptr + offs, mask=row_ok & (ii[None, :] < K), other=0.0).to(ACC)
            a_op = _dropout(tl.maximum(z, 0.0), seed_k, offs, rate_k, scale_k, DROP_K)
            b_op = tl.load(
                DA_ptr + (l * N + rows[:, None]) * J + oo[None, :],
                mask=row_ok & (oo[None, :] < J), other=0.0,
            )
            acc = tl.dot(tl.trans(a_op), b_op, acc, input_precision="ieee", out_dtype=ACC)
        else:
            i0 = pid_i * BLOCK_I
            a_op = _load_hidden(H_ptr, l, rows, i0, N, H, seed_h, rate_h, scale_h, DROP_H, BLOCK_I)
            if MODE == 0:
                pw = _load_head_weights(P_ptr, l, rows, oo, N, H, J, D, seed_p, rate_p, scale_p,
                                        DROP_P)
                dc = tl.load(
                    DC_ptr + rows[:, None] * H + oo[None, :],
                    mask=row_ok & (oo[None, :] < H), other=0.0,
                ).to(ACC)
                b_op = pw * dc
            else:
                da = tl.load(
                    DA_ptr + (l * N + rows[:, None]) * J + jj[None, :],
                    mask=row_ok & (jj[None, :] < J), other=0.0,
                )
                b_op = _key_grad(da, WA_ptr, Z_ptr, l, rows, oo, N, K, J, seed_k, rate_k, scale_k,
                                 DROP_K, BLOCK_J, ACC)
            acc = tl.dot(tl.trans(a_op), b_op.to(dtype), acc, input_precision=PREC, out_dtype=ACC)
        bias += tl.sum(b_op, axis=0)
    tl.store(
        DW_ptr + (l * I + ii[:, None]) * O + oo[None, :], acc,
        mask=(ii[:, None] < I) & (oo[None, :] < O),
    )
    if pid_i == 0:
        tl.store(DB_ptr + l * O + oo, bias, mask=oo < O)


@triton.jit
def _layer_attention_dropout_masks_kernel(
    KEEP_ptr,  # [numel] int8 keep mask (out)
    numel, seed, rate,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = tl.rand(seed, offs) >= rate
    tl.store(KEEP_ptr + offs, keep.to(tl.int8), mask=offs < numel)


# ------------------------------------------------------------------------ launchers

_ACC = {torch.float64: tl.float64}
_SEED_STREAMS = 3  # h, k, p


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _blocks(H: int, K: int, J: int) -> dict:
    """Tile sizes: 64-wide feature tiles, heads padded to a power of two >= 16 for tl.dot."""
    return dict(
        BLOCK_N=64,
        BLOCK_I=64,
        BLOCK_O=64,
        BLOCK_K=64,
        BLOCK_J=max(16, triton.next_power_of_2(J)),
    )


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs are multiplied in full precision (no TF32), like torch's default matmul.
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"


def _rates(dropout: tuple[float, float, float], seed: int) -> dict:
    """Kernel arguments for the three dropout streams (seed, seed + 1, seed + 2)."""
    out = {}
    for i, (name, rate) in enumerate(zip("hkp", dropout)):
        out[f"seed_{name}"] = seed + i
        out[f"rate_{name}"] = float(rate)
        out[f"scale_{name}"] = 1.0 / (1.0 - rate) if rate > 0 else 1.0
    return out


def _check_launchable(t: Tensor) -> None:
    if t.device.type == "cpu":
        import os

        if os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise RuntimeError(
                "the triton backend runs on CPU tensors only under the Triton interpreter: "
                "set TRITON_INTERPRET=1 in the environment before importing mhmla_fast "
                "(or use backend='torch' on CPU)"
            )


def layer_attention_fwd(
    hidden: Tensor, w_v: Tensor, b_v: Tensor, w_k: Tensor, b_k: Tensor, w_a: Tensor,
    b_a: Tensor, num_heads: int, dropout: tuple[float, float, float], seed: int,
) -> tuple[Tensor, Tensor]:
    """Fused forward on validated, contiguous inputs.

    Args: hidden [L, N, H]; w_v [L, H, H]; b_v [L, H]; w_k [L, H, K]; b_k [L, K];
    w_a [L, K, J]; b_a [L, J]; ``dropout`` the (h, k, p) rates (0 in eval); ``seed`` the
    dropout seed. Returns c [N, H] (input dtype) and p [L, N, J] (fp32; fp64 for fp64).
    """
    _check_launchable(hidden)
    L, N, H = hidden.shape
    K, J = w_k.shape[2], num_heads
    acc = _acc_dtype(hidden.dtype)
    meta = _blocks(H, K, J)
    common = dict(PREC=_precision(hidden.dtype), ACC=_ACC.get(hidden.dtype, tl.float32))
    r = _rates(dropout, seed)
    drop_h, drop_k, drop_p = (rate > 0 for rate in dropout)
    scores = torch.empty((L, N, J), device=hidden.device, dtype=acc)
    grid = (triton.cdiv(N, meta["BLOCK_N"]), L)
    _layer_attention_fwd_scores_kernel[grid](
        hidden, w_k, b_k, w_a, b_a, scores, N, H, K, J,
        r["seed_h"], r["rate_h"], r["scale_h"], r["seed_k"], r["rate_k"], r["scale_k"],
        DROP_H=drop_h, DROP_K=drop_k, BLOCK_N=meta["BLOCK_N"], BLOCK_I=meta["BLOCK_I"],
        BLOCK_K=meta["BLOCK_K"], BLOCK_J=meta["BLOCK_J"], **common,
    )
    p = torch.softmax(scores, dim=0)
    c = torch.empty((N, H), device=hidden.device, dtype=hidden.dtype)
    grid = (triton.cdiv(N, meta["BLOCK_N"]), triton.cdiv(H, meta["BLOCK_O"]))
    _layer_attention_fwd_values_kernel[grid](
        hidden, w_v, b_v, p, c, L, N, H, J, H // J,
        r["seed_h"], r["rate_h"], r["scale_h"], r["seed_p"], r["rate_p"], r["scale_p"],
        DROP_H=drop_h, DROP_P=drop_p, BLOCK_N=meta["BLOCK_N"], BLOCK_O=meta["BLOCK_O"],
        BLOCK_I=meta["BLOCK_I"], **common,
    )
    return c, p


def layer_attention_bwd(
    dc: Tensor, dp: Optional[Tensor], hidden: Tensor, w_v: Tensor, b_v: Tensor, w_k: Tensor,
    b_k: Tensor, w_a: Tensor, b_a: Tensor, p: Tensor, num_heads: int,
    dropout: tuple[float, float, float], seed: int,
) -> tuple[Tensor, ...]:
    """Fused backward: (dh [L, N, H], dw_v, db_v, dw_k, db_k, dw_a, db_a).

    ``dc`` [N, H] is the gradient of c, ``dp`` [L, N, J] (or None) that of the returned
    layer weights; the other arguments are the forward's inputs and its weights p. Only one
    [L, N, K] buffer (the recomputed key pre-activations) and [L, N, J]-sized ones are
    allocated besides the gradients themselves.
    """
    _check_launchable(hidden)
    L, N, H = hidden.shape
    K, J = w_k.shape[2], num_heads
    D = H // J
    acc = _acc_dtype(hidden.dtype)
    meta = _blocks(H, K, J)
    common = dict(PREC=_precision(hidden.dtype), ACC=_ACC.get(hidden.dtype, tl.float32))
    r = _rates(dropout, seed)
    drop = dict(zip(("DROP_H", "DROP_K", "DROP_P"), (rate > 0 for rate in dropout)))
    seeds_hkp = (r["seed_h"], r["rate_h"], r["scale_h"], r["seed_k"], r["rate_k"], r["scale_k"],
                 r["seed_p"], r["rate_p"], r["scale_p"])
    dc = dc.contiguous()
    dp_c = torch.empty((L, N, J), device=hidden.device, dtype=acc)
    z = torch.empty((L, N, K), device=hidden.device, dtype=hidden.dtype)
    bn = meta["BLOCK_N"]
    _layer_attention_bwd_scores_kernel[(triton.cdiv(N, bn), L)](
        hidden, w_v, b_v, w_k, b_k, dc, dp_c, z, N, H, K, J, D,
        r["seed_h"], r["rate_h"], r["scale_h"], r["seed_p"], r["rate_p"], r["scale_p"],
        DROP_H=drop["DROP_H"], DROP_P=drop["DROP_P"],
        BLOCK_N=bn, BLOCK_O=meta["BLOCK_O"], BLOCK_I=meta["BLOCK_I"],
        BLOCK_K=meta["BLOCK_K"], BLOCK_J=meta["BLOCK_J"], **common,
    )
    if dp is not None:  # a gradient flowing into the returned layer weights
        dp_c += dp.to(acc)
    da = p * (dp_c - (p * dp_c).sum(0, keepdim=True))  # softmax backward over the layers
    dh = torch.empty_like(hidden)
    _layer_attention_bwd_hidden_kernel[(triton.cdiv(N, bn), triton.cdiv(H, meta["BLOCK_I"]), L)](
        w_v, w_k, w_a, p, dc, da, z, dh, N, H, K, J, D, *seeds_hkp, **drop,
        BLOCK_N=bn, BLOCK_I=meta["BLOCK_I"], BLOCK_O=meta["BLOCK_O"], BLOCK_K=meta["BLOCK_K"],
        BLOCK_J=meta["BLOCK_J"], **common,
    )
    grads = []
    for mode, (I, O) in enumerate(((H, H), (H, K), (K, J))):
        block_o = meta["BLOCK_J"] if mode == 2 else meta["BLOCK_O"]
        dw = torch.empty((L, I, O), device=hidden.device, dtype=acc)
        db = torch.empty((L, O), device=hidden.device, dtype=acc)
        grid = (triton.cdiv(I, meta["BLOCK_I"]), triton.cdiv(O, block_o), L)
        _layer_attention_bwd_weights_kernel[grid](
            hidden, w_a, p, dc, da, z, dw, db, N, H, K, J, D, I, O, *seeds_hkp,
            MODE=mode, **drop, BLOCK_N=bn, BLOCK_I=meta["BLOCK_I"], BLOCK_O=block_o,
            BLOCK_J=meta["BLOCK_J"], **common,
        )
        grads += [dw.to(hidden.dtype), db.to(hidden.dtype)]
    return (dh, *grads)


def layer_attention_dropout_masks(
    shape_h: tuple[int, int, int], shape_k: tuple[int, int, int], shape_p: tuple[int, int, int],
    dropout: tuple[float, float, float], seed: int, device: torch.device | str = "cpu",
) -> tuple[Tensor, Tensor, Tensor]:
    """The keep masks (int8, 1 = kept) the kernels use for ``seed``: [L,N,H], [L,N,K], [L,N,J].

    For tests and debugging: the kernels themselves never materialise them.
    """
    r = _rates(dropout, seed)
    out = []
    for name, shape in zip("hkp", (shape_h, shape_k, shape_p)):
        keep = torch.empty(shape, dtype=torch.int8, device=device)
        _check_launchable(keep)
        numel = keep.numel()
        _layer_attention_dropout_masks_kernel[(triton.cdiv(numel, 1024),)](
            keep, numel, r[f"seed_{name}"], r[f"rate_{name}"], BLOCK=1024,
        )
        out.append(keep)
    return tuple(out)


# -------------------------------------------------------------- custom ops + autograd


@torch.library.custom_op("mhmla_fast::layer_attention_fwd", mutates_args=())
def _layer_attention_fwd_op(
    hidden: Tensor, w_v: Tensor, b_v: Tensor, w_k: Tensor, b_k: Tensor, w_a: Tensor,
    b_a: Tensor, num_heads: int, dropout_h: float, dropout_k: float, dropout_p: float,
    seed: Tensor,
) -> tuple[Tensor, Tensor]:
    return layer_attention_fwd(
        hidden, w_v, b_v, w_k, b_k, w_a, b_a, num_heads,
        (dropout_h, dropout_k, dropout_p), int(seed.item()),
    )


@_layer_attention_fwd_op.register_fake
def _(hidden, w_v, b_v, w_k, b_k, w_a, b_a, num_heads, dropout_h, dropout_k, dropout_p, seed):
    L, N, H = hidden.shape
    c = hidden.new_empty((N, H))
    p = hidden.new_empty((L, N, num_heads), dtype=_acc_dtype(hidden.dtype))
    return c, p


@torch.library.custom_op("mhmla_fast::layer_attention_bwd", mutates_args=())
def _layer_attention_bwd_op(
    dc: Tensor, dp: Optional[Tensor], hidden: Tensor, w_v: Tensor, b_v: Tensor, w_k: Tensor,
    b_k: Tensor, w_a: Tensor, b_a: Tensor, p: Tensor, num_heads: int,
    dropout_h: float, dropout_k: float, dropout_p: float, seed: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return layer_attention_bwd(
        dc, dp, hidden, w_v, b_v, w_k, b_k, w_a, b_a, p, num_heads,
        (dropout_h, dropout_k, dropout_p), int(seed.item()),
    )


@_layer_attention_bwd_op.register_fake
def _(dc, dp, hidden, w_v, b_v, w_k, b_k, w_a, b_a, p, num_heads, dropout_h, dropout_k,
      dropout_p, seed):
    return tuple(torch.empty_like(t) for t in (hidden, w_v, b_v, w_k, b_k, w_a, b_a))


class LayerAttentionFunction(torch.autograd.Function):
    """Autograd over the fused ops; saves the inputs and p [L, N, J], nothing L x N x H."""

    @staticmethod
    def forward(ctx, hidden, w_v, b_v, w_k, b_k, w_a, b_a, num_heads, dropout_h, dropout_k,
                dropout_p, seed):
        c, p = torch.ops.mhmla_fast.layer_attention_fwd(
            hidden, w_v, b_v, w_k, b_k, w_a, b_a, num_heads, dropout_h, dropout_k, dropout_p,
            seed,
        )
        ctx.save_for_backward(hidden, w_v, b_v, w_k, b_k, w_a, b_a, p, seed)
        ctx.c_shape = c.shape
        ctx.config = (num_heads, dropout_h, dropout_k, dropout_p)
        ctx.set_materialize_grads(False)
        return c, p

    @staticmethod
    def backward(ctx, dc, dp):
        hidden, w_v, b_v, w_k, b_k, w_a, b_a, p, seed = ctx.saved_tensors
        if dc is None:
            dc = hidden.new_zeros(ctx.c_shape)
        grads = torch.ops.mhmla_fast.layer_attention_bwd(
            dc, dp, hidden, w_v, b_v, w_k, b_k, w_a, b_a, p, *ctx.config, seed,
        )
        return (*grads, None, None, None, None, None)


def layer_attention_triton(
    hidden: Tensor, w_v: Tensor, b_v: Tensor, w_k: Tensor, b_k: Tensor, w_a: Tensor,
    b_a: Tensor, num_heads: int, *, dropout: tuple[float, float, float] = (0.0, 0.0, 0.0),
    seed: Optional[int] = None,
) -> tuple[Tensor, Tensor]:
    """Differentiable fused MHMLA on validated [L, N, H] inputs: (c [N, H], p [L, N, J]).

    ``seed`` fixes the dropout masks (drawn from torch's default generator if None).
    """
    if not any(rate > 0 for rate in dropout):
        seed_t = torch.zeros((), dtype=torch.int64)  # no dropout: draw nothing from the RNG
    elif seed is None:
        seed_t = torch.randint(0, 2**31 - _SEED_STREAMS, (), dtype=torch.int64)
    else:
        seed_t = torch.tensor(int(seed), dtype=torch.int64)
    args = [t.contiguous() for t in (hidden, w_v, b_v, w_k, b_k, w_a, b_a)]
    return LayerAttentionFunction.apply(*args, num_heads, *map(float, dropout), seed_t)
