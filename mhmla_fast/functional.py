"""The functional API of multi-head multi-layer attention: validation and backend dispatch."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch
from torch import Tensor

from .dispatch import BACKENDS, fused_unsupported, layer_attention_kernels, triton_missing
from .reference import layer_attention_reference

__all__ = ["layer_attention", "check_layers", "BACKENDS"]


def _shape(t: Tensor) -> list[int]:
    return list(t.shape)


def _stack_hidden(hidden: Tensor | Sequence[Tensor]) -> Tensor:
    if isinstance(hidden, Tensor):
        if hidden.dim() < 2:
            raise ValueError(
                f"hidden: expected a tensor [L, *, H] (at least 2 dims) or a sequence of L "
                f"tensors [*, H], got a tensor of shape {_shape(hidden)}"
            )
        return hidden
    if not isinstance(hidden, Sequence) or isinstance(hidden, (str, bytes)):
        raise ValueError(f"hidden: expected a tensor or a sequence of tensors, got {type(hidden)!r}")
    _check_same_layers(hidden)
    return torch.stack(list(hidden), dim=0)


def _check_same_layers(hidden: Sequence[Tensor]) -> None:
    """ValueError unless ``hidden`` is L >= 1 tensors [*, H] of one shape, dtype and device."""
    if len(hidden) == 0:
        raise ValueError("hidden: empty sequence of layers (L = 0)")
    for i, t in enumerate(hidden):
        if not isinstance(t, Tensor):
            raise ValueError(f"hidden[{i}]: expected a tensor, got {type(t)!r}")
        if t.dim() < 1 or t.shape != hidden[0].shape:
            raise ValueError(
                f"hidden[{i}]: every layer must have the same shape [*, H]; hidden[0] is "
                f"{_shape(hidden[0])}, hidden[{i}] is {_shape(t)}"
            )
        if t.dtype != hidden[0].dtype or t.device != hidden[0].device:
            raise ValueError(
                f"hidden[{i}]: dtype/device {t.dtype}/{t.device} differs from hidden[0]'s "
                f"{hidden[0].dtype}/{hidden[0].device}"
            )


def check_layers(layers: Sequence[Tensor], hidden_size: int) -> None:
    """ValueError naming ``hidden`` unless ``layers`` (the selected layers, L >= 1 tensors
    [*, H]) share one shape, dtype and device, are floating point, hold at least one token,
    and have H = ``hidden_size``: the checks :func:`layer_attention` makes, for the paths
    that do not call it (the AvgL and last-layer modes, the folded head)."""
    _check_same_layers(layers)
    first = layers[0]
    if first.numel() == 0:
        raise ValueError(f"hidden: empty input of layers of shape {_shape(first)} (tokens and "
                         "H must be > 0)")
    if not first.dtype.is_floating_point:
        raise ValueError(f"hidden: expected a floating-point dtype, got {first.dtype}")
    if first.shape[-1] != hidden_size:
        raise ValueError(f"hidden: expected layers [*, H] with H = {hidden_size} (the head's "
                         f"hidden_size), got {_shape(first)}")


def _check(
    hidden: Tensor, params: dict[str, Tensor], num_heads: int, block_diagonal: bool,
    rates: dict[str, float], backend: str,
) -> tuple[int, int, int, int]:
    L, H = hidden.shape[0], hidden.shape[-1]
    N = math.prod(hidden.shape[1:-1])
    if L == 0 or N == 0 or H == 0:
        raise ValueError(f"hidden: empty input of shape {_shape(hidden)} (L, tokens and H must be > 0)")
    if not hidden.dtype.is_floating_point:
        raise ValueError(f"hidden: expected a floating-point dtype, got {hidden.dtype}")
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads: expected a positive int, got {num_heads!r}")
    J = num_heads
    if H % J:
        raise ValueError(f"num_heads: H = {H} (hidden {_shape(hidden)}) is not divisible by J = {J}")
    w_k = params["w_k"]
    if not isinstance(w_k, Tensor):
        raise ValueError(f"w_k: expected a tensor, got {type(w_k)!r}")
    if w_k.dim() != 3:
        raise ValueError(f"w_k: expected shape [L, H, K] = [{L}, {H}, K], got {_shape(w_k)}")
    K = w_k.shape[2]
    if block_diagonal and K % J:
        raise ValueError(f"w_k: block-diagonal scoring needs K = {K} divisible by J = {J}")
    Ka = K // J if block_diagonal else K
    expected = {
        "w_v": (L, H, H), "b_v": (L, H), "w_k": (L, H, K), "b_k": (L, K),
        "w_a": (L, Ka, J), "b_a": (L, J),
    }
    dtype, device = hidden.dtype, hidden.device
    for name, t in params.items():
        if not isinstance(t, Tensor):
            raise ValueError(f"{name}: expected a tensor, got {type(t)!r}")
        if t.shape != expected[name]:  # torch.Size against a tuple: no lists on the hot path
            letters = {
                "w_v": "[L, H, H]", "b_v": "[L, H]", "w_k": "[L, H, K]", "b_k": "[L, K]",
                "w_a": "[L, K/J, J]" if block_diagonal else "[L, K, J]", "b_a": "[L, J]",
            }
            raise ValueError(
                f"{name}: expected shape {letters[name]} = {list(expected[name])} for hidden "
                f"{_shape(hidden)} and J = {J}, got {_shape(t)}"
            )
        if t.dtype != dtype:
            raise ValueError(f"{name}: dtype {t.dtype} differs from hidden's {dtype}")
        if t.device != device:
            raise ValueError(f"{name}: device {t.device} differs from hidden's {device}")
    for name, rate in rates.items():
        if isinstance(rate, bool) or not isinstance(rate, numbers.Real) or not 0.0 <= rate < 1.0:
            raise ValueError(f"{name}: expected a rate in [0, 1), got {rate!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    return L, N, H, K


def _autocast_dtype(t: Tensor) -> torch.dtype | None:
    """The dtype autocast gives matmuls on ``t``'s device, when autocast is on there and ``t``
    is float32 (an encoder's hidden states under autocast are: its LayerNorms run in float32);
    else None."""
    if t.dtype is not torch.float32:
        return None
    device_type = t.device.type
    try:
        if not torch.is_autocast_enabled(device_type):
            return None
        dtype = torch.get_autocast_dtype(device_type)
    except RuntimeError:  # a device type autocast does not know (meta, lazy): none there
        return None
    return None if dtype is torch.float32 else dtype


def _block_diagonal_dense(w_a: Tensor) -> Tensor:
    """[L, K/J, J] per-head scorers -> the equivalent dense [L, K, J] (zeros off the blocks)."""
    L, Kj, J = w_a.shape
    eye = torch.eye(J, dtype=w_a.dtype, device=w_a.device)
    return torch.einsum("ldj,ji->ljdi", w_a, eye).reshape(L, J * Kj, J)


def layer_attention(
    hidden: Tensor | Sequence[Tensor],
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
    return_weights: bool = False,
    backend: str = "auto",
    block_diagonal: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Multi-head multi-layer attention (Kaneko & Komachi 2019, Eqs. 4-9).

    For each token, layer l = 1..L and head j = 1..J (D = H / J)::

        v^l = h^l W_v^l + b_v^l,   k^l = relu(h^l W_k^l + b_k^l),   a^l = k^l W_a^l + b_a^l
        p^{l,j} = exp(a^{l,j}) / sum_t exp(a^{t,j}),   c = concat_j sum_l p^{l,j} v^{l,j}

    With ``block_diagonal=True`` head j scores only from its own slice of k^l
    (``w_a`` [L, K/J, J]). In training, dropout is applied to h^l (one mask for both
    projections), to k^l and to p (not renormalised), at the given rates.

    Args:
        hidden: [L, *, H] tensor, or a sequence of L tensors [*, H] (for example the
            selected entries of Hugging Face's ``hidden_states`` tuple); any leading dims.
        w_v: [L, H, H], b_v: [L, H]: value projections (Eq. 4).
        w_k: [L, H, K], b_k: [L, K]: key projections (Eq. 5).
        w_a: [L, K, J] ([L, K/J, J] block-diagonal), b_a: [L, J]: scorers (Eq. 6).
        num_heads: J; must divide H.
        dropout_h, dropout_k, dropout_p: dropout rates, used only when ``training``.
        training: apply dropout.
        return_weights: also return the layer weights p.
        backend: "torch" (eager reference, any device), "triton" (fused kernels: CUDA, or
            CPU under TRITON_INTERPRET=1), "auto" (per device and direction, the
            implementation measured fastest: ``mhmla_fast.dispatch.AUTO_KERNELS``).
        block_diagonal: per-head scoring from the head's own K/J slice of the keys.

    Returns:
        c: [*, H] in the input dtype (autocast's, see below; Eq. 9); with ``return_weights`` also
        p: [*, L, J] float32 (float64 for float64 input), the softmax weights before
        attention dropout.

    Under ``torch.autocast``, float32 inputs run in autocast's dtype on both backends (the
    eager reference through autocast's own matmuls, the fused kernels on inputs cast to it),
    and c comes out in that dtype.

    The fused backward is differentiable once: a backward with ``create_graph=True`` raises
    with "triton" and runs the eager reference's with "auto" (on the same dropout masks).
    While a graph is captured for every input shape (``torch.export``, ``torch.jit.trace``)
    or under ``torch.func`` transforms, "auto" runs eager and "triton" is refused where its
    launchers cannot run (:func:`mhmla_fast.dispatch.graph_capture`).

    All tensors must share dtype and device; bad shapes, dtypes, devices, rates or flags that
    are not bools raise ValueError naming the argument. A token whose inputs are non-finite
    gives non-finite outputs for that token only.
    """
    for name, flag in (("training", training), ("return_weights", return_weights),
                       ("block_diagonal", block_diagonal)):
        if not isinstance(flag, bool):  # ("no" would be true)
            raise ValueError(f"{name}: expected a bool, got {flag!r}")
    hidden = _stack_hidden(hidden)
    params = {"w_v": w_v, "b_v": b_v, "w_k": w_k, "b_k": b_k, "w_a": w_a, "b_a": b_a}
    rates = {"dropout_h": dropout_h, "dropout_k": dropout_k, "dropout_p": dropout_p}
    L, N, H, K = _check(hidden, params, num_heads, block_diagonal, rates, backend)
    lead = hidden.shape[1:-1]
    flat = hidden.reshape(L, N, H)
    needs_grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (flat, *params.values()))
    # the dtype the GEMMs run in (eager's autocast handles itself: asked only for the others)
    compute = (_autocast_dtype(flat) if backend != "torch" else None) or flat.dtype
    unsupported = fused_unsupported(flat.device.type, compute, H, K)  # "triton" raises it
    kernels = layer_attention_kernels(backend, flat.device, needs_grad, work=L * N * H * (H + K),
                                      unsupported=unsupported, dtype=compute)
    dropout = tuple(float(r) if training else 0.0 for r in rates.values())
    if kernels == ("torch", "torch"):
        c, p = layer_attention_reference(
            flat, w_v, b_v, w_k, b_k, w_a, b_a, num_heads,
            dropout_h=dropout[0], dropout_k=dropout[1], dropout_p=dropout[2],
            training=training, block_diagonal=block_diagonal,
        )
    else:
        try:
            from mhmla_fast.kernels.layer_attention import layer_attention_triton
        except ImportError:
            if (missing := triton_missing()) is not None:
                raise ValueError(missing) from None
            raise

        if compute is not flat.dtype:  # under autocast: its dtype, as the eager matmuls take
            flat = flat.to(compute)
            w_v, b_v, w_k, b_k, w_a, b_a = (t.to(compute) for t in (w_v, b_v, w_k, b_k, w_a, b_a))
        if block_diagonal:
            w_a = _block_diagonal_dense(w_a)
        c, p = layer_attention_triton(flat, w_v, b_v, w_k, b_k, w_a, b_a, num_heads,
                                      dropout=dropout, kernels=kernels,
                                      second_order="torch" if backend == "auto" else "raise")
    c = c.reshape(*lead, H)
    if not return_weights:
        return c
    return c, p.permute(1, 0, 2).reshape(*lead, L, num_heads)
