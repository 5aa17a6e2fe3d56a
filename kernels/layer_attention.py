"""Fused Triton kernels for multi-head multi-layer attention (MHMLA), forward and backward.

Installed as ``mhmla_fast.kernels.layer_attention`` (the top-level ``kernels/`` folder of
the repository is the package ``mhmla_fast.kernels``, see ``pyproject.toml``).

    v^l = h^l W_v^l + b_v^l,  k^l = relu(h^l W_k^l + b_k^l),  a^l = k^l W_a^l + b_a^l
    p^{l,j} = softmax_l(a^{l,j}),  c_j = sum_l p^{l,j} v^{l,j},  c = concat_j c_j

Shapes: L layers, N tokens (B x T flattened), H hidden, J heads, D = H / J, K key width.

Plan (see DESIGN.md section 3):

* forward, with input dropout: h~ = h keep_h / (1 - r_h) written once (one [L, N, H] buffer,
  as eager's dropout does), rather than regenerated inside every GEMM tile.
* forward, scores kernel (grid: token tiles x L): z = h W_k + b_k tiled over K, relu,
  key dropout, a = k W_a + b_a accumulated on chip; writes only the [L, N, J] scores.
* softmax over the L layers of the tiny [L, N, J] score tensor (torch).
* forward, values kernel (grid: H column tiles x token tiles, columns fastest so that the
  programs reading the same rows of h run together and share them in L2): for every layer the
  value GEMM tile h^l W_v^l, scaled by that row's and column's head weight (p [N, J] times a
  one-hot head map, so the weights arrive in the accumulator's layout), accumulated on chip;
  one write of c. Neither the L x N x H values nor the L x N x K keys are
  ever written to memory.
* backward, over groups of G layers (at most ``BWD_GROUP_ELEMENTS`` elements of G x N x (H + K);
  one group at BERT-base shape up to N = 7281), in two passes because the softmax over the
  layers couples them:
  pass 1, values kernel (grid: H column tiles x token tiles x G): the value GEMM tile
  v = h~ W_v + b_v recomputed on chip, and in its epilogue dp_j = <dc_j, v_j> (one-hot head
  dots, per 64-column slot), dv = p~ dc (written once) and dv's per-64-token column sums;
  then cuBLAS forms dW_v = h~' dv and dh = dv W_v';
  softmax kernel: da = p (dp - sum_l p dp) over the L layers;
  pass 2, keys kernel (grid: token tiles x K column tiles x G): z = h~ W_k + b_k recomputed on
  chip, dz = (da W_a') [k~ > 0] / (1 - r_k) written once, with per-64-token partials of
  dW_a = k~' da and db_k; then dh += dz W_k' and dW_k = h~' dz as batched GEMMs.
  Every reduction over tokens has a fixed order (GEMMs, per-slot partials summed in slot
  order): weight gradients are deterministic run to run. dW_v and dW_k are each one
  reduction rounded once to the input dtype, as in eager autograd. The backward runs six
  GEMM-sized passes per layer against eager autograd's four: eager keeps the forward's v and
  k in memory, the fused op recomputes both on chip and never writes them.

Tiles: on a GPU every kernel is autotuned over configs filtered by a ``keep`` rule (no config
that would spill registers at BERT-base or MiniLM shape, see ``bench/compile_report.py``);
under the interpreter (``TRITON_INTERPRET=1``) each kernel runs one fixed, tested config.

Dropout masks are never stored: each is regenerated with ``tl.rand(seed, offset)`` from
the element's flat offset in its [L, N, H], [L, N, K] or [L, N, J] tensor, identically in
forward and backward. The kernels read the seed from an int64 scalar tensor on the device
(seed + 0, 1, 2 for the h, k and p streams) when they run: no host read of it, and a CUDA
graph's replays take the tensor's current value rather than the one at capture.
Accumulation is fp32 (fp64 for fp64 inputs).

This module registers the torch custom ops ``mhmla_fast::layer_attention_fwd`` and
``mhmla_fast::layer_attention_bwd`` when imported; import it only when the Triton
backend is wanted (``mhmla_fast.layer_attention`` does so lazily).
"""

import functools
import os
import threading
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton import knobs
from triton.runtime import driver
from triton.runtime.jit import JITFunction

from mhmla_fast.dispatch import fused_unsupported

__all__ = [
    "LayerAttentionFunction",
    "layer_attention_triton",
    "layer_attention_fwd",
    "layer_attention_bwd",
    "layer_attention_dropout_masks",
    "layer_attention_compile_cases",
    "BWD_GROUP_ELEMENTS",
]


# ----------------------------------------------------------------------------- helpers

# The dropout streams: the masks of h, k and p are drawn from seed + their stream, so that one
# seed gives three independent masks. Globals that kernels read must be constexprs.
_H_STREAM = tl.constexpr(0)
_K_STREAM = tl.constexpr(1)
_P_STREAM = tl.constexpr(2)


@triton.jit
def _dropout(x, seed, offsets, rate, scale, DROP: tl.constexpr):
    """x * keep / (1 - rate) with keep = rand(seed, offset) >= rate; identity if not DROP."""
    if DROP:
        keep = tl.rand(seed, offsets) >= rate
        x = tl.where(keep, x * scale, 0.0)
    return x


@triton.jit
def _store_slots(ptr, at, x, mask, slot, slots, stride, SPAN: tl.constexpr):
    """A tile's partial sum x at slot ``slot`` (offsets ``at``), zeros at the SPAN - 1 slots it
    also spans (``stride`` elements apart, those below ``slots``): every slot gets written."""
    tl.store(ptr + at, x, mask=mask)
    for r in tl.static_range(1, SPAN):
        tl.store(ptr + at + r * stride, tl.zeros_like(x), mask=mask & (slot + r < slots))


@triton.jit
def _load_hidden(
    H_ptr,  # [L, N, H] hidden states
    l, rows, i0, N, H,
    BLOCK_I: tl.constexpr,
):
    """The [BLOCK_N, BLOCK_I] tile of h^l at rows ``rows``, columns i0 .. i0 + BLOCK_I."""
    ii = i0 + tl.arange(0, BLOCK_I)
    base = l * N * H  # int64: layer l's first element; the tile's offsets from it fit int32
    offs = rows[:, None] * H + ii[None, :]
    return tl.load(H_ptr + base + offs, mask=(rows[:, None] < N) & (ii[None, :] < H), other=0.0)


@triton.jit
def _load_weights(W_ptr, l, i0, cols, H, C, BLOCK_I: tl.constexpr):
    """The [BLOCK_I, len(cols)] tile of W^l ([L, H, C]) at rows i0 .. i0 + BLOCK_I."""
    ii = i0 + tl.arange(0, BLOCK_I)
    return tl.load(W_ptr + l * H * C + ii[:, None] * C + cols[None, :],
                   mask=(ii[:, None] < H) & (cols[None, :] < C), other=0.0)


@triton.jit
def _hidden_times_weights(
    acc, H_ptr, W_ptr,  # accumulator; hidden states; weights [L, H, C]
    hl, l, rows, i0, cols, N, H, C,
    PREC: tl.constexpr, ACC: tl.constexpr, BLOCK_I: tl.constexpr,
):
    """acc + h[rows, i0 .. i0 + BLOCK_I] W^l[i0 .. i0 + BLOCK_I, cols]: one reduction step of a
    GEMM tile over H, h from layer ``hl`` of ``H_ptr`` (see :func:`_load_hidden`)."""
    h = _load_hidden(H_ptr, hl, rows, i0, N, H, BLOCK_I)
    w = _load_weights(W_ptr, l, i0, cols, H, C, BLOCK_I)
    return tl.dot(h, w, acc, input_precision=PREC, out_dtype=ACC)


@triton.jit
def _keys_tile(
    H_ptr, WK_ptr, BK_ptr,  # hidden states, key weights [L, H, K], key biases [L, K]
    hl, l, rows, kk, N, H, K,
    seed_k, rate_k, scale_k,
    DROP_K: tl.constexpr, PREC: tl.constexpr, ACC: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_I: tl.constexpr,
):
    """k~ = dropout(relu(h W_k^l + b_k^l)) [BLOCK_N, BLOCK_K] at rows ``rows``, key columns
    ``kk``, from the hidden states' layer ``hl`` of ``H_ptr`` (l in [L, N, H]; the group's
    index in a [G, N, H] buffer), accumulated on chip over H in BLOCK_I steps."""
    z = tl.zeros((BLOCK_N, BLOCK_K), ACC)
    for i0 in range(0, H, BLOCK_I):
        z = _hidden_times_weights(z, H_ptr, WK_ptr, hl, l, rows, i0, kk, N, H, K, PREC, ACC,
                                  BLOCK_I)
    return _keys_from_z(z, BK_ptr, l, rows, kk, N, K, seed_k, rate_k, scale_k, DROP_K)


@triton.jit
def _keys_from_z(z, BK_ptr, l, rows, kk, N, K, seed_k, rate_k, scale_k, DROP_K: tl.constexpr):
    """k~ = dropout(relu(z + b_k^l)) for the [BLOCK_N, BLOCK_K] tile z = h W_k^l[:, kk]."""
    z += tl.load(BK_ptr + l * K + kk, mask=kk < K, other=0.0).to(z.dtype)[None, :]
    return _dropout(tl.maximum(z, 0.0), seed_k, l * N * K + rows[:, None] * K + kk[None, :],
                    rate_k, scale_k, DROP_K)


# ------------------------------------------------------------------ forward kernels


@triton.jit
def _scores_step(a, k, WA_ptr, l, kk, jj, K, J, PREC: tl.constexpr):
    """a + k~ W_a^l[kk, :]: one key block's share of the scores [BLOCK_N, BLOCK_J]."""
    wa = tl.load(WA_ptr + l * K * J + kk[:, None] * J + jj[None, :],
                 mask=(kk[:, None] < K) & (jj[None, :] < J), other=0.0)
    return tl.dot(k.to(WA_ptr.dtype.element_ty), wa, a, input_precision=PREC, out_dtype=a.dtype)


