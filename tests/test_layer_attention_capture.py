"""The op under captures that trace it for every input shape: ``torch.export``, the ONNX
exporters, ``torch.jit.trace`` and ``torch.func`` transforms (``mhmla_fast.dispatch``'s
module doc): ``auto`` runs eager there, ``"triton"`` is refused where its launchers cannot run,
and every accepted capture computes what eager computes."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import mhmla_fast.dispatch as dispatch
from mhmla_fast import FusedLayerAttention, layer_attention

needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the fused kernels on the CPU need "
    "TRITON_INTERPRET=1 set before import")
SHAPES = [(3, 16, 16), (3, 16), (3, 16, 8), (3, 8), (3, 8, 2), (3, 2)]


def weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) * 0.3 for s in SHAPES]


class Call(torch.nn.Module):
    """A module whose forward takes the hidden states only (what tracers take best)."""

    def __init__(self, head):
        super().__init__()
        self.head = head

    def forward(self, x):
        return self.head(x)


@pytest.fixture
def fused_auto_on_cpu(monkeypatch):
    """CUDA's kind of rule on the CPU (the interpreter): auto takes the fused forward from a
    work of 3 x 64 x 16 x 24 (N = 64 tokens) up, so that a rule on N is there to be guarded."""
    monkeypatch.setitem(dispatch.AUTO_KERNELS, "cpu", dispatch.AutoRule(
        forward="triton", backward="triton", min_fused_work=3 * 64 * 16 * 24,
        min_fused_backward_work=1 << 60))


@needs_interpreter
def test_auto_exports_one_eager_graph_for_every_number_of_tokens(fused_auto_on_cpu):
    """A rule on the number of tokens under a dynamic N was a guard torch.export refuses
    ("Constraints violated"); while exporting, auto runs eager for every N, and the exported
    program equals eager on both sides of the rule's threshold."""
    head = FusedLayerAttention(16, 3, 2, key_size=8, backend="auto").eval()
    eager = FusedLayerAttention(16, 3, 2, key_size=8, backend="torch").eval()
    eager.load_state_dict(head.state_dict())
    with torch.no_grad():
        ep = torch.export.export(Call(head), (torch.randn(4, 2, 20, 16),),
                                 dynamic_shapes=({2: torch.export.Dim("T", min=2, max=4096)},))
        assert not any("mhmla" in str(n.target) for n in ep.graph.nodes)
        for tokens in (7, 300):  # N = 14 (eager outside the export) and 600 (fused there)
            x = torch.randn(4, 2, tokens, 16)
            torch.testing.assert_close(ep.module()(x), eager(x), rtol=1e-5, atol=1e-6)
    x = torch.randn(4, 2, 300, 16)
    with torch.no_grad():  # outside the export the rule still takes the fused forward
        assert dispatch.layer_attention_kernels("auto", x.device, work=3 * 600 * 16 * 24)[0] == (
            "triton")


@needs_interpreter
def test_triton_exports_its_custom_op():
    head = FusedLayerAttention(16, 3, 2, key_size=8, backend="triton").eval()
    x = torch.randn(4, 2, 9, 16)
    with torch.no_grad():
        ep = torch.export.export(Call(head), (x,))
        assert any("mhmla_fast" in str(n.target) for n in ep.graph.nodes)
        torch.testing.assert_close(ep.module()(x), head(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["auto", "torch",
                                     pytest.param("triton", marks=needs_interpreter)])
def test_jit_trace_runs_eager_and_refuses_the_fused_kernels(backend):
    """torch.jit.trace (and the legacy ONNX exporter built on it) handed the launchers
    traced sizes (AttributeError 'bit_length'); auto traces eager, "triton" is refused by name."""
    head = FusedLayerAttention(16, 3, 2, key_size=8, backend=backend).eval()
    x = torch.randn(4, 2, 5, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if backend == "triton":
            with pytest.raises(ValueError, match="cannot run under torch.jit.trace"):
                torch.jit.trace(Call(head), (x,))
            return
        traced = torch.jit.trace(Call(head), (x,))
    y = torch.randn(4, 2, 7, 16)
    torch.testing.assert_close(traced(y), head(y), rtol=1e-5, atol=1e-6)


def test_the_legacy_onnx_exporter_takes_the_module_itself(tmp_path):
    """torch.onnx.export(dynamo=False) of FusedLayerAttention traced return_weights' default as
    a tensor, which the op refused ("expected a bool, got tensor(False)"); the export runs and
    ONNX Runtime gives eager's output."""
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    head = FusedLayerAttention(16, 3, 2, key_size=8, backend="auto").eval()
    x = torch.randn(4, 2, 5, 16)
    path = tmp_path / "head.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(head, (x,), str(path), dynamo=False, input_names=["h"],
                          output_names=["c"])
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (got,) = session.run(["c"], {"h": x.numpy()})
    torch.testing.assert_close(torch.from_numpy(got), head(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["auto", pytest.param("triton", marks=needs_interpreter)])
def test_vmap_runs_eager_and_refuses_the_fused_kernels(backend, fused_auto_on_cpu):
    """Under torch.func.vmap the launchers met batched tensors ("Cannot access storage of
    BatchedTensorImpl"); auto maps eager (equal to a loop), "triton" is refused by name."""
    w = weights()
    xs = torch.randn(2, 3, 100, 16)  # N = 100: the fused forward outside the transform
    f = torch.func.vmap(lambda h: layer_attention(h, *w, 2, backend=backend))
    if backend == "triton":
        with pytest.raises(ValueError, match="cannot run under a torch.func transform"):
            f(xs)
        return
    looped = torch.stack([layer_attention(h, *w, 2, backend="torch") for h in xs])
    torch.testing.assert_close(f(xs), looped, rtol=1e-5, atol=1e-6)


@needs_interpreter
def test_meta_tensors_take_the_fused_ops_shapes():
    """Meta tensors went to the launchers ("Cannot copy out of meta tensor"); they take the
    custom ops' fake implementations: the shapes and dtype of a real call."""
    w = [t.to("meta") for t in weights()]
    c, p = layer_attention(torch.empty(3, 5, 16, device="meta"), *w, 2, backend="triton",
                           return_weights=True)
    assert (c.device.type, tuple(c.shape), c.dtype) == ("meta", (5, 16), torch.float32)
    assert tuple(p.shape) == (5, 3, 2)
