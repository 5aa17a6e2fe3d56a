"""mhmla-fast: fused multi-head multi-layer attention over BERT-like encoders.

``c = concat_j sum_l softmax_l(a^{l,j}) v^{l,j}`` over an encoder's stacked hidden states;
see :func:`layer_attention` and :class:`FusedLayerAttention`.
"""

from .functional import layer_attention
from .modules.layer_attention import FusedLayerAttention

__all__ = ["layer_attention", "FusedLayerAttention"]
__version__ = "0.1.0"
