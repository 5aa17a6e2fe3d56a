"""mhmla-fast: fused multi-head multi-layer attention over BERT-like encoders.

``c = concat_j sum_l softmax_l(a^{l,j}) v^{l,j}`` over an encoder's stacked hidden states;
see :func:`layer_attention` and :class:`FusedLayerAttention`.

Both are imported on first use (PEP 562), so that importing a submodule that needs no torch,
e.g. the ``mhmla-serve`` command line or the ONNX Runtime path, does not pay for torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["layer_attention", "FusedLayerAttention"]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from .functional import layer_attention
    from .modules.layer_attention import FusedLayerAttention


def __getattr__(name: str) -> Any:
    if name == "layer_attention":
        from .functional import layer_attention

        return layer_attention
    if name == "FusedLayerAttention":
        from .modules.layer_attention import FusedLayerAttention

        return FusedLayerAttention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