@triton.jit
def _layer_attention_fwd_scores_kernel(
    H_ptr,  # [L, N, H] hidden states
    WK_ptr,  # [L, H, K] key weights
    BK_ptr,  # [L, K] key biases
    WA_ptr,  # [L, K, J] scorer weights
    BA_ptr,  # [L, J] scorer biases
    S_ptr,  # [L, N, J] scores a (out, ACC)
    N, H, K, J,
    SEED_ptr,  # the dropout seed: an int64 scalar on the device, read at launch
    rate_k, scale_k,
    DROP_K: tl.constexpr,
    N_BUCKET,  # autotuning key only: N rounded to a power of two
    BLOCK_J: tl.constexpr, PREC: tl.constexpr, ACC: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr,
    FLAT: tl.constexpr,  # one loop over (key block, H block): the pipeline runs on across blocks
):
    """a^l = dropout(relu(h^l W_k^l + b_k^l)) W_a^l + b_a^l for a [BLOCK_N] tile of tokens: the
    key tile accumulates over H in BLOCK_I steps, one BLOCK_K block of key columns at a time
    (FLAT: in one loop over all K / BLOCK_K x H / BLOCK_I steps, each block's scores taken at
    its last step); only the scores are written."""
    seed_k = tl.load(SEED_ptr) + _K_STREAM
    pid_n = tl.program_id(0)
    l = tl.program_id(1).to(tl.int64)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    jj = tl.arange(0, BLOCK_J)
    a = tl.zeros((BLOCK_N, BLOCK_J), ACC)
    if FLAT:
        steps = tl.cdiv(H, BLOCK_I)
        z = tl.zeros((BLOCK_N, BLOCK_K), ACC)
        for it in range(0, tl.cdiv(K, BLOCK_K) * steps):
            block = it // steps
            i0 = (it - block * steps) * BLOCK_I
            kk = block * BLOCK_K + tl.arange(0, BLOCK_K)
            z = _hidden_times_weights(z, H_ptr, WK_ptr, l, l, rows, i0, kk, N, H, K, PREC, ACC,
                                      BLOCK_I)
            if i0 + BLOCK_I >= H:  # the block's last step: its scores, then the next block
                k = _keys_from_z(z, BK_ptr, l, rows, kk, N, K, seed_k, rate_k, scale_k, DROP_K)
                a = _scores_step(a, k, WA_ptr, l, kk, jj, K, J, PREC)
                z = tl.zeros((BLOCK_N, BLOCK_K), ACC)
    else:
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k = _keys_tile(H_ptr, WK_ptr, BK_ptr, l, l, rows, kk, N, H, K, seed_k, rate_k,
                           scale_k, DROP_K, PREC, ACC, BLOCK_N, BLOCK_K, BLOCK_I)
            a = _scores_step(a, k, WA_ptr, l, kk, jj, K, J, PREC)
    a += tl.load(BA_ptr + l * J + jj, mask=jj < J, other=0.0).to(ACC)[None, :]
    tl.store(
        S_ptr + l * N * J + rows[:, None] * J + jj[None, :], a,
        mask=(rows[:, None] < N) & (jj[None, :] < J),
    )


@triton.jit
def _weighted_values(
    v, BV_ptr, P_ptr, head_of,
    l, rows, oo, jj, N, H, J,
    seed_p, rate_p, scale_p,
    DROP_P: tl.constexpr, PREC: tl.constexpr,
):
    """p~^{l, head(o)} (v + b_v^l)[:, o] for a [BLOCK_N, BLOCK_O] tile of layer l's values."""
    dtype = head_of.dtype
    v += tl.load(BV_ptr + l * H + oo, mask=oo < H, other=0.0).to(v.dtype)[None, :]
    offs_p = l * N * J + rows[:, None] * J + jj[None, :]
    p = tl.load(P_ptr + offs_p, mask=(rows[:, None] < N) & (jj[None, :] < J), other=0.0)
    p = _dropout(p, seed_p, offs_p, rate_p, scale_p, DROP_P)
    # p~ in the input dtype, as eager multiplies it (exact for fp32: one term per column)
    pw = tl.dot(p.to(dtype), head_of, input_precision="ieee" if dtype == tl.float32 else PREC,
                out_dtype=v.dtype)
    return pw * v


@triton.jit
def _row_weights(P_ptr, l, rows, j, N, J, seed_p, rate_p, scale_p, DROP_P: tl.constexpr, dtype,
                 ACC: tl.constexpr):
    """p~^{l,j} [BLOCK_N] at rows ``rows``, rounded to ``dtype`` (as eager multiplies it) and
    returned as ACC; 0 past N."""
    offs = l * N * J + rows * J + j
    p = tl.load(P_ptr + offs, mask=rows < N, other=0.0)
    return _dropout(p, seed_p, offs, rate_p, scale_p, DROP_P).to(dtype).to(ACC)


