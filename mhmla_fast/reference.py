"""Eager PyTorch reference of multi-head multi-layer attention: the definition of correct.

For layers l = 1..L, heads j = 1..J (D = H / J), per token n::

    v^l     = h^l W_v^l + b_v^l                      (Eq. 4)   [N, H], head j = columns jD..(j+1)D
    k^l     = relu(h^l W_k^l + b_k^l)                (Eq. 5)   [N, K]
    a^l     = k^l W_a^l + b_a^l                      (Eq. 6)   [N, J]
    p^{l,j} = softmax over l of a^{l,j}              (Eq. 7)   [L, N, J]
    c_j     = sum_l p^{l,j} v^{l,j}                  (Eq. 8)
    c       = concat_j c_j                           (Eq. 9)   [N, H]

Block-diagonal scoring: head j scores from its own slice k^l[:, jK/J:(j+1)K/J] with
``w_a`` of shape [L, K/J, J] instead of the dense [L, K, J].

Dropout (training only): on h^l (one mask feeds both projections), on k^l, and on p
(no renormalisation), each with inverted scaling 1 / (1 - rate).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["layer_attention_reference", "DropoutMasks"]

# (keep_h [L, N, H], keep_k [L, N, K], keep_p [L, N, J]) as 0/1 tensors, any of them None.
DropoutMasks = tuple["Tensor | None", "Tensor | None", "Tensor | None"]


def _dropout(x: Tensor, rate: float, keep: Tensor | None, training: bool) -> Tensor:
    if keep is not None:
        return x * keep.to(x.dtype) / (1.0 - rate) if rate > 0 else x * keep.to(x.dtype)
    if training and rate > 0:
        return F.dropout(x, rate, training=True)
    return x


def layer_attention_reference(
    hidden: Tensor,
    w_v: Tensor,
    b_v: Tensor,
    w_k: Tensor,
    b_k: Tensor,
    w_a: Tensor,
    b_a: Tensor,
    num_heads: int,
    *,
    dropout_h: float = 0.0,
    dropout_k: float = 0.0,
    dropout_p: float = 0.0,
    training: bool = False,
    block_diagonal: bool = False,
    masks: DropoutMasks | None = None,
) -> tuple[Tensor, Tensor]:
    """Eager MHMLA on stacked hidden states (arguments already validated).

    Args:
        hidden: [L, N, H] hidden states of the selected layers.
        w_v, b_v: [L, H, H], [L, H] value projections.
        w_k, b_k: [L, H, K], [L, K] key projections.
        w_a, b_a: [L, K, J] (or [L, K/J, J] when ``block_diagonal``), [L, J] scorers.
        num_heads: J.
        dropout_h, dropout_k, dropout_p: rates, applied when ``training`` is true.
        masks: explicit keep masks (1 = kept) replacing random dropout, used by the tests
            to replay the fused kernels' masks; the rates still give the scaling.

    Returns:
        c: [N, H] in the input dtype; p: [L, N, J] layer weights (before dropout), float32
        (float64 for float64 input).

    Scores and the softmax over layers are computed in float32; projections run in the
    input dtype, as a user's eager code would.
    """
    L, N, H = hidden.shape
    J = num_heads
    D = H // J
    keep_h, keep_k, keep_p = masks if masks is not None else (None, None, None)
    h = _dropout(hidden, dropout_h, keep_h, training)
    v = torch.baddbmm(b_v.unsqueeze(1), h, w_v)  # [L, N, H]
    k = torch.relu(torch.baddbmm(b_k.unsqueeze(1), h, w_k))  # [L, N, K]
    k = _dropout(k, dropout_k, keep_k, training)
    if block_diagonal:
        K = k.shape[-1]
        a = torch.einsum("lnjd,ldj->lnj", k.reshape(L, N, J, K // J), w_a) + b_a.unsqueeze(1)
    else:
        a = torch.baddbmm(b_a.unsqueeze(1), k, w_a)  # [L, N, J]
    p = torch.softmax(a.to(torch.promote_types(a.dtype, torch.float32)), dim=0)  # [L, N, J]
    p_used = _dropout(p, dropout_p, keep_p, training)
    c = (p_used.to(v.dtype).unsqueeze(-1) * v.reshape(L, N, J, D)).sum(0)
    return c.reshape(N, H), p
