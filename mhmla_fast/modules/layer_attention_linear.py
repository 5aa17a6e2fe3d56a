"""``LayerAttentionLinear``: a layer-attention head and the linear map after it, folded."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..functional import check_layers
from .layer_attention import FusedLayerAttention, select_hidden_states

__all__ = ["LayerAttentionLinear"]


class LayerAttentionLinear(nn.Module):
    r"""``linear(head(hidden_states))`` for inference, with the linear map folded into the values.

    For the MHMLA head (and SHMLA, J = 1), with D = H / J and C outputs of the linear map
    (W_o [H, C], b_o [C]; head j owns the rows jD..(j+1)D of W_o)::

        y = c W_o + b_o = sum_l sum_j p^{l,j} (h^l U^{l,j} + e^{l,j}) + b_o        [*, C]
        U^{l,j} = W_v^l[:, jD:(j+1)D] W_o[jD:(j+1)D, :]                            [H, C]
        e^{l,j} = b_v^l[jD:(j+1)D] W_o[jD:(j+1)D, :]                               [C]

    with p^{l,j} the head's layer weights, unchanged (softmax over l of relu(h^l W_k^l + b_k^l)
    W_a^l + b_a^l). One batched GEMM per layer, h^l [W_k^l | U^l] with U^l [H, J C], gives the
    keys' pre-activations and every head's outputs: K + J C columns instead of the head's K + H
    (for MiniLM's classifier, 408 instead of 768), and the L x N x H values are never formed.
    AvgL: ``y = mean_l (h^l U^l + e^l) + b_o`` with U^l = W_v^l W_o; last layer: ``linear(h^L)``.

    The same function as the head followed by the linear map, up to rounding: the fold is
    computed in float64 from the modules' weights when it is made and stored in their dtype.
    It is a snapshot (make it again after changing the weights) and has no dropout, so it
    serves inference only. Scores, softmax and the sums over layers and heads run in float32
    (float64 for float64 weights).

    Args:
        head: a :class:`FusedLayerAttention` (any mode).
        linear: the ``nn.Linear(H, C)`` applied to the head's output.

    Shapes: ``forward(hidden_states)`` takes what the head takes (Hugging Face's tuple of
    ``num_layers + 1`` tensors [*, H], or a tensor [num_layers + 1, *, H]) and returns y [*, C]
    in float32 (float64 for float64 input).
    """

    def __init__(self, head: FusedLayerAttention, linear: nn.Linear) -> None:
        super().__init__()
        if not isinstance(head, FusedLayerAttention):
            raise ValueError(f"head: expected a FusedLayerAttention, got {type(head).__name__}")
        H = head.hidden_size
        if not isinstance(linear, nn.Linear) or linear.in_features != H:
            raise ValueError(f"linear: expected an nn.Linear({H}, C) after the head, "
                             f"got {linear!r}")
        self.hidden_size = H
        self.num_layers, self.layers, self.mode = head.num_layers, list(head.layers), head.mode
        self.num_heads, self.key_size = head.num_heads, head.key_size
        self.block_diagonal = head.block_diagonal
        self.out_features = C = linear.out_features
        dtype = linear.weight.dtype
        w_o = linear.weight.detach().double().t()  # [H, C]
        b_o = linear.bias.detach().double() if linear.bias is not None else w_o.new_zeros(C)
        self.register_buffer("b_o", b_o.to(dtype))
        if self.mode == "last":
            self.register_buffer("w_o", w_o.t().to(dtype))  # [C, H], F.linear's layout
            return
        w_v, b_v = head.w_v.detach().double(), head.b_v.detach().double()
        L = w_v.shape[0]
        if self.mode == "avgl":
            self.register_buffer("w_y", (w_v @ w_o).to(dtype))  # [L, H, C]
            self.register_buffer("b_y", (b_v @ w_o).to(dtype))  # [L, C]
            return
        J, D = self.num_heads, H // self.num_heads
        w_o_heads = w_o.reshape(J, D, C)
        u = torch.einsum("lhjd,jdc->lhjc", w_v.reshape(L, H, J, D), w_o_heads).reshape(L, H, J * C)
        e = torch.einsum("ljd,jdc->ljc", b_v.reshape(L, J, D), w_o_heads).reshape(L, J * C)
        self.register_buffer("w_y", torch.cat([head.w_k.detach().double(), u], -1).to(dtype))
        self.register_buffer("b_y", torch.cat([head.b_k.detach().double(), e], -1).to(dtype))
        self.register_buffer("w_a", head.w_a.detach().to(dtype))
        self.register_buffer("b_a", head.b_a.detach().to(dtype))

    def forward(self, hidden_states: Tensor | Sequence[Tensor]) -> Tensor:
        """y [*, C] (see the class docstring)."""
        hs = select_hidden_states(hidden_states, self.num_layers, self.layers)
        check_layers(hs, self.hidden_size)  # (integer input would cast the fold to integers)
        dtype = hs[0].dtype
        acc = torch.promote_types(dtype, torch.float32)
        if self.mode == "last":
            return F.linear(hs[-1], self.w_o.to(dtype), self.b_o.to(dtype)).to(acc)
        lead, H = hs[0].shape[:-1], hs[0].shape[-1]
        h = torch.stack(hs, 0).reshape(len(hs), -1, H)  # [L, N, H]
        y = torch.baddbmm(self.b_y.to(dtype).unsqueeze(1), h, self.w_y.to(dtype))
        b_o = self.b_o.to(acc)
        if self.mode == "avgl":
            return (y.to(acc).mean(0) + b_o).reshape(*lead, -1)
        L, N, J, K, C = h.shape[0], h.shape[1], self.num_heads, self.key_size, self.out_features
        k = torch.relu(y[..., :K])
        if self.block_diagonal:
            a = torch.einsum("lnjd,ldj->lnj", k.reshape(L, N, J, K // J), self.w_a.to(dtype))
            a = a + self.b_a.to(dtype).unsqueeze(1)
        else:
            a = torch.baddbmm(self.b_a.to(dtype).unsqueeze(1), k, self.w_a.to(dtype))  # [L, N, J]
        p = torch.softmax(a.to(acc), dim=0)
        out = (p.unsqueeze(-1) * y[..., K:].to(acc).reshape(L, N, J, C)).sum((0, 2)) + b_o
        return out.reshape(*lead, C)

    def extra_repr(self) -> str:
        return (f"mode={self.mode!r}, layers={self.layers}, num_heads={self.num_heads}, "
                f"key_size={self.key_size}, out_features={self.out_features}")
