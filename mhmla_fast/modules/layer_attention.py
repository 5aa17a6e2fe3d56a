"""``FusedLayerAttention``: a drop-in module over an encoder's hidden states."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..configs import MODES, LayerAttentionConfig
from ..dispatch import triton_missing
from ..functional import BACKENDS, check_layers, layer_attention

__all__ = ["FusedLayerAttention", "LayerAttentionConfig", "MODES", "select_hidden_states"]


def select_hidden_states(hidden_states: Tensor | Sequence[Tensor], num_layers: int,
                         layers: Sequence[int]) -> list[Tensor]:
    """Entries ``layers`` of an encoder's ``hidden_states`` (the HF tuple of ``num_layers + 1``
    tensors [*, H], or a tensor [num_layers + 1, *, H]); ValueError for another count or
    anything else (None: the encoder was called without ``output_hidden_states=True``)."""
    if hidden_states is None:
        raise ValueError("hidden_states: got None; call the encoder with "
                         "output_hidden_states=True")
    if not isinstance(hidden_states, (Tensor, Sequence)) or isinstance(hidden_states, (str, bytes)):
        raise ValueError(f"hidden_states: expected the encoder's hidden states (a tuple of "
                         f"tensors or one tensor), got {type(hidden_states).__name__}")
    n = len(hidden_states)
    if n != num_layers + 1:
        shape = list(hidden_states.shape) if isinstance(hidden_states, Tensor) else f"{n} tensors"
        raise ValueError(
            f"hidden_states: expected the encoder's {num_layers + 1} hidden states "
            f"(embeddings + {num_layers} layers), got {shape}"
        )
    return [hidden_states[i] for i in layers]


class FusedLayerAttention(nn.Module):
    r"""Multi-head multi-layer attention (MHMLA) over the hidden states of an encoder.

    For the selected layers l and heads j (D = H / J), per token::

        v^l = h^l W_v^l + b_v^l,   a^l = relu(h^l W_k^l + b_k^l) W_a^l + b_a^l
        c   = concat_j sum_l softmax_l(a^{l,j}) v^{l,j}                      [*, H]

    The paper's baselines are modes of the same module, so training switches by config:

    * ``"mhmla"``: J = ``num_heads`` (must divide H);
    * ``"shmla"``: a single head (J = 1);
    * ``"avgl"``: ``c = mean_l (h^l W_v^l + b_v^l)`` (averaged transformed layers, no scorer);
    * ``"last"``: ``c = h^L``, the last selected layer (plain fine-tuning; no parameters).

    Args:
        hidden_size: H.
        num_layers: the encoder's number of transformer layers; Hugging Face's
            ``hidden_states`` tuple then has ``num_layers + 1`` entries, the embeddings first.
        num_heads: J for ``"mhmla"`` (default 12, as in the paper).
        config: the head's settings, a :class:`~mhmla_fast.configs.LayerAttentionConfig`
            (validated there); or give its fields as keywords instead: ``num_heads``,
            ``key_size`` (K, default H), ``mode`` (``"mhmla"``, ``"shmla"``, ``"avgl"``,
            ``"last"``), ``layers`` (indices into the hidden-states tuple; default
            ``1..num_layers``, the embedding output excluded as in the paper;
            ``include_embeddings=True`` makes it ``0..num_layers``), ``dropout`` (on h^l, k^l
            and the layer weights p during training, paper 0.3; in ``"avgl"`` and ``"last"``
            modes on h^l only), ``block_diagonal`` (head j scores only from its own K/J slice
            of k^l).
        backend: ``"auto"`` (per device and direction the implementation measured fastest,
            see ``mhmla_fast.dispatch``), ``"torch"`` (eager), ``"triton"`` (fused; refused
            in the ``"avgl"`` and ``"last"`` modes, which have no layer attention).

    Parameters, per selected layer: ``w_v`` [L, H, H], ``b_v`` [L, H], ``w_k`` [L, H, K],
    ``b_k`` [L, K], ``w_a`` [L, K, J] ([L, K/J, J] block-diagonal), ``b_a`` [L, J]. Weights
    are initialised like ``nn.Linear`` (uniform in +-1/sqrt(fan_in)), biases to zero, so
    the initial layer weights are close to uniform. They are kept in the module's dtype and
    cast to the hidden states' dtype in ``forward`` (for example bf16 for a bf16 encoder;
    under autocast, whose hidden states are float32, the op runs in autocast's dtype).
    """

    def __init__(
        self,
        hidden_size: int,
        num_layers: int,
        num_heads: int | None = None,
        *,
        config: LayerAttentionConfig | None = None,
        backend: str = "auto",
        **settings,
    ) -> None:
        super().__init__()
        if num_heads is not None:
            settings["num_heads"] = num_heads
        if config is None:
            config = LayerAttentionConfig(**settings)
        elif settings:
            raise ValueError(f"config: given with {sorted(settings)}; pass one or the other")
        layers, heads, key_size = config.resolve(hidden_size, num_layers)
        if backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
        config.check_backend(backend)
        if backend == "triton" and (missing := triton_missing()) is not None:
            raise ValueError(missing)
        self.config = config
        self.hidden_size, self.num_layers, self.num_heads = hidden_size, num_layers, heads
        self.key_size, self.mode, self.layers = key_size, config.mode, layers
        self.dropout, self.block_diagonal = config.dropout, config.block_diagonal
        self.backend = backend
        L, H, K = len(layers), hidden_size, key_size
        mode, block_diagonal = config.mode, config.block_diagonal
        if mode in ("mhmla", "shmla", "avgl"):
            self.w_v = nn.Parameter(torch.empty(L, H, H))
            self.b_v = nn.Parameter(torch.empty(L, H))
        if mode in ("mhmla", "shmla"):
            self.w_k = nn.Parameter(torch.empty(L, H, K))
            self.b_k = nn.Parameter(torch.empty(L, K))
            self.w_a = nn.Parameter(torch.empty(L, K // heads if block_diagonal else K, heads))
            self.b_a = nn.Parameter(torch.empty(L, heads))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Weights uniform in +-1/sqrt(fan_in) (``nn.Linear``'s scale), biases zero."""
        for name, param in self.named_parameters(recurse=False):
            if name.startswith("w_"):
                bound = 1.0 / math.sqrt(param.shape[1])
                nn.init.uniform_(param, -bound, bound)
            else:
                nn.init.zeros_(param)

    def select(self, hidden_states: Tensor | Sequence[Tensor]) -> list[Tensor]:
        """The selected layers of ``hidden_states`` (the HF tuple or [num_layers + 1, *, H])."""
        return select_hidden_states(hidden_states, self.num_layers, self.layers)

    def forward(
        self, hidden_states: Tensor | Sequence[Tensor], return_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor | None]:
        """Combine the layers.

        Args:
            hidden_states: Hugging Face's ``hidden_states`` tuple (``num_layers + 1``
                tensors [*, H]) or a tensor [num_layers + 1, *, H].
            return_weights: also return the layer weights p [*, L, J] (None in the
                ``"avgl"`` and ``"last"`` modes).

        Returns:
            c [*, H] in the hidden states' dtype (and p).
        """
        if isinstance(return_weights, Tensor) and torch.jit.is_tracing():
            # the legacy ONNX exporter traces the flag's default as a tensor: a constant here
            return_weights = bool(return_weights.item())
        hs = self.select(hidden_states)
        rate = self.dropout if self.training else 0.0
        first = hs[0]
        if self.mode in ("last", "avgl") or not isinstance(first, Tensor) or (
                first.shape[-1:] != (self.hidden_size,)):
            # (layer_attention checks the rest of its input, but would blame a wrong H on w_v)
            check_layers(hs, self.hidden_size)
        if self.mode == "last":
            c = F.dropout(hs[-1], rate, training=self.training)
            return (c, None) if return_weights else c
        dtype = hs[0].dtype
        w_v, b_v = self.w_v.to(dtype), self.b_v.to(dtype)
        if self.mode == "avgl":
            h = torch.stack(hs, 0)
            lead = h.shape[1:-1]
            h = F.dropout(h.reshape(h.shape[0], -1, h.shape[-1]), rate, training=self.training)
            c = torch.baddbmm(b_v.unsqueeze(1), h, w_v).mean(0).reshape(*lead, -1)
            return (c, None) if return_weights else c
        return layer_attention(
            hs, w_v, b_v, self.w_k.to(dtype), self.b_k.to(dtype), self.w_a.to(dtype),
            self.b_a.to(dtype), self.num_heads, dropout_h=rate, dropout_k=rate, dropout_p=rate,
            training=self.training, return_weights=return_weights, backend=self.backend,
            block_diagonal=self.block_diagonal,
        )

    def extra_repr(self) -> str:
        return (
            f"mode={self.mode!r}, hidden_size={self.hidden_size}, layers={self.layers}, "
            f"num_heads={self.num_heads}, key_size={self.key_size}, dropout={self.dropout}, "
            f"block_diagonal={self.block_diagonal}, backend={self.backend!r}"
        )