@triton.jit
def _layer_attention_fwd_values_kernel(
    H_ptr,  # [L, N, H] hidden states
    WV_ptr,  # [L, H, H] value weights
    BV_ptr,  # [L, H] value biases
    P_ptr,  # [L, N, J] layer weights p (ACC)
    C_ptr,  # [N, H] output c
    L, N, H, J, D,
    SEED_ptr,  # the dropout seed: an int64 scalar on the device, read at launch
    rate_p, scale_p,
    DROP_P: tl.constexpr,
    N_BUCKET,  # autotuning key only: N rounded to a power of two
    BLOCK_J: tl.constexpr, PREC: tl.constexpr, ACC: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr,
    FLAT: tl.constexpr,  # one loop over (layer, H block): the pipeline runs on across layers
    ROWSCALE: tl.constexpr = False,  # the tile within one head: weights scale h's rows
):
    """c[:, oo] = sum_l p~^{l, head(o)} (h^l W_v^l + b_v^l)[:, oo] for a [BLOCK_N] tile of
    tokens; the value GEMM tile accumulates over H in BLOCK_I steps, layer by layer (FLAT:
    in one loop over all L x H / BLOCK_I steps, each layer's weighting at its last step).

    ROWSCALE (BLOCK_O dividing D, so the tile's columns belong to one head j): p~^{l,j} is one
    weight per row, so c[:, oo] = sum_l (p~^{l,j} h^l) W_v^l[:, oo] + sum_l p~^{l,j} b_v^l[oo]
    is one GEMM over the L x H reduction, with a single accumulator and no per-layer epilogue
    (the weighted h tile enters the dot rounded to the input dtype, as eager rounds v)."""
    # column tiles vary fastest: the H / BLOCK_O programs that read the same [L, BLOCK_N, H]
    # rows of h run together and share them through L2 (W_v, 2 L H^2 bytes, stays in L2)
    seed_p = tl.load(SEED_ptr) + _P_STREAM
    pid_o = tl.program_id(0)
    pid_n = tl.program_id(1)
    dtype = H_ptr.dtype.element_ty
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    oo = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
    jj = tl.arange(0, BLOCK_J)
    acc = tl.zeros((BLOCK_N, BLOCK_O), ACC)
    # head_of[j, o] = 1 where column o belongs to head j: p [N, J] @ head_of spreads each head's
    # weight over its D columns, in the accumulator's own layout (no gather; unused by ROWSCALE)
    head_of = (((oo[None, :] // D) == jj[:, None]) & (oo[None, :] < H)).to(dtype)
    if ROWSCALE:
        j = (pid_o * BLOCK_O) // D  # the tile's head
        steps = tl.cdiv(H, BLOCK_I)
        # the row weights are recomputed at every step: computed once per layer (under
        # `if i0 == 0`, carried across steps) they took 10-70 more registers on the sm_90
        # compile report and spilled 8-32 bytes at 128 x 64 x 128 on 4 warps
        for it in range(0, L * steps):
            layer = it // steps
            i0 = (it - layer * steps) * BLOCK_I
            l = tl.cast(layer, tl.int64)
            w_l = _row_weights(P_ptr, l, rows, j, N, J, seed_p, rate_p, scale_p, DROP_P, dtype,
                               ACC)
            h = (_load_hidden(H_ptr, l, rows, i0, N, H, BLOCK_I).to(ACC) * w_l[:, None])
            w = _load_weights(WV_ptr, l, i0, oo, H, H, BLOCK_I)
            acc = tl.dot(h.to(dtype), w, acc, input_precision=PREC, out_dtype=ACC)
        for layer in range(0, L):  # sum_l p~^{l,j} b_v^l: a rank-L update
            l = tl.cast(layer, tl.int64)
            w_l = _row_weights(P_ptr, l, rows, j, N, J, seed_p, rate_p, scale_p, DROP_P, dtype,
                               ACC)
            b = tl.load(BV_ptr + l * H + oo, mask=oo < H, other=0.0).to(ACC)
            acc += w_l[:, None] * b[None, :]
    elif FLAT:
        steps = tl.cdiv(H, BLOCK_I)
        v = tl.zeros((BLOCK_N, BLOCK_O), ACC)
        for it in range(0, L * steps):
            layer = it // steps
            i0 = (it - layer * steps) * BLOCK_I
            l = tl.cast(layer, tl.int64)
            v = _hidden_times_weights(v, H_ptr, WV_ptr, l, l, rows, i0, oo, N, H, H, PREC, ACC,
                                      BLOCK_I)
            if i0 + BLOCK_I >= H:  # the layer's last step: weight its values, start the next
                acc += _weighted_values(v, BV_ptr, P_ptr, head_of, l, rows, oo, jj, N, H, J,
                                        seed_p, rate_p, scale_p, DROP_P, PREC)
                v = tl.zeros((BLOCK_N, BLOCK_O), ACC)
    else:
        for layer in range(0, L):
            l = tl.cast(layer, tl.int64)
            v = tl.zeros((BLOCK_N, BLOCK_O), ACC)
            for i0 in range(0, H, BLOCK_I):
                v = _hidden_times_weights(v, H_ptr, WV_ptr, l, l, rows, i0, oo, N, H, H, PREC,
                                          ACC, BLOCK_I)
            acc += _weighted_values(v, BV_ptr, P_ptr, head_of, l, rows, oo, jj, N, H, J,
                                    seed_p, rate_p, scale_p, DROP_P, PREC)
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
#   dp~^{l,j} = <dc_j, v^{l,j}> = <h^l, dc_j W_v^{l,j}'> + <dc_j, b_v^{l,j}>
#   dp = dp~ keep_p / (1 - r_p)  (+ the gradient of p if returned)
#   delta_j = sum_l p^{l,j} dp^{l,j}  (from dp itself, not <dc_j, c_j>: exact where c was
#             rounded to a 16-bit dtype, e.g. da == 0 exactly for L = 1)
#   da^{l,j} = p^{l,j} (dp^{l,j} - delta_j)       dW_a^l = sum_n k~^l' da^l, db_a^l = sum_n da^l
#   dz^l = (da^l W_a^l') * keep_k / (1 - r_k) * [z^l > 0]
#        = (da^l W_a^l') / (1 - r_k) * [k~^l > 0]   with k~ = relu(z) keep_k / (1 - r_k)
#                                                dW_k^l = sum_n h^l' dz^l, db_k^l = sum_n dz^l
#   dh^l = (dv^l W_v^l' + dz^l W_k^l') * keep_h / (1 - r_h)
#
# where h^l in the weight gradients is the dropped-out input the forward used. bwd_values
# recomputes the value GEMM tile v = h~ W_v + b_v on chip (one GEMM, reduction over H) and, in
# its epilogue, forms dp~_j = <dc_j, v_j> (per 64-column slot), dv = p~ dc and dv's per-tile
# column sums (db_v): v is never written. delta couples the layers, so dz waits for every
# layer's dp: bwd_softmax forms da, then bwd_keys recomputes z on chip (one GEMM) and writes
# dz with dW_a and db_k as per-64-token partials. dW_v = h~' dv, dW_k = h~' dz and
# dh = dv W_v' + dz W_k' are cuBLAS batched GEMMs over all N tokens (one reduction each, as
# eager autograd's): six GEMM-sized passes per layer in all, the two recomputations with
# their element-wise work fused, against eager's four plus the L x N x (H + K) round trips.
# Every partial is summed in a fixed order: weight gradients are deterministic run to run.


@triton.jit
def _layer_attention_bwd_values_kernel(
    H_ptr,  # [G, N, H] inputs h~ of layers l0 .. l0 + G (as the forward used them)
    WV_ptr,  # [L, H, H] value weights
    BV_ptr,  # [L, H] value biases
    DC_ptr,  # [N, H] gradient of c
    P_ptr,  # [L, N, J] layer weights p (ACC)
    DV_ptr,  # [G, N, H] dv = p~ dc (out)
    DPP_ptr,  # WHOLE_HEADS: [G, N, J] dp; else [S, G, N, J] dp partial sums, slot s over H's
    #           columns 64 s .. 64 s + 63 (out, ACC; a tile spanning several slots writes its
    #           sum to the first, zeros to the rest)
    DBV_ptr,  # db_v partials: dv summed over tokens 64 t .. 64 t + 63, slot t, (l, o) at
    #           t * SLOT_STRIDE + l * H + o (out, ACC; slots written as DPP's)
    G, N, H, J, D, l0, S, T, SLOT_STRIDE,
    SEED_ptr,  # the dropout seed: an int64 scalar on the device, read at launch
    rate_p, scale_p,
    DROP_P: tl.constexpr,
    WHOLE_HEADS: tl.constexpr,  # D divides 64: dp needs no partial slots
    N_BUCKET,  # autotuning key only: N rounded to a power of two
    BLOCK_J: tl.constexpr, PREC: tl.constexpr, ACC: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr,
    ROWSCALE: tl.constexpr = False,  # the tile is one head whole (BLOCK_O == D)
):
    """For a [BLOCK_N] tile of tokens, value columns oo and layer l: the value GEMM tile
    v = h~ W_v^l[:, oo] + b_v^l[oo] on chip (reduction over H in BLOCK_I steps), then::

        dp_j (partial over oo) = sum_{o in oo, head(o) = j} dc[:, o] v[:, o]
        dv[:, oo] = p~_{head(o)} dc[:, oo],    and dv's column sums over the tile

    dp carries the dropout factor keep_p / (1 - r_p). v itself is never written.

    ROWSCALE (the tile's columns are head j whole, BLOCK_O == D, so WHOLE_HEADS): p~_j is one
    weight per row and dp_j a row sum, with no one-hot head maps and their dots.
    """
    seed_p = tl.load(SEED_ptr) + _P_STREAM
    pid_o = tl.program_id(0)
    pid_n = tl.program_id(1)
    g = tl.program_id(2).to(tl.int64)  # layer within the group
    l = l0 + g
    dtype = H_ptr.dtype.element_ty
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    oo = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
    col_ok = oo < H
    jj = tl.arange(0, BLOCK_J)
    v = tl.zeros((BLOCK_N, BLOCK_O), ACC)
    for i0 in range(0, H, BLOCK_I):
        v = _hidden_times_weights(v, H_ptr, WV_ptr, g, l, rows, i0, oo, N, H, H, PREC, ACC,
                                  BLOCK_I)
    v += tl.load(BV_ptr + l * H + oo, mask=col_ok, other=0.0).to(ACC)[None, :]
    ok = row_ok[:, None] & col_ok[None, :]
    dc = tl.load(DC_ptr + rows[:, None] * H + oo[None, :], mask=ok, other=0.0)
    if ROWSCALE:
        tl.static_assert(WHOLE_HEADS)
        offs = l * N * J + rows * J + pid_o  # (l, n, j): the tile is head j = pid_o
        dp = _dropout(tl.sum(dc.to(ACC) * v, axis=1), seed_p, offs, rate_p, scale_p, DROP_P)
        tl.store(DPP_ptr + g * N * J + rows * J + pid_o, dp, mask=row_ok)
        w = _row_weights(P_ptr, l, rows, pid_o, N, J, seed_p, rate_p, scale_p, DROP_P, dtype,
                         ACC)
        dv = (w[:, None] * dc.to(ACC)).to(dtype)
    else:
        # one-hot head maps: p [N, J] @ head_of spreads each head's weight over its columns,
        # and (dc v) @ head_of' sums each head's columns, both in the accumulator's own layout
        head = oo // D
        head_of = ((head[None, :] == jj[:, None]) & col_ok[None, :]).to(dtype)  # [J', O]
        head_of_t = ((head[:, None] == jj[None, :]) & col_ok[:, None]).to(dtype)  # [O, J']
        offs_p = l * N * J + rows[:, None] * J + jj[None, :]  # (l, n, j) in [L, N, J]
        p_ok = row_ok[:, None] & (jj[None, :] < J)
        prod = dc.to(ACC) * v  # v dies here: the epilogue holds one fp32 tile at a time
        if dtype == tl.float32 or ACC == tl.float64:
            dp = tl.dot(prod.to(dtype), head_of_t, input_precision="ieee", out_dtype=ACC)
        else:  # 16-bit inputs: the fp32 products as hi + lo in the input dtype, summed in fp32
            hi = prod.to(dtype)
            dp = tl.dot(hi, head_of_t, out_dtype=ACC)
            dp = tl.dot((prod - hi.to(ACC)).to(dtype), head_of_t, dp, out_dtype=ACC)
        p = _dropout(tl.load(P_ptr + offs_p, mask=p_ok, other=0.0), seed_p, offs_p, rate_p,
                     scale_p, DROP_P)
        dp = _dropout(dp, seed_p, offs_p, rate_p, scale_p, DROP_P)
        # p~ in the input dtype, as eager multiplies it (exact: one term per column)
        pw = tl.dot(p.to(dtype), head_of, input_precision="ieee" if dtype == tl.float32 else PREC,
                    out_dtype=ACC)
        dv = (pw * dc.to(ACC)).to(dtype)
        if WHOLE_HEADS:  # D divides 64: this tile holds its heads whole, their dp is complete
            mine = (jj * D >= pid_o * BLOCK_O) & (jj * D < pid_o * BLOCK_O + BLOCK_O)
            tl.store(DPP_ptr + g * N * J + rows[:, None] * J + jj[None, :], dp,
                     mask=p_ok & mine[None, :])
        else:
            slot = pid_o * (BLOCK_O // 64)
            _store_slots(DPP_ptr, (slot * G + g) * N * J + rows[:, None] * J + jj[None, :], dp,
                         p_ok, slot, S, G * N * J, BLOCK_O // 64)
    tl.store(DV_ptr + g * N * H + rows[:, None] * H + oo[None, :], dv, mask=ok)
    slot = pid_n * (BLOCK_N // 64)
    _store_slots(DBV_ptr, slot * SLOT_STRIDE + l * H + oo, tl.sum(dv.to(ACC), axis=0), col_ok,
                 slot, T, SLOT_STRIDE, BLOCK_N // 64)


@triton.jit
def _layer_attention_bwd_softmax_kernel(
    DP_ptr,  # [L, N, J] gradient of the layer weights p (ACC)
    P_ptr,  # [L, N, J] layer weights p (ACC)
    DA_ptr,  # [L, N, J] score gradients da (out, ACC)
    DBA_ptr,  # db_a partials: token slot t, (l, j) at t * SLOT_STRIDE + l * J + j (out, ACC)
    L, N, J, SLOT_STRIDE,
    BLOCK_J: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """da^l = p^l (dp^l - sum_t p^t dp^t): the softmax backward over the L layers, and da
    summed over this program's BLOCK_N tokens (one slot of the bias gradient db_a)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    jj = tl.arange(0, BLOCK_J)
    offs = rows[:, None] * J + jj[None, :]
    ok = (rows[:, None] < N) & (jj[None, :] < J)
    delta = tl.zeros((BLOCK_N, BLOCK_J), DP_ptr.dtype.element_ty)
    for layer in range(0, L):
        at = tl.cast(layer, tl.int64) * N * J + offs
        delta += tl.load(P_ptr + at, mask=ok, other=0.0) * tl.load(DP_ptr + at, mask=ok, other=0.0)
    for layer in range(0, L):
        at = tl.cast(layer, tl.int64) * N * J + offs
        p = tl.load(P_ptr + at, mask=ok, other=0.0)
        da = p * (tl.load(DP_ptr + at, mask=ok, other=0.0) - delta)
        tl.store(DA_ptr + at, da, mask=ok)
        tl.store(DBA_ptr + tl.program_id(0) * SLOT_STRIDE + layer * J + jj, tl.sum(da, axis=0),
                 mask=jj < J)


@triton.jit
def _layer_attention_bwd_keys_kernel(
    H_ptr,  # [G, N, H] inputs h~ of layers l0 .. l0 + G
    WK_ptr,  # [L, H, K] key weights
    BK_ptr,  # [L, K] key biases
    WA_ptr,  # [L, K, J] scorer weights
    DA_ptr,  # [L, N, J] score gradients da (ACC)
    DZ_ptr,  # [G, N, K] dz (out)
    DWA_ptr,  # dW_a partials: k~' da over tokens 64 t .. 64 t + 63, slot t, (l, k, j) at
    #           t * SLOT_STRIDE + (l * K + k) * J + j (out, ACC; a tile spanning several
    #           slots writes its sum to the first, zeros to the rest)
    DBK_ptr,  # db_k partials: dz summed likewise, (l, k) at t * SLOT_STRIDE + l * K + k
    G, N, H, K, J, l0, T, SLOT_STRIDE,
    SEED_ptr,  # the dropout seed: an int64 scalar on the device, read at launch
    rate_k, scale_k,
    DROP_K: tl.constexpr,
    N_BUCKET,  # autotuning key only: N rounded to a power of two
    BLOCK_J: tl.constexpr, PREC: tl.constexpr, ACC: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_I: tl.constexpr,
):
    """For a [BLOCK_N] tile of tokens, key columns kk and layer l: z = h~ W_k + b_k on chip,
    k~ = dropout(relu(z)), dz = (da W_a') [k~ > 0] / (1 - r_k), and the tile's k~' da and
    column sums of dz."""
    seed_k = tl.load(SEED_ptr) + _K_STREAM
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    g = tl.program_id(2).to(tl.int64)  # layer within the group
    l = l0 + g
    dtype = H_ptr.dtype.element_ty
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows[:, None] < N
    kk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    jj = tl.arange(0, BLOCK_J)
    # k~ in the input dtype, as eager holds it (and its ReLU mask [k~ > 0] from that value):
    # half the registers of the fp32 tile
    k = _keys_tile(H_ptr, WK_ptr, BK_ptr, g, l, rows, kk, N, H, K, seed_k, rate_k, scale_k,
                   DROP_K, PREC, ACC, BLOCK_N, BLOCK_K, BLOCK_I).to(dtype)
    # the score gradient enters both products in the input dtype, as in eager autograd;
    # rows past N have da = 0, so they add nothing to k~' da and get dz = 0
    da = tl.load(DA_ptr + l * N * J + rows[:, None] * J + jj[None, :],
                 mask=row_ok & (jj[None, :] < J), other=0.0).to(dtype)
    dwa = tl.dot(tl.trans(k), da, input_precision=PREC, out_dtype=ACC)
    slot = pid_n * (BLOCK_N // 64)
    _store_slots(DWA_ptr, slot * SLOT_STRIDE + (l * K + kk[:, None]) * J + jj[None, :], dwa,
                 (kk[:, None] < K) & (jj[None, :] < J), slot, T, SLOT_STRIDE, BLOCK_N // 64)
    wa_t = tl.load(
        WA_ptr + l * K * J + kk[None, :] * J + jj[:, None],
        mask=(jj[:, None] < J) & (kk[None, :] < K), other=0.0,
    )  # [BLOCK_J, BLOCK_K] = W_a[kk, :]'
    dk = tl.dot(da, wa_t.to(dtype), input_precision=PREC, out_dtype=ACC)
    dz = tl.where(k > 0, dk * scale_k, 0.0).to(dtype)
    tl.store(DZ_ptr + g * N * K + rows[:, None] * K + kk[None, :], dz,
             mask=row_ok & (kk[None, :] < K))
    _store_slots(DBK_ptr, slot * SLOT_STRIDE + l * K + kk, tl.sum(dz.to(ACC), axis=0), kk < K,
                 slot, T, SLOT_STRIDE, BLOCK_N // 64)


@triton.jit
def _layer_attention_dropout_layers_kernel(
    X_ptr,  # [G, N, W] layers l0 .. l0 + G of an [L, N, W] tensor
    Y_ptr,  # [G, N, W] output (may be X itself)
    NW, l0,  # NW = N * W elements per layer
    SEED_ptr, rate, scale,  # SEED_ptr: the dropout seed, an int64 scalar on the device
    STREAM: tl.constexpr,  # the seed's stream (h 0, k 1, p 2)
    ACC: tl.constexpr, BLOCK: tl.constexpr,
):
    """y = x keep / (1 - rate), keep drawn at the element's offset in the whole [L, N, W]."""
    seed = tl.load(SEED_ptr) + STREAM
    g = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < NW
    x = tl.load(X_ptr + g * NW + offs, mask=ok, other=0.0)
    y = _dropout(x.to(ACC), seed, (l0 + g) * NW + offs, rate, scale, True)
    tl.store(Y_ptr + g * NW + offs, y.to(Y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _layer_attention_dropout_masks_kernel(
    KEEP_ptr,  # [numel] int8 keep mask (out)
    numel, SEED_ptr, rate,  # SEED_ptr: the dropout seed, an int64 scalar on the device
    STREAM: tl.constexpr,  # the seed's stream (h 0, k 1, p 2)
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = tl.rand(tl.load(SEED_ptr) + STREAM, offs) >= rate
    tl.store(KEEP_ptr + offs, keep.to(tl.int8), mask=offs < numel)


# ------------------------------------------------------------------- tiles and configs
#
# Each kernel has a fixed config (the interpreter's, and the one the tests run) and, on a GPU,
# candidates for ``triton.autotune`` kept by ``_keep`` at the launch's shape. The rule bounds
# the fp32 tiles each thread holds, calibrated on the sm_90 compile report
# (``bench/compile_report.py``, bf16, BERT-base and MiniLM shape, dropout on and off): every
# kept config compiles with 0 spilled bytes and wgmma dots, while the next larger tiles spilled
# (e.g. fwd_values 128 x 64 on 4 warps: 608 bytes; bwd_keys 64 x 64 on 4 warps: 120 bytes).
# The compile gate (``tests/test_compile_report.py``) fails if a kept config spills.

_ACC = {torch.float64: tl.float64}
_STREAM = {"h": _H_STREAM.value, "k": _K_STREAM.value, "p": _P_STREAM.value}
_SMEM_BYTES = 227 * 1024  # per block on sm_90
_DROPOUT_BLOCK = 1024
# The backward's per-tile partial sums come in slots of 64 tokens (db_v, dW_a, db_k, db_a) or
# 64 columns of H (dp), the smallest tile, so their number does not depend on the autotuned
# tiles: a tile spanning several slots writes its sum to the first and zeros to the others,
# and the slots are summed in order. The softmax kernel's programs are one token slot each.
_BWD_SLOT = 64
# Backward layer group: at most this many elements of G x N x (H + K) (v and z recomputed for
# G layers at a time; at least one layer). 2^27 is 256 MiB in bf16: at BERT-base shape all 12
# layers form one group up to N = 7281 tokens (5 layers per group at N = 16384). Fewer
# elements: less memory, but more launches, and on an H100 the backward at N = 4096 was bound
# by the host's launches with 3 groups (2.6 ms wall for 1.26 ms of GPU time, commit 48dbd3e).
BWD_GROUP_ELEMENTS = 1 << 27
# fp32 elements of one [rows, cols] tile per thread that a kernel may hold, per kernel,
# calibrated on the sm_90 compile report of every candidate with the alignment Triton's JIT
# gives a real launch (16-byte aligned pointers, H, K, D divisible by 16: loads vectorised
# and pipelined). Every kept config compiles without spilling at BERT-base and MiniLM shape,
# dropout on and off; the next larger tiles spill: fwd_scores at 64 with key dropout (128 x
# 128 on 8 warps: 32-72 bytes; without it 0), fwd_values at 64 (64 x 128 on 4 warps: 168-304,
# 64 x 256 on 8 warps: 96-216), bwd_values at 64 (64 x 256 on 8 warps: 112-152; and 128 x 64
# on 4 warps spills 24 with dropout, excluded by name), bwd_keys at 64 without key dropout
# (128 x 256 on 8 warps: 80-112) and 32 with it (128 x 128 on 8 warps: 80). A compile without
# that alignment (scalar loads, no pipelining) had admitted 64 for fwd_values: the report now
# compiles as the JIT does.
_TILE_PER_THREAD = {"fwd_scores": 64, "fwd_values": 32, "bwd_values": 64, "bwd_keys": 64}
# fwd_values with ROWSCALE holds one [BLOCK_N, BLOCK_O] accumulator and the weighted h tile
# [BLOCK_N, BLOCK_I] in fp32: at most 192 elements of both per thread. At BERT-base shape the
# next larger ones spill with dropout (256 x 64 x 64 on 4 warps: 16-32 bytes, 256 x 32 x 128 on
# 4 warps: 88-152), the kept ones compile at 112-247 registers without spilling.
_ROWSCALE_PER_THREAD = 192
_TILE_DIMS = {"fwd_scores": ("BLOCK_N", "BLOCK_K"), "fwd_values": ("BLOCK_N", "BLOCK_O"),
              "bwd_values": ("BLOCK_N", "BLOCK_O"), "bwd_keys": ("BLOCK_N", "BLOCK_K")}


def _keep(name: str, tiles: dict, warps: int, stages: int) -> bool:
    """Whether a config of kernel ``name`` fits an sm_90 SM without spilling (see above).

    ``tiles`` holds the config's block sizes, the shape's BLOCK_J, DROP_K and DROP_P (key and
    layer-weight dropout on) and FP16 (the inputs are fp16, not bf16).
    """
    rows, cols = _TILE_DIMS[name]
    smem = stages * 2 * (tiles["BLOCK_N"] + tiles[cols]) * tiles["BLOCK_I"] <= _SMEM_BYTES
    if name == "bwd_values" and tiles.get("ROWSCALE"):
        # the tile is one head whole; at most 64 elements of the [BLOCK_N, D] tile per thread
        # (BERT-base: 256 x 64 on 4 warps spills 40-80 bytes; the kept ones take 86-204
        # registers)
        fits = tiles["BLOCK_N"] * tiles["BLOCK_O"] <= 64 * 32 * warps
        return tiles["HEAD_DIM"] == tiles["BLOCK_O"] and fits and smem
    if name == "fwd_values" and tiles.get("ROWSCALE"):
        # one head per tile, as wide as the head up to 64 columns (a narrower tile reads h
        # once more per column for no gain); the accumulator and weighted h tile per thread
        d, o = tiles["HEAD_DIM"], tiles["BLOCK_O"]
        fits = tiles["BLOCK_N"] * (o + tiles["BLOCK_I"]) <= _ROWSCALE_PER_THREAD * 32 * warps
        return d % o == 0 and o >= min(d, 64) and fits and smem
    per_thread = (32 if name in ("fwd_scores", "bwd_keys") and tiles["DROP_K"]
                  else _TILE_PER_THREAD[name])
    if name == "fwd_values" and tiles["FLAT"] and warps == 8 and tiles[rows] == tiles[cols]:
        per_thread = 64  # the flat loop holds fewer registers: 128 x 128 on 8 warps spills 0
        # (64 x 128 on 4 warps: 8 bytes, 128 x 64 on 4 warps: 48-72, 256 x 64 on 8: 48-64)
    if tiles[rows] * tiles[cols] > per_thread * 32 * warps:
        return False
    if name == "bwd_keys" and tiles["BLOCK_K"] < 64:  # k~' da has BLOCK_K rows: wgmma needs 64
        return False
    if name == "bwd_values" and warps == 4 and tiles["BLOCK_N"] > 64:  # 128 x 64: 24 bytes
        return False  # spilled with dropout (the epilogue's row-wise values: p~, dp)
    if (name in ("fwd_values", "bwd_values") and tiles.get("FP16") and tiles.get("DROP_P")
            and warps == 8 and tiles[rows] == tiles[cols] == 128
            and (name == "bwd_values" or stages == 4)):
        # fp16 with p dropout spills where bf16 does not (compile gate, 2026-12-07): bwd_values
        # 128 x 128 on 8 warps 24 bytes, fwd_values flat 128 x 128 on 8 warps, 4 stages: 8
        return False
    return smem  # 16-bit operand tiles [BLOCK_N, BLOCK_I] and [BLOCK_I, cols] staged


def _candidates(name: str) -> list[tuple[dict, int, int]]:
    """(tiles, num_warps, num_stages) to autotune over for kernel ``name``, before ``_keep``.

    The value kernels' ROWSCALE forms come with their warps tied to the token tile (128 rows
    on 4 warps, 256 on 8: a warp group per 64 rows), which keeps the autotuner's compiles on a
    fresh machine at about 8 more per kernel and shape."""
    rowscale = []
    if name == "fwd_values":
        grid = [dict(BLOCK_N=n, BLOCK_O=o, BLOCK_I=64, FLAT=f, ROWSCALE=False)
                for n in (64, 128, 256) for o in (64, 128, 256) for f in (False, True)]
        rowscale = [dict(BLOCK_N=n, BLOCK_O=o, BLOCK_I=i, FLAT=True, ROWSCALE=True)
                    for n in (128, 256) for o in (32, 64) for i in (64, 128)]
    elif name == "bwd_values":
        grid = [dict(BLOCK_N=n, BLOCK_O=o, BLOCK_I=64, ROWSCALE=False)
                for n in (64, 128) for o in (64, 128)]
        rowscale = [dict(BLOCK_N=n, BLOCK_O=o, BLOCK_I=i, ROWSCALE=True)
                    for n in (128, 256) for o in (32, 64) for i in (64, 128)]
    elif name == "fwd_scores":
        grid = [dict(BLOCK_N=n, BLOCK_K=k, BLOCK_I=64, FLAT=f)
                for n in (128, 256) for k in (64, 128, 256) for f in (False, True)]
    elif name == "bwd_keys":
        grid = [dict(BLOCK_N=n, BLOCK_K=k, BLOCK_I=64) for n in (64, 128) for k in (64, 128, 256)]
    else:
        raise ValueError(f"no candidates for kernel {name!r}")
    return ([(t, w, s) for t in grid for w in (4, 8) for s in (3, 4)]
            + [(t, t["BLOCK_N"] // 32, s) for t in rowscale for s in (3, 4)])


# The fixed config per kernel: the interpreter's and the tests', and the autotuner's fallback.
_FIXED = {
    "fwd_scores": (dict(BLOCK_N=64, BLOCK_K=64, BLOCK_I=64, FLAT=False), 4, 3),
    "fwd_values": (dict(BLOCK_N=64, BLOCK_O=64, BLOCK_I=64, FLAT=False, ROWSCALE=False), 4, 3),
    "bwd_values": (dict(BLOCK_N=64, BLOCK_O=64, BLOCK_I=64, ROWSCALE=False), 4, 3),
    "bwd_keys": (dict(BLOCK_N=64, BLOCK_K=64, BLOCK_I=64), 4, 3),
}
_KERNELS = {
    "fwd_scores": _layer_attention_fwd_scores_kernel,
    "fwd_values": _layer_attention_fwd_values_kernel,
    "bwd_values": _layer_attention_bwd_values_kernel,
    "bwd_keys": _layer_attention_bwd_keys_kernel,
}
_AUTOTUNE_KEY = {
    "fwd_scores": ["H", "K", "J", "N_BUCKET", "DROP_K"],
    "fwd_values": ["H", "J", "N_BUCKET", "DROP_P"],
    "bwd_values": ["H", "J", "N_BUCKET", "DROP_P"],
    "bwd_keys": ["H", "K", "J", "N_BUCKET", "DROP_K"],
}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_CONFIG_CHOICES = ("", "fixed", "rowscale", "no-rowscale")


def _config_choice() -> str:
    """``$MHMLA_TRITON_CONFIGS``: "" (autotune over every kept config), "fixed" (the fixed
    configs: GPU test runs, no autotuning per test shape), "rowscale" or "no-rowscale" (the
    value kernels autotuned over their ROWSCALE forms only, or without them: an A/B of the
    forms on a GPU)."""
    choice = os.environ.get("MHMLA_TRITON_CONFIGS", "")
    if choice not in _CONFIG_CHOICES:
        raise ValueError(f"MHMLA_TRITON_CONFIGS: expected one of {_CONFIG_CHOICES[1:]} or unset, "
                         f"got {choice!r}")
    return choice


def layer_attention_configs(name: str, H: int = 768, J: int = 12, dropout_k: bool = False, *,
                            dropout_p: bool = False, fp16: bool = False
                            ) -> list[tuple[dict, int, int]]:
    """The configs kernel ``name`` can launch at hidden size H with J heads (BERT-base by
    default), with key and layer-weight dropout on or off, in fp16 or not (bf16): the fixed one
    under the interpreter, else every candidate ``_keep`` admits (the fixed one if none is), or
    with MHMLA_TRITON_CONFIGS=rowscale (no-rowscale) only the value kernels' ROWSCALE forms
    (only the others)."""
    if _interpreting():
        tiles, w, s = _FIXED[name]
        return [(dict(tiles), w, s)]
    shape = {**_shape_constexprs(H, J), "DROP_K": dropout_k, "DROP_P": dropout_p, "FP16": fp16,
             "HEAD_DIM": H // J}
    kept = [(t, w, s) for t, w, s in _candidates(name) if _keep(name, {**shape, **t}, w, s)]
    choice = _config_choice()
    if choice in ("rowscale", "no-rowscale") and name in ("fwd_values", "bwd_values"):
        kept = [c for c in kept if c[0]["ROWSCALE"] == (choice == "rowscale")]
        if not kept:
            raise ValueError(f"MHMLA_TRITON_CONFIGS={choice}: {name} has no such config at "
                             f"H = {H}, J = {J} (ROWSCALE needs D = H / J a multiple of 32 in the "
                             "forward, 32 or 64 in the backward)")
    return kept or [_FIXED[name]]


def _shape_constexprs(H: int, J: int) -> dict:
    """Per-shape constexprs: heads padded to a power of two >= 16 (for tl.dot); WHOLE_HEADS,
    whether D = H / J divides the 64-column slot, so every bwd_values tile holds whole heads."""
    return dict(BLOCK_J=max(16, _pow2(J)), WHOLE_HEADS=_BWD_SLOT % (H // J) == 0)


def _kept(name: str, named_args: dict, kwargs: dict) -> list[tuple[dict, int, int]]:
    """The candidates kernel ``name`` is tuned over at a launch with these arguments (by name)
    and keyword arguments: what the autotuner's pruning keeps and ``_precompile`` compiles."""
    first = named_args[_KERNELS[name].arg_names[0]]  # the input tensor (a pointer argument)
    return layer_attention_configs(name, named_args["H"], named_args["J"],
                                   bool(kwargs.get("DROP_K", False)),
                                   dropout_p=bool(kwargs.get("DROP_P", False)),
                                   fp16=getattr(first, "dtype", None) == torch.float16)


@functools.cache
def _tuned(name: str):
    """Kernel ``name`` autotuned over its candidates, pruned at each launch's shape (GPU only).

    The timings are kept on disk in Triton's cache (``cache_results``; ``$TRITON_CACHE_DIR``,
    default ``~/.triton/cache``), keyed by Triton's version, the GPU target, the kernel's
    source, the pruned candidates and the autotuning key: a later process on the machine takes
    the pick without timing anything (and its compiled kernels from the same cache), so only a
    machine's first process pays the autotuning of a (shape, dtype, N bucket). Delete the cache
    folder to tune afresh."""
    by_tiles = {}
    for t, w, s in _candidates(name) + [_FIXED[name]]:
        by_tiles[(tuple(sorted(t.items())), w, s)] = triton.Config(t, num_warps=w, num_stages=s)

    def prune(configs, named_args, **kwargs):
        kept = {(tuple(sorted(t.items())), w, s) for t, w, s in _kept(name, named_args, kwargs)}
        return [c for c in configs
                if (tuple(sorted(c.kwargs.items())), c.num_warps, c.num_stages) in kept]

    return triton.autotune(configs=list(by_tiles.values()), key=_AUTOTUNE_KEY[name],
                           prune_configs_by={"early_config_prune": prune},
                           do_bench=_autotune_bench, cache_results=True)(_KERNELS[name])


def _autotune_bench(kernel_call, quantiles):
    """The autotuner's timing of one config: Triton's ``do_bench`` on a 5 ms warm-up and 25 ms
    of repetitions instead of its default 25 and 100 (a kernel here runs for 20-500 us, so
    that is still 50 repetitions or more). With about 74 configs over the four kernels at
    BERT-base shape, each new (shape, dtype, N bucket) key costs a process about 2.5 s of
    timing instead of 9 (an estimate from those budgets; compiles come on top, once per
    dtype). The first timing of a tuning compiles every candidate first, concurrently
    (``_precompile``): the autotuner would compile them one by one."""
    from triton.testing import do_bench

    pending = getattr(_TUNING, "launch", None)
    if pending is not None:
        _TUNING.launch = None
        _precompile(*pending)
    return do_bench(kernel_call, warmup=5, rep=25, quantiles=quantiles)


_COMPILE_THREADS = 16
# the launch whose candidates the autotuner is about to time (set by _launch, per thread): the
# autotuner times only where its disk cache has no pick, and only then are they compiled
_TUNING = threading.local()


def _precompile(name: str, args: tuple, kwargs: dict) -> None:
    """Compile every candidate config of kernel ``name`` that the autotuner keeps for this
    launch, in a pool of threads, one per usable CPU up to ``_COMPILE_THREADS`` (Triton's
    compiler and ptxas release the GIL): on a fresh machine a tuning's compiles take most of
    its time (about 0.5 s per config on a 2-core CPU, 41 configs for an inference forward:
    ``bench/results/triton_tuning_cpu.json``). Compile errors are left for the autotuner to
    meet again and handle as it does (a config that cannot compile is timed as infinite)."""
    from concurrent.futures import ThreadPoolExecutor

    from triton.runtime._async_compile import AsyncCompileMode

    from mhmla_fast.devices import usable_cpus

    kernel = _KERNELS[name]
    configs = _kept(name, dict(zip(kernel.arg_names, args)), kwargs)
    # at most 16 compiles at a time: each holds its own LLVM module in memory
    workers = min(len(configs), usable_cpus(), _COMPILE_THREADS)
    if workers < 2:
        return
    with ThreadPoolExecutor(workers, thread_name_prefix="mhmla-compile") as pool, \
            AsyncCompileMode(pool, ignore_errors=True):
        for tiles, warps, stages in configs:  # as the autotuner will launch them (num_ctas too)
            config = triton.Config(tiles, num_warps=warps, num_stages=stages)
            kernel.warmup(*args, grid=(1,), **kwargs, **config.all_kwargs())


# (kernel, $MHMLA_TRITON_CONFIGS, autotuning key values, first argument's dtype) -> the
# autotuner's pick for that key, as launch keyword arguments (tiles, num_warps, num_stages, ...)
_PICKS: dict[tuple, dict] = {}
_TUNE_LOCK = threading.Lock()  # held while the autotuner runs a key's first launch (_launch)
# (launch key, device, argument classes) -> (the compiled kernel's launcher, its function
# handle, its packed metadata, the kernel's arguments after the positional ones): see _run
_COMPILED: dict[tuple, tuple] = {}
_INT32, _INT64 = range(-(2**31), 2**31), range(-(2**63), 2**63)


@functools.cache
def _key_positions(name: str) -> tuple[tuple[str, int], ...]:
    """(name, position among the kernel's arguments) of each autotuning key argument."""
    arg_names = _KERNELS[name].arg_names
    return tuple((k, arg_names.index(k)) for k in _AUTOTUNE_KEY[name])


def _pick_key(name: str, choice: str, args: tuple, kwargs: dict) -> tuple:
    """The autotuning key's values, the first (input) tensor's dtype, the kernel's name and
    the config choice (which prunes the candidates, so a pick under one choice is not one
    under another). The autotuner keys on every tensor's dtype; the launchers here derive
    every tensor's dtype from the input's, and a pick only chooses tiles (the JIT compiles
    for the launch's own arguments), so the first dtype is enough and 2 us cheaper."""
    values = tuple(args[i] if i < len(args) else kwargs[k] for k, i in _key_positions(name))
    return (name, choice, values, args[0].dtype)


def _fixed_config(name: str) -> dict:
    """Kernel ``name``'s fixed config as launch keyword arguments (read at each launch: tests
    swap fixed configs)."""
    tiles, warps, stages = _FIXED[name]
    return dict(tiles, num_warps=warps, num_stages=stages)


def _launch(name: str, grid, *args, **kwargs) -> None:
    """Launch kernel ``name``: its fixed config under the interpreter (or with
    MHMLA_TRITON_CONFIGS=fixed), else the config the autotuner picks for this launch's key.

    ``grid`` maps the config's tiles to the launch grid. The autotuner runs the first launch
    of each key (timing every candidate); later launches of that key go to the kernel itself
    with the pick (``_PICKS``) through ``_run``, skipping the autotuner's dispatch, which
    builds dicts of every argument and their dtypes' names at each call: on the H100 the op's
    launches made it host-bound (issue 10). ``bench/triton_launch_host_cpu.py`` times the
    Python of a launch with the CUDA driver mocked (``bench/results/triton_launch_host_cpu.json``).
    """
    choice = _config_choice()
    if choice == "fixed" or _interpreting():
        config = _fixed_config(name)
        key = (name, "fixed", *config.items())  # the config itself: tests swap fixed configs
    else:
        key = _pick_key(name, choice, args, kwargs)
        config = _PICKS.get(key)
        if config is None:
            # one tuning at a time: the autotuner keeps one best_config per kernel, not per
            # key, so two threads tuning two keys at once could store each other's pick
            with _TUNE_LOCK:
                config = _PICKS.get(key)  # (tuned by another thread meanwhile)
                if config is None:
                    tuned = _tuned(name)
                    _TUNING.launch = (name, args, kwargs)
                    try:
                        tuned[grid](*args, **kwargs)
                    finally:
                        _TUNING.launch = None
                    _PICKS[key] = tuned.best_config.all_kwargs()
                    return
    _run(_KERNELS[name], grid(config), args, {**kwargs, **config}, (key, *kwargs.values()))


def _arg_classes(args: tuple) -> tuple:
    """What Triton's JIT specialises a compiled kernel on, per positional argument: a tensor's
    dtype and whether its address is 16-byte aligned; an int's being 1, its divisibility by 16
    and its width (32 or 64 bits, signed or not); anything else its type (floats and bools
    are not specialised on their values). Equal classes, equal compiled kernel
    (``tests/test_layer_attention_launch.py`` checks this against Triton's own binder)."""
    return _launch_args(args)[0]


def _launch_args(args: tuple) -> tuple[tuple, list]:
    """(``_arg_classes(args)``, ``args`` as a compiled kernel's launcher takes them, each tensor
    as its address). Given a tensor, Triton's launcher calls its ``data_ptr()`` and asks the
    driver whether the address is a device pointer (``cuPointerGetAttribute``), per pointer
    argument and launch; given the address it uses it as is. The launchers check devices
    before any launch (``_check_launchable``)."""
    classes, values = [], []
    for a in args:
        if isinstance(a, Tensor):
            ptr = a.data_ptr()
            classes.append((a.dtype, ptr % 16 == 0))
            values.append(ptr)
        elif type(a) is int:
            classes.append((a == 1, a % 16 == 0, a in _INT32, a in _INT64))
            values.append(a)
        else:
            classes.append(type(a))
            values.append(a)
    return tuple(classes), values


def _launch_hooks() -> bool:
    """Whether Triton's launch hooks (``knobs.runtime.launch_enter_hook``/``exit_hook``: hook
    chains, which profilers fill) have anything to call."""
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


# The Triton interpreter patches triton.language for each launch and keeps the program id in
# one global builder: launches from two threads at once failed ("Did you forget to add
# @triton.jit") or could read each other's program ids
_INTERPRETER_LOCK = threading.Lock()


def _run(kernel, grid: tuple, args: tuple, kwargs: dict, key: tuple) -> None:
    """kernel[grid](*args, **kwargs), the compiled kernel launched directly after its first use.

    ``key`` must determine ``kwargs`` (the constexprs and config); the positional arguments'
    ``_arg_classes`` and the device complete it. The first launch of a key goes through
    Triton's JIT (compiling if need be) and keeps the compiled kernel it ran; later ones call
    that kernel's launcher with the current stream, skipping the JIT's argument binding,
    specialisation and cache-key work: 10.5 us of Python per launch against 16.3 through the JIT
    on the CPU this was measured on (``bench/results/triton_launch_host_cpu.json``, rows
    ``fixed`` and ``jit``). Tensors go to the launcher as their addresses (``_launch_args``),
    which spares it a ``data_ptr()`` call and a driver query per pointer. Under the
    interpreter, or with Triton's launch hooks set (profilers), every launch goes through the
    JIT.
    """
    if not isinstance(kernel, JITFunction):  # interpreted: one launch at a time (below)
        with _INTERPRETER_LOCK:
            kernel[grid](*args, **kwargs)
        return
    if _launch_hooks():  # profiled
        kernel[grid](*args, **kwargs)
        return
    device = driver.active.get_current_device()
    classes, values = _launch_args(args)
    full_key = (key, device, classes)
    entry = _COMPILED.get(full_key)
    if entry is None:
        compiled = kernel[grid](*args, **kwargs)
        if hasattr(compiled, "result"):  # compiled asynchronously
            compiled = compiled.result()
        params = kernel.signature.parameters
        tail = tuple(kwargs[n] if n in kwargs else params[n].default
                     for n in kernel.arg_names[len(args):])
        _COMPILED[full_key] = (compiled.run, compiled.function, compiled.packed_metadata, tail)
        return
    launcher, function, metadata, tail = entry
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    launcher(grid[0], g1, g2, driver.active.get_current_stream(device), function, metadata,
             None, None, None, *values, *tail)


def _n_bucket(n: int) -> int:
    """The autotuning key for a token count: its power of two, clamped to [1024, 65536]."""
    return min(max(_pow2(n), 1024), 65536)


def layer_attention_compile_cases(dtype: torch.dtype = torch.bfloat16, L: int = 12, H: int = 768,
                                  K: int = 768, J: int = 12, dropout: bool = False,
                                  candidates: bool = False, n_aligned: bool = False) -> list[dict]:
    """Every (kernel, config) a launch at this shape and dtype can use, as ``triton.compile``
    inputs: ``{"kernel", "fn", "signature", "constexprs", "aligned", "num_warps", "num_stages",
    "tiles"}``. The four GEMM kernels (``_KERNELS``) with every config ``_keep`` admits (with
    ``candidates``, every autotuning candidate, also those it rejects) and their fixed config
    (``MHMLA_TRITON_CONFIGS=fixed`` and the autotuner's fallback); then, with their one launch
    config, the softmax backward and, with ``dropout``, the dropout kernels (h dropped once
    per layer group, and the keep masks).

    ``signature`` maps each argument to a Triton type ("*bf16", "*fp32", "*i8", "*i64", "i32",
    "fp32" or "constexpr"); ``constexprs`` gives the constexpr values; ``aligned`` names the
    arguments a launch at this shape passes 16-divisible, as Triton's JIT specialises them:
    every pointer (torch's allocations are 16-byte aligned) and the sizes H, K, D = H / J, J
    and L where they are multiples of 16. N and what follows from it vary between launches:
    unaligned, as at an odd N, or with ``n_aligned`` as at N a multiple of 1024 (N = 4096, a
    batch of 32 x 128), where the JIT specialises N, the token slots T = N / 64, the first
    group's layer offset l0 = 0, the element counts of the dropout kernels, the autotuning
    key N_BUCKET and the slot stride (where a multiple of 16) on their divisibility by 16, and
    compiles other code. For ``bench/compile_report.py``.
    """
    elem = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    acc_ptrs = {"S_ptr", "P_ptr", "DP_ptr", "DA_ptr", "DPP_ptr", "DBV_ptr", "DWA_ptr", "DBK_ptr",
                "DBA_ptr"}
    shape = _shape_constexprs(H, J)
    common = dict(PREC=_precision(dtype), ACC=tl.float32, **shape)
    drops = dict(DROP_H=dropout, DROP_K=dropout, DROP_P=dropout)
    sizes = dict(H=H, K=K, D=H // J, J=J, L=L, SLOT_STRIDE=sum(_slot_sections(L, H, K, J)))
    if n_aligned:
        sizes.update(N=1024, T=16, l0=0, NW=1024 * H, numel=1024 * H, N_BUCKET=1024)
    aligned_sizes = {a for a, v in sizes.items() if v % 16 == 0}
    fixed_launches = [("bwd_softmax", _layer_attention_bwd_softmax_kernel,
                       dict(BLOCK_J=shape["BLOCK_J"], BLOCK_N=_BWD_SLOT))]
    if dropout:
        fixed_launches += [
            ("dropout_layers", _layer_attention_dropout_layers_kernel,
             dict(STREAM=_STREAM["h"], ACC=tl.float32, BLOCK=_DROPOUT_BLOCK)),
            ("dropout_masks", _layer_attention_dropout_masks_kernel,
             dict(STREAM=_STREAM["h"], BLOCK=_DROPOUT_BLOCK))]
    launches = []
    for name, fn in _KERNELS.items():
        configs = _candidates(name) if candidates else layer_attention_configs(
            name, H, J, dropout, dropout_p=dropout, fp16=dtype == torch.float16)
        configs = configs + [c for c in [_FIXED[name]] if c not in configs]
        launches += [(name, fn, tiles, warps, stages) for tiles, warps, stages in configs]
    # (launched with Triton's defaults: 4 warps, 3 stages)
    launches += [(name, fn, tiles, 4, 3) for name, fn, tiles in fixed_launches]
    cases = []
    for name, fn, tiles, warps, stages in launches:
        values = {**common, **drops, **tiles}
        consts = {a: values[a] for a in fn.arg_names if a in values}
        signature = {}
        for a in fn.arg_names:
            if a in consts:
                signature[a] = "constexpr"
            elif a == "SEED_ptr":
                signature[a] = "*i64"
            elif a == "KEEP_ptr":
                signature[a] = "*i8"
            elif a.endswith("_ptr"):
                signature[a] = "*fp32" if a in acc_ptrs else f"*{elem}"
            elif a.startswith(("rate", "scale")):
                signature[a] = "fp32"
            else:
                signature[a] = "i32"
        aligned = [a for a in fn.arg_names if a not in consts
                   and (a.endswith("_ptr") or a in aligned_sizes)]
        cases.append(dict(kernel=name, fn=fn, signature=signature, constexprs=consts,
                          aligned=aligned, num_warps=warps, num_stages=stages, tiles=tiles))
    return cases


# ------------------------------------------------------------------------ launchers


def _cdiv(a: int, b: int) -> int:
    """ceil(a / b) in plain Python (``triton.cdiv`` and ``triton.next_power_of_2`` are
    constexpr functions, about 2 us per call from the host)."""
    return -(-a // b)


def _pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs are multiplied in full precision (no TF32), like torch's default matmul.
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"


def _rates(dropout: tuple[float, float, float]) -> dict:
    """Kernel arguments for the three dropout streams h, k, p (whose seeds the kernels take as
    seed + 0, 1, 2 from the seed tensor)."""
    out = {}
    for name, rate in zip("hkp", dropout):
        out[f"rate_{name}"] = float(rate)
        out[f"scale_{name}"] = 1.0 / (1.0 - rate) if rate > 0 else 1.0
    return out


@functools.lru_cache(maxsize=256)
def _constant_seed(seed: int, device: torch.device) -> Tensor:
    """An int seed as the kernels take it, made once per (seed, device) and never written to
    (0 is the seed of every call without dropout, saved for the backward as is). Made outside
    inference mode: an inference tensor cached by a first call under ``torch.inference_mode``
    could not be saved for the backward of a later training call."""
    with torch.inference_mode(False):
        return torch.tensor(seed, dtype=torch.int64, device=device)


def _seed_tensor(seed: Tensor | int, device: torch.device) -> Tensor:
    """The dropout seed as the kernels take it: an int64 scalar tensor on the launch's device,
    which they read when they run (no host read: a CUDA graph's replays use the tensor's
    value at replay, where a seed passed as a kernel argument would be frozen at capture)."""
    if isinstance(seed, Tensor):
        if seed.dtype != torch.int64 or seed.dim() != 0:
            raise ValueError(f"seed: expected an int64 scalar tensor, got {seed.dtype} "
                             f"{list(seed.shape)}")
        return seed if seed.device == device else seed.to(device)
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        # a constant of the traced graph (Dynamo skips caches), or a tensor of the active
        # dispatch mode (a FakeTensorMode's fake tensor must not outlive the mode in the cache)
        return torch.tensor(int(seed), dtype=torch.int64, device=device)
    return _constant_seed(int(seed), device)


def _check_launchable(t: Tensor) -> None:
    if t.device.type == "cpu" and not _interpreting():
        raise RuntimeError(
            "the triton backend runs on CPU tensors only under the Triton interpreter: "
            "set TRITON_INTERPRET=1 in the environment before importing mhmla_fast "
            "(or use backend='torch' on CPU)"
        )


def layer_attention_fwd(
    hidden: Tensor, w_v: Tensor, b_v: Tensor, w_k: Tensor, b_k: Tensor, w_a: Tensor,
    b_a: Tensor, num_heads: int, dropout: tuple[float, float, float], seed: Tensor | int,
) -> tuple[Tensor, Tensor]:
    """Fused forward on validated, contiguous inputs.

    Args: hidden [L, N, H]; w_v [L, H, H]; b_v [L, H]; w_k [L, H, K]; b_k [L, K];
    w_a [L, K, J]; b_a [L, J]; ``dropout`` the (h, k, p) rates (0 in eval); ``seed`` the
    dropout seed (an int64 scalar tensor, on the device or copied there, see ``_seed_tensor``;
    or an int). Returns c [N, H] (input dtype) and p [L, N, J] (fp32; fp64 for fp64).
    """
    _check_launchable(hidden)
    L, N, H = hidden.shape
    K, J = w_k.shape[2], num_heads
    acc = _acc_dtype(hidden.dtype)
    shape = _shape_constexprs(H, J)
    common = dict(PREC=_precision(hidden.dtype), ACC=_ACC.get(hidden.dtype, tl.float32))
    r = _rates(dropout)
    seed = _seed_tensor(seed, hidden.device)
    drop_h, drop_k, drop_p = (rate > 0 for rate in dropout)
    if drop_h:  # h~ once (as eager does), not regenerated inside every GEMM tile
        hidden = _dropout_layers(hidden, torch.empty_like(hidden), 0, seed, r["rate_h"],
                                 r["scale_h"])
    scores = torch.empty((L, N, J), device=hidden.device, dtype=acc)
    _launch(
        "fwd_scores", lambda m: (_cdiv(N, m["BLOCK_N"]), L),
        hidden, w_k, b_k, w_a, b_a, scores, N, H, K, J, seed, r["rate_k"], r["scale_k"],
        DROP_K=drop_k, N_BUCKET=_n_bucket(N), BLOCK_J=shape["BLOCK_J"], **common,
    )
    p = torch.softmax(scores, dim=0)
    c = torch.empty((N, H), device=hidden.device, dtype=hidden.dtype)
    _launch(
        "fwd_values", lambda m: (_cdiv(H, m["BLOCK_O"]), _cdiv(N, m["BLOCK_N"])),
        hidden, w_v, b_v, p, c, L, N, H, J, H // J, seed, r["rate_p"], r["scale_p"],
        DROP_P=drop_p, N_BUCKET=_n_bucket(N), BLOCK_J=shape["BLOCK_J"], **common,
    )
    return c, p


def _slot_sections(L: int, H: int, K: int, J: int) -> tuple[int, int, int, int]:
    """The widths of db_v, dW_a, db_k and db_a in a token slot of the backward's partial sums
    (side by side: one sum and one cast at the end); their sum is the kernels' SLOT_STRIDE."""
    return (L * H, L * K * J, L * K, L * J)


def _bwd_layer_groups(L: int, N: int, H: int, K: int) -> list[tuple[int, int]]:
    """Layer ranges [l0, l1) of the backward: G x N x (H + K) <= BWD_GROUP_ELEMENTS (at least
    one layer), in groups of equal size but the last."""
    size = min(L, max(1, BWD_GROUP_ELEMENTS // (N * (H + K))))
    return [(l0, min(L, l0 + size)) for l0 in range(0, L, size)]


def _dropout_layers(x: Tensor, out: Tensor, l0: int, seed: Tensor, rate: float,
                    scale: float) -> Tensor:
    """out = x keep / (1 - rate) for layers l0 .. l0 + G ([G, N, W], contiguous) of an
    [L, N, W] tensor, the keep mask drawn at the whole tensor's flat offsets from the h stream
    of ``seed`` (an int64 scalar tensor on the device)."""
    G, N, W = x.shape
    acc = _ACC.get(x.dtype, tl.float32)
    kwargs = dict(STREAM=_STREAM["h"], ACC=acc, BLOCK=_DROPOUT_BLOCK)
    _run(_layer_attention_dropout_layers_kernel, (_cdiv(N * W, _DROPOUT_BLOCK), G),
         (x, out, N * W, l0, seed, rate, scale), kwargs, ("dropout_layers", *kwargs.values()))
    return out


def layer_attention_bwd(
    dc: Tensor, dp: Optional[Tensor], hidden: Tensor, w_v: Tensor, b_v: Tensor, w_k: Tensor,
    b_k: Tensor, w_a: Tensor, b_a: Tensor, p: Tensor, num_heads: int,
    dropout: tuple[float, float, float], seed: Tensor | int,
) -> tuple[Tensor, ...]:
    """Fused backward: (dh [L, N, H], dw_v, db_v, dw_k, db_k, dw_a, db_a).

    ``dc`` [N, H] is the gradient of c, ``dp`` [L, N, J] (or None) that of the returned
    layer weights; the other arguments are the forward's inputs and its weights p. Two passes
    over groups of G layers (``_bwd_layer_groups``): pass 1 (bwd_values, v recomputed on chip)
    gives dp, dv and db_v of a group, then cuBLAS dW_v = h~' dv and dh = dv W_v'; after the
    softmax backward over all layers (bwd_softmax), pass 2 (bwd_keys, z recomputed on chip)
    gives dz, dW_a and db_k, then dh += dz W_k' and dW_k = h~' dz. Besides the gradients it
    allocates one [G, N, max(H, K)] buffer (dv in pass 1, dz in pass 2; and a [G, N, H] one
    for h with dropout when the forward dropped it), [L, N, J]-sized score tensors and
    per-slot partial sums.
    dW_v and dW_k are GEMMs over all N tokens, written in the input dtype, as eager autograd
    computes them; the other weight gradients are sums of per-slot partials in a fixed order,
    summed and rounded together: db_v, db_k, dw_a and db_a are views of one buffer (fewer
    launches: the backward was host-bound on an H100).
    """
    _check_launchable(hidden)
    L, N, H = hidden.shape
    K, J = w_k.shape[2], num_heads
    D = H // J
    dtype, dev = hidden.dtype, hidden.device
    acc = _acc_dtype(dtype)
    shape = _shape_constexprs(H, J)
    common = dict(ACC=_ACC.get(dtype, tl.float32), PREC=_precision(dtype), N_BUCKET=_n_bucket(N))
    r = _rates(dropout)
    seed = _seed_tensor(seed, dev)
    drop_h, drop_k, drop_p = (rate > 0 for rate in dropout)
    dc = dc if dc.is_contiguous() else dc.contiguous()
    groups = _bwd_layer_groups(L, N, H, K)
    most = max(l1 - l0 for l0, l1 in groups)
    T, S = _cdiv(N, _BWD_SLOT), _cdiv(H, _BWD_SLOT)  # token slots, column slots
    scratch = torch.empty(most * N * max(H, K), device=dev, dtype=dtype)  # dv in pass 1, dz in 2
    h_buf = torch.empty((most, N, H), device=dev, dtype=dtype) if drop_h else None
    # D dividing 64: every tile holds whole heads and writes dp itself; else dp per column slot
    whole_heads = shape["WHOLE_HEADS"]
    dpp_buf = None if whole_heads else torch.empty(S * most * N * J, device=dev, dtype=acc)
    # the bias and scorer gradients, per token slot, side by side: one sum and one cast at the end
    sections = _slot_sections(L, H, K, J)
    stride = sum(sections)
    slots = torch.empty((T, stride), device=dev, dtype=acc)
    dbv_slots, dwa_slots, dbk_slots, dba_slots = slots.split_with_sizes(sections, dim=1)

    def layers(t: Tensor, l0: int, l1: int) -> Tensor:
        """Layers l0 .. l1 of an [L, ...] tensor: itself when that is all of them (one group,
        the usual case; a slice is a dispatcher call, and the host bounds this op on a GPU)."""
        return t if l1 - l0 == L else t[l0:l1]

    def group_hidden(l0: int, l1: int) -> Tensor:
        """h~ of layers l0 .. l1: the forward's dropped-out input."""
        if not drop_h:
            return layers(hidden, l0, l1)
        return _dropout_layers(layers(hidden, l0, l1), h_buf[: l1 - l0], l0, seed,
                               r["rate_h"], r["scale_h"])

    dh = torch.empty_like(hidden)
    dw_v, dw_k = torch.empty_like(w_v), torch.empty_like(w_k)
    dp_all = torch.empty((L, N, J), device=dev, dtype=acc)
    # pass 1: dp, dv -> db_v; dW_v = h~' dv and dh = dv W_v' by cuBLAS, group by group
    for l0, l1 in groups:
        G = l1 - l0
        h = group_hidden(l0, l1)
        dv = scratch[: G * N * H].view(G, N, H)
        dpp = layers(dp_all, l0, l1) if whole_heads else dpp_buf[: S * G * N * J].view(S, G, N, J)
        _launch(
            "bwd_values", lambda m: (_cdiv(H, m["BLOCK_O"]), _cdiv(N, m["BLOCK_N"]), G),
            h, w_v, b_v, dc, p, dv, dpp, dbv_slots, G, N, H, J, D, l0, S, T, stride,
            seed, r["rate_p"], r["scale_p"], DROP_P=drop_p, WHOLE_HEADS=whole_heads,
            BLOCK_J=shape["BLOCK_J"], **common,
        )
        if not whole_heads:
            torch.sum(dpp, 0, out=layers(dp_all, l0, l1))
        torch.bmm(h.mT, dv, out=layers(dw_v, l0, l1))
        torch.bmm(dv, layers(w_v, l0, l1).mT, out=layers(dh, l0, l1))
    if dp is not None:  # a gradient flowing into the returned layer weights
        dp_all += dp
    da = torch.empty_like(dp_all)
    softmax = dict(BLOCK_J=shape["BLOCK_J"], BLOCK_N=_BWD_SLOT)
    _run(_layer_attention_bwd_softmax_kernel, (T,), (dp_all, p, da, dba_slots, L, N, J, stride),
         softmax, ("bwd_softmax", *softmax.values()))
    # pass 2: dz (z recomputed on chip) -> dW_a, db_k; dh += dz W_k' and dW_k = h~' dz
    for l0, l1 in groups:
        G = l1 - l0
        h = h_buf[:G] if drop_h and len(groups) == 1 else group_hidden(l0, l1)  # still there
        dz = scratch[: G * N * K].view(G, N, K)
        _launch(
            "bwd_keys", lambda m: (_cdiv(N, m["BLOCK_N"]), _cdiv(K, m["BLOCK_K"]), G),
            h, w_k, b_k, w_a, da, dz, dwa_slots, dbk_slots, G, N, H, K, J, l0, T, stride,
            seed, r["rate_k"], r["scale_k"], DROP_K=drop_k, BLOCK_J=shape["BLOCK_J"],
            **common,
        )
        dh_g = layers(dh, l0, l1).baddbmm_(dz, layers(w_k, l0, l1).mT)
        if drop_h:
            _dropout_layers(dh_g, dh_g, l0, seed, r["rate_h"], r["scale_h"])
        torch.bmm(h.mT, dz, out=layers(dw_k, l0, l1))
    # the slots summed in order, rounded once to the input dtype
    db_v, dw_a, db_k, db_a = slots.sum(0).to(dtype).split_with_sizes(sections)
    return (dh, dw_v, db_v.view(L, H), dw_k, db_k.view(L, K), dw_a.view(L, K, J),
            db_a.view(L, J))


def layer_attention_dropout_masks(
    shape_h: tuple[int, int, int], shape_k: tuple[int, int, int], shape_p: tuple[int, int, int],
    dropout: tuple[float, float, float], seed: Tensor | int,
    device: torch.device | str = "cpu",
) -> tuple[Tensor, Tensor, Tensor]:
    """The keep masks (int8, 1 = kept) the kernels use for ``seed`` (an int, or an int64 scalar
    tensor): [L,N,H], [L,N,K], [L,N,J].

    For tests, debugging and the eager backward of ``backend="auto"``: the fused kernels
    themselves never materialise them.
    """
    r = _rates(dropout)
    out = []
    for name, shape in zip("hkp", (shape_h, shape_k, shape_p)):
        keep = torch.empty(shape, dtype=torch.int8, device=device)
        _check_launchable(keep)
        numel = keep.numel()
        kwargs = dict(STREAM=_STREAM[name], BLOCK=_DROPOUT_BLOCK)
        _run(_layer_attention_dropout_masks_kernel, (_cdiv(numel, _DROPOUT_BLOCK),),
             (keep, numel, _seed_tensor(seed, keep.device), r[f"rate_{name}"]), kwargs,
             ("dropout_masks", *kwargs.values()))
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
        hidden, w_v, b_v, w_k, b_k, w_a, b_a, num_heads, (dropout_h, dropout_k, dropout_p), seed,
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
    grads = layer_attention_bwd(
        dc, dp, hidden, w_v, b_v, w_k, b_k, w_a, b_a, p, num_heads,
        (dropout_h, dropout_k, dropout_p), seed,
    )
    # a custom op's outputs may not alias each other: the small gradients share one buffer
    dh, dw_v, db_v, dw_k, db_k, dw_a, db_a = grads
    return dh, dw_v, db_v.clone(), dw_k, db_k.clone(), dw_a.clone(), db_a.clone()


@_layer_attention_bwd_op.register_fake
def _(dc, dp, hidden, w_v, b_v, w_k, b_k, w_a, b_a, p, num_heads, dropout_h, dropout_k,
      dropout_p, seed):
    return tuple(torch.empty_like(t) for t in (hidden, w_v, b_v, w_k, b_k, w_a, b_a))


IMPLEMENTATIONS = ("triton", "torch")


def _reference_replaying_masks(inputs, num_heads, dropout, seed):
    """The eager reference on the fused kernels' dropout masks for ``seed``: (c, p)."""
    from mhmla_fast.reference import layer_attention_reference

    hidden, w_k = inputs[0], inputs[3]
    masks = None
    if any(rate > 0 for rate in dropout):
        L, N, H = hidden.shape
        shapes = ((L, N, H), (L, N, w_k.shape[2]), (L, N, num_heads))
        keep = layer_attention_dropout_masks(*shapes, dropout, seed, hidden.device)
        masks = tuple(m if rate > 0 else None for m, rate in zip(keep, dropout))
    return layer_attention_reference(
        *inputs, num_heads, dropout_h=dropout[0], dropout_k=dropout[1], dropout_p=dropout[2],
        training=masks is not None, masks=masks,
    )


def _direct(t: Tensor) -> bool:
    """Whether to call the launchers themselves rather than the registered custom ops: for
    plain tensors outside ``torch.compile``'s tracing, where the ops' dispatch layers would
    only add host time (about 100 us per forward + backward on the CPU this was measured on);
    tracing, fake and meta tensors go through the ops, which have fake implementations."""
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and not t.is_meta
            and not torch.compiler.is_compiling())


class LayerAttentionFunction(torch.autograd.Function):
    """Autograd over the layer-attention ops with one implementation per direction.

    ``kernels`` = (forward, backward), each ``"triton"`` (the fused ops) or ``"torch"`` (the
    eager reference on the same dropout masks, which the fused kernels' seed regenerates), so
    ``backend="auto"`` can take the faster one in each direction. Saves the inputs and
    p [L, N, J], nothing L x N x H.

    A backward that must itself be differentiable (``create_graph=True``: a gradient penalty,
    a Hessian-vector product) is the eager reference's, recomputed on the saved inputs and
    the same masks, when ``second_order`` is "torch" (``backend="auto"``); with "raise"
    (``backend="triton"``, whose fused backward is not differentiable) it raises.
    """

    @staticmethod
    def forward(ctx, hidden, w_v, b_v, w_k, b_k, w_a, b_a, num_heads, dropout_h, dropout_k,
                dropout_p, seed, kernels, second_order="raise"):
        dropout = (dropout_h, dropout_k, dropout_p)
        if kernels[0] == "triton" and _direct(hidden):
            c, p = layer_attention_fwd(hidden, w_v, b_v, w_k, b_k, w_a, b_a, num_heads, dropout,
                                       seed)
        elif kernels[0] == "triton":
            c, p = torch.ops.mhmla_fast.layer_attention_fwd(
                hidden, w_v, b_v, w_k, b_k, w_a, b_a, num_heads, *dropout, seed,
            )
        else:
            c, p = _reference_replaying_masks((hidden, w_v, b_v, w_k, b_k, w_a, b_a),
                                              num_heads, dropout, seed)
        ctx.save_for_backward(hidden, w_v, b_v, w_k, b_k, w_a, b_a, p, seed)
        ctx.c_shape = c.shape
        ctx.config = (num_heads, *dropout)
        ctx.backward_kernels = kernels[1]
        ctx.second_order = second_order
        ctx.set_materialize_grads(False)
        return c, p

    @staticmethod
    def backward(ctx, dc, dp):
        hidden, w_v, b_v, w_k, b_k, w_a, b_a, p, seed = ctx.saved_tensors
        inputs = (hidden, w_v, b_v, w_k, b_k, w_a, b_a)
        if torch.is_grad_enabled():  # create_graph=True: this backward is differentiated too
            return LayerAttentionFunction._differentiable_backward(ctx, inputs, dc, dp, seed)
        c_unused = dc is None  # a loss of p alone: W_v and b_v get no gradient, as in eager
        if c_unused:
            dc = hidden.new_zeros(ctx.c_shape)
        if ctx.backward_kernels == "triton" and _direct(dc):
            num_heads, *dropout = ctx.config
            grads = layer_attention_bwd(dc, dp, *inputs, p, num_heads, tuple(dropout), seed)
        elif ctx.backward_kernels == "triton":
            grads = torch.ops.mhmla_fast.layer_attention_bwd(dc, dp, *inputs, p, *ctx.config, seed)
        else:
            num_heads, *dropout = ctx.config
            with torch.enable_grad():
                leaves = [t.detach().requires_grad_() for t in inputs]
                c, p_ref = _reference_replaying_masks(leaves, num_heads, dropout, seed)
                outs, douts = [c], [dc]
                if dp is not None:
                    outs.append(p_ref)
                    douts.append(dp)
                grads = torch.autograd.grad(outs, leaves, douts, allow_unused=True)
        if c_unused:  # (None, not zeros: an optimizer skips a parameter without a gradient)
            grads = (grads[0], None, None, *grads[3:])
        return (*grads, None, None, None, None, None, None, None)

    @staticmethod
    def _differentiable_backward(ctx, inputs, dc, dp, seed):
        """The backward as differentiable eager ops (``create_graph=True``): the reference
        recomputed on the saved inputs (which carry their autograd history) and the fused
        kernels' masks, then ``autograd.grad`` with ``create_graph``. A second-order gradient
        through the fused backward was silently zero (its gradients had no history)."""
        if ctx.backward_kernels == "triton" and ctx.second_order != "torch":
            raise RuntimeError(
                "layer_attention: backend 'triton' (the fused kernels) is differentiable once; "
                "a backward with create_graph=True (a second-order gradient) needs "
                "backend='torch' or 'auto'")
        num_heads, *dropout = ctx.config
        wants = [i for i, t in enumerate(inputs) if t.requires_grad]
        c, p_ref = _reference_replaying_masks(inputs, num_heads, tuple(dropout), seed)
        outs, douts = [], []
        for out, grad in ((c, dc), (p_ref, dp)):
            if grad is not None:
                outs.append(out)
                douts.append(grad)
        grads = [None] * len(inputs)
        if outs and wants:
            got = torch.autograd.grad(outs, [inputs[i] for i in wants], douts,
                                      create_graph=True, allow_unused=True)
            for i, g in zip(wants, got):
                grads[i] = g
        return (*grads, None, None, None, None, None, None, None)


def layer_attention_triton(
    hidden: Tensor, w_v: Tensor, b_v: Tensor, w_k: Tensor, b_k: Tensor, w_a: Tensor,
    b_a: Tensor, num_heads: int, *, dropout: tuple[float, float, float] = (0.0, 0.0, 0.0),
    seed: Optional[int] = None, kernels: tuple[str, str] = ("triton", "triton"),
    second_order: str = "raise",
) -> tuple[Tensor, Tensor]:
    """Differentiable fused MHMLA on validated [L, N, H] inputs: (c [N, H], p [L, N, J]).

    ``seed`` fixes the dropout masks (drawn from torch's default generator if None).
    ``kernels`` = (forward, backward) implementations, each "triton" or "torch";
    ``second_order``: "torch" (a backward with ``create_graph=True`` runs the eager
    reference's) or "raise" (it raises when the backward is fused); see
    ``LayerAttentionFunction``.
    """
    unsupported = fused_unsupported(hidden.device.type, hidden.dtype, hidden.shape[-1], w_k.shape[-1])
    if unsupported and "triton" in kernels:
        raise ValueError(unsupported)
    kernels = tuple(kernels)
    if len(kernels) != 2 or any(k not in IMPLEMENTATIONS for k in kernels):
        raise ValueError(f"kernels: expected (forward, backward) from {IMPLEMENTATIONS}, got {kernels!r}")
    # (is_contiguous is a plain attribute read; contiguous() a dispatcher call even when a no-op)
    args = [t if t.is_contiguous() else t.contiguous() for t in (hidden, w_v, b_v, w_k, b_k, w_a, b_a)]
    dropped = any(rate > 0 for rate in dropout)
    if not dropped:
        seed_t = _seed_tensor(0, hidden.device)  # no dropout: draw nothing from the RNG
        if (kernels[0] == "triton" and _direct(hidden)
                and not (torch.is_grad_enabled() and any(t.requires_grad for t in args))):
            # inference: the launchers without the autograd Function (its context and saved
            # tensors cost host time, which bounds the fused op on a GPU)
            return layer_attention_fwd(*args, num_heads, (0.0, 0.0, 0.0), seed_t)
    elif seed is None:  # drawn on the device: no host round trip, and new at each graph replay
        seed_t = torch.randint(0, 2**31 - len(_STREAM), (), dtype=torch.int64,
                               device=hidden.device)
    else:
        seed_t = _seed_tensor(int(seed), hidden.device)
    if second_order not in ("raise", "torch"):
        raise ValueError(f"second_order: expected 'raise' or 'torch', got {second_order!r}")
    return LayerAttentionFunction.apply(*args, num_heads, *map(float, dropout), seed_t, kernels,
                                        second_order)
