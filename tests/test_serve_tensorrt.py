"""The TensorRT path: its TensorRT-free parts (profile planning and choice, batch splitting,
engine metadata, error messages, the plugin ONNX graph and the plugin's forward body) are
tested everywhere; building and running engines needs TensorRT and a CUDA GPU and is
skipped with that reason where they are missing (TensorRT only installs from NVIDIA's
index, with a GPU driver)."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import torch

from mhmla_fast.serve import tensorrt_engine as te
from mhmla_fast.serve.tensorrt_engine import (
    ShapeProfile, check_engine_compatible, choose_profile, engine_meta, plan_calls,
    plan_profiles, read_engine_meta, write_engine_meta,
)

HAS_TRITON_DEVICE = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def needs_tensorrt():
    """Skip unless TensorRT and a CUDA GPU are both there."""
    pytest.importorskip("tensorrt", reason="TensorRT is not installed (NVIDIA's index only; "
                        "needs a CUDA GPU): engine build and run are untested here")
    if not torch.cuda.is_available():
        pytest.skip("TensorRT engines need a CUDA GPU")


# ------------------------------------------------------------------ profiles


def test_default_profiles_bucket_sequences_under_the_engine_token_budget():
    profiles = plan_profiles()  # Engine's defaults: 256 rows, 8192 pieces, 512 positions
    assert [p.to_json() for p in profiles] == [
        {"min": [1, 1], "opt": [128, 64], "max": [256, 64]},
        {"min": [1, 65], "opt": [64, 128], "max": [126, 128]},
        {"min": [1, 129], "opt": [32, 256], "max": [63, 256]},
        {"min": [1, 257], "opt": [16, 512], "max": [31, 512]},
    ]
    # every batch the engine can form (rows * T <= 8192, rows <= 256) has one profile
    for T in range(1, 513):
        rows = min(256, 8192 // T)
        best = choose_profile(profiles, rows, T)
        assert best is not None and profiles[best].fits(rows, T)
        assert plan_calls(profiles, rows, T) == [(0, rows, best)]


def test_profile_planning_edge_cases():
    (only,) = plan_profiles(8, 64)
    assert only == ShapeProfile((1, 1), (8, 64), (8, 64))  # budget 8192 // 64 = 128 > 8 rows
    assert [p.max for p in plan_profiles(8, 100)] == [(8, 64), (8, 100)]
    assert [p.max[1] for p in plan_profiles(4, 300, min_bucket=16)] == [16, 32, 64, 128, 256, 300]
    unbounded = plan_profiles(32, 512, token_budget=None)
    assert all(p.opt[0] == p.max[0] == 32 for p in unbounded)
    assert [p.min[1] for p in unbounded] == [1, 65, 129, 257]
    tight = plan_profiles(256, 512, token_budget=100)
    assert tight[-1].max[0] == 1 and tight[0].max[0] == 100
    for bad in (dict(max_batch=0), dict(max_sequence=0), dict(min_bucket=0),
                dict(token_budget=0)):
        with pytest.raises(ValueError):
            plan_profiles(**{"max_batch": 4, "max_sequence": 64, **bad})


def test_shape_profile_validates_and_round_trips():
    p = ShapeProfile([1, 2], (3, 4), (5, 6))
    assert p.min == (1, 2) and p.fits(5, 6) and not p.fits(6, 6) and not p.fits(1, 1)
    assert ShapeProfile.from_json(json.loads(json.dumps(p.to_json()))) == p
    with pytest.raises(ValueError, match="min <= opt <= max"):
        ShapeProfile((1, 8), (1, 4), (1, 16))
    with pytest.raises(ValueError, match=">= 1"):
        ShapeProfile((0, 1), (1, 1), (1, 1))


def test_choose_profile_takes_the_tightest_fit():
    wide = ShapeProfile((1, 1), (8, 512), (64, 512))
    short = ShapeProfile((1, 1), (8, 64), (64, 64))
    small = ShapeProfile((1, 1), (4, 64), (8, 64))
    profiles = [wide, short, small]
    assert choose_profile(profiles, 4, 30) == 2  # shortest sequence, then fewest rows
    assert choose_profile(profiles, 9, 30) == 1
    assert choose_profile(profiles, 9, 65) == 0
    assert choose_profile(profiles, 65, 10) is None
    assert choose_profile(profiles, 1, 513) is None


def test_plan_calls_splits_rows_that_no_profile_takes_at_once():
    profiles = plan_profiles()
    calls = plan_calls(profiles, 300, 10)
    assert calls == [(0, 256, 0), (256, 300, 0)]
    calls = plan_calls(profiles, 100, 300)
    assert [(a, b) for a, b, _ in calls] == [(0, 31), (31, 62), (62, 93), (93, 100)]
    assert {p for _, _, p in calls} == {3}
    rows = [r for a, b, _ in calls for r in range(a, b)]
    assert rows == list(range(100)), "every row exactly once, in order"
    with pytest.raises(ValueError, match="sequence length 600 is outside .* max_sequence"):
        plan_calls(profiles, 1, 600)
    with pytest.raises(ValueError, match="empty"):
        plan_calls(profiles, 0, 10)


# ------------------------------------------------------------------ metadata


def make_meta(**kw):
    base = dict(onnx_path="/x/model.onnx", profiles=plan_profiles(16, 128), fp16=True,
                bf16=False, workspace=1 << 30, plugin=False, tensorrt_version="10.9.0",
                device_name="NVIDIA H100", capability=(9, 0))
    base.update(kw)
    return engine_meta(**base)


def test_engine_metadata_round_trips_next_to_the_plan(tmp_path):
    plan = tmp_path / te.PLAN_FILE
    path = write_engine_meta(plan, make_meta())
    assert path.name == "model.plan.json" and te.meta_path(plan) == path
    raw = json.loads(path.read_text())
    assert raw["onnx"] == "model.onnx" and raw["precision"] == {"fp16": True, "bf16": False}
    assert raw["profiles"][0] == {"min": [1, 1], "opt": [16, 64], "max": [16, 64]}
    assert raw["device"] == {"name": "NVIDIA H100", "capability": [9, 0]}
    meta = read_engine_meta(plan)
    assert meta["profiles"] == plan_profiles(16, 128)
    assert meta["tensorrt"] == "10.9.0" and meta["layer_attention_plugin"] is False

    with pytest.raises(FileNotFoundError, match="rebuild the engine"):
        read_engine_meta(tmp_path / "other.plan")
    path.write_text(json.dumps({**raw, "format": "something-else"}))
    with pytest.raises(ValueError, match="not an mhmla TensorRT engine"):
        read_engine_meta(plan)


def test_engines_are_refused_on_another_gpu_or_tensorrt():
    meta = make_meta()
    check_engine_compatible(meta, tensorrt_version="10.9.0", capability=(9, 0))
    with pytest.raises(RuntimeError, match=r"TensorRT 10\.9\.0, running 10\.10\.0.*Rebuild"):
        check_engine_compatible(meta, tensorrt_version="10.10.0", capability=(9, 0))
    with pytest.raises(RuntimeError, match=r"capability \[9, 0\] \(NVIDIA H100\), running \[8"):
        check_engine_compatible(meta, tensorrt_version="10.9.0", capability=(8, 0))


def test_tensorrt_dtypes_map_to_torch():
    assert te._torch_dtype("INT64") is torch.int64 and te._torch_dtype("FLOAT") is torch.float32
    assert te._torch_dtype("HALF") is torch.float16 and te._torch_dtype("BF16") is torch.bfloat16
    with pytest.raises(ValueError, match="unsupported"):
        te._torch_dtype("FP8")


# ------------------------------------------------------- without TensorRT


def test_missing_tensorrt_is_a_clear_runtime_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # as if not installed
    for call in (te.import_tensorrt, te.has_plugin_api, te.register_layer_attention_plugin,
                 lambda: te.build_engine(tmp_path / "model.onnx", tmp_path / "model.plan"),
                 lambda: te.TensorRTRunner(tmp_path / "model.plan")):
        with pytest.raises(RuntimeError, match=r"^TensorRT is not installed: .*pip install"):
            call()


def test_an_onnx_reexport_knows_the_engine_files_it_makes_stale():
    from mhmla_fast.serve.onnx_export import TENSORRT_FILES

    assert set(TENSORRT_FILES) == {te.PLAN_FILE, te.meta_path(te.PLAN_FILE).name,
                                   te.PLUGIN_ONNX_FILE}


def test_missing_engine_says_how_to_build_it(tmp_path):
    from mhmla_fast.serve.runners import make_runner

    with pytest.raises(FileNotFoundError, match=r"model\.plan is missing.*mhmla-serve export "
                       r"--onnx .*build_engine_dir"):
        make_runner(tmp_path, backend="tensorrt")
    (tmp_path / "model.onnx").write_bytes(b"")
    with pytest.raises(FileNotFoundError) as err:
        te.TensorRTRunner.from_model_dir(tmp_path)
    assert "export --onnx" not in str(err.value) and "build_engine_dir" in str(err.value)
    with pytest.raises(FileNotFoundError, match="export the tagger first"):
        te.build_engine_dir(tmp_path / "elsewhere")


# ------------------------------------------------- the plugin graph and kernel


@pytest.fixture(scope="module")
def tagger_dir(tiny_tagger_dir):
    pytest.importorskip("onnx", reason="the ONNX export needs onnx")
    return tiny_tagger_dir  # conftest's


def test_plugin_onnx_has_one_layer_attention_node_that_computes_the_head(tagger_dir, tmp_path):
    """The custom node, evaluated with the eager reference by ONNX's reference evaluator,
    gives the tagger's probabilities: inputs are wired in the plugin's order and shapes."""
    import onnx
    from onnx.reference import ReferenceEvaluator
    from onnx.reference.op_run import OpRun

    from mhmla_fast.reference import layer_attention_reference
    from mhmla_fast.serve.runners import TorchRunner

    path = te.export_plugin_onnx(tagger_dir, tmp_path / te.PLUGIN_ONNX_FILE)
    model = onnx.load(str(path))
    (node,) = [n for n in model.graph.node if n.domain == "mhmla_fast"]
    assert node.op_type == "layer_attention" and len(node.input) == 7
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs == {"num_heads": 4, "plugin_namespace": b"mhmla_fast"}
    assert [i.name for i in model.graph.input] == ["input_ids", "attention_mask"]
    assert te._has_plugin_node(path)

    class layer_attention(OpRun):  # noqa: N801 (named after the ONNX op)
        op_domain = "mhmla_fast"

        def _run(self, *tensors, num_heads=None, plugin_namespace=None):
            t = [torch.tensor(np.asarray(x)) for x in tensors]
            assert t[0].dim() == 3 and t[1].shape == (2, 32, 32) and t[5].shape == (2, 32, 4)
            return (layer_attention_reference(*t, num_heads)[0].numpy(),)

    class GatherElements(OpRun):  # onnx's reference GatherElements mis-reshapes here
        def _run(self, data, indices, axis=None):
            return (np.take_along_axis(data, indices, axis=axis),)

    evaluator = ReferenceEvaluator(model, new_ops=[layer_attention, GatherElements])
    ids = np.random.default_rng(0).integers(1, 30000, (3, 11))
    mask = np.ones_like(ids)
    mask[1, 6:] = 0
    mask[2, 1:] = 0
    got = evaluator.run(None, {"input_ids": ids, "attention_mask": mask})[0]
    ref = TorchRunner(tagger_dir, device="cpu")(ids, mask)
    real = mask.astype(bool)
    assert got.shape == ids.shape
    assert np.abs(got[real] - ref[real]).max() <= 1e-5


def test_plugin_onnx_needs_a_layer_attention_head(tagger_dir, tmp_path):
    from test_serve_onnx import make_tagger

    last = make_tagger(tagger_dir, tmp_path / "last", head="last")
    with pytest.raises(ValueError, match="'last' has no layer attention"):
        te.export_plugin_onnx(last, tmp_path / "x.onnx")


@pytest.mark.skipif(not HAS_TRITON_DEVICE,
                    reason="Triton kernels need CUDA or TRITON_INTERPRET=1 set before import")
def test_plugin_forward_body_matches_the_reference():
    from mhmla_fast.reference import layer_attention_reference

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    L, N, H, K, J = 3, 37, 32, 32, 4
    shapes = [(L, N, H), (L, H, H), (L, H), (L, H, K), (L, K), (L, K, J), (L, J)]
    args = [(torch.randn(*s, generator=g) * 0.3).to(device) for s in shapes]
    out = torch.empty(N, H, device=device)
    te.layer_attention_plugin_forward(*args, J, out)
    ref = layer_attention_reference(*args, J)[0]
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------- with TensorRT (skipped here)


@pytest.fixture(scope="module")
def export_dir(tagger_dir, tmp_path_factory):
    needs_tensorrt()  # before the export, so the skip costs nothing
    from mhmla_fast.serve.onnx_export import export_onnx

    out = tmp_path_factory.mktemp("trt") / "engine"
    export_onnx(tagger_dir, out)
    return out


@pytest.mark.parametrize("plugin", [False, True], ids=["standard-ops", "plugin"])
def test_engine_matches_onnx_runtime(export_dir, plugin):
    if plugin and not te.has_plugin_api():
        pytest.skip("this TensorRT has no tensorrt.plugin (needs >= 10.7)")
    from mhmla_fast.serve.onnx_export import OnnxRunner, validation_batches

    plan = te.build_engine_dir(export_dir, layer_attention_plugin=plugin, max_batch=8,
                               workspace=1 << 28)
    meta = read_engine_meta(plan)
    assert meta["layer_attention_plugin"] is plugin and meta["profiles"][-1].max == (8, 64)
    runner = te.TensorRTRunner.from_model_dir(export_dir)
    ref = OnnxRunner.from_model_dir(export_dir)
    for ids, mask in validation_batches(64, 30522, seed=3,
                                        shapes=[(1, 1), (3, 17), (8, 64), (20, 40)]):
        got, want = runner(ids, mask), ref(ids, mask)
        real = mask.astype(bool)
        assert got.shape == ids.shape and got.dtype == np.float32
        assert np.abs(got[real] - want[real]).max() <= 2e-3  # TF32 may be on in TensorRT


def test_a_plan_is_held_to_the_dtype_and_kernels_it_was_built_with(tmp_path, monkeypatch):
    """dtype and kernels are checked against model.plan.json before TensorRT is imported."""
    meta = {"precision": {"fp16": False, "bf16": True}, "layer_attention_plugin": False}
    assert te.plan_precisions(meta) == ("bfloat16",)
    assert te.plan_precisions({"precision": {}}) == ("float32",)
    te.check_plan_options(meta, dtype=None, kernels="auto")
    te.check_plan_options(meta, dtype="bfloat16", kernels="torch")
    with pytest.raises(ValueError, match=r"^dtype: this tensorrt plan was built for bfloat16, "
                                         r"not 'float32'.*--precision fp32"):
        te.check_plan_options(meta, dtype="float32")
    with pytest.raises(ValueError, match=r"^kernels: 'triton' with the tensorrt backend needs "
                                         r"a plan built with the layer-attention plugin"):
        te.check_plan_options(meta, dtype=None, kernels="triton")
    with pytest.raises(ValueError, match=r"^kernels: 'torch' with the tensorrt backend"):
        te.check_plan_options(dict(meta, layer_attention_plugin=True), dtype=None,
                              kernels="torch")

    from mhmla_fast.serve.runners import make_runner

    monkeypatch.setitem(sys.modules, "tensorrt", None)  # refused before TensorRT is needed
    (tmp_path / te.PLAN_FILE).write_bytes(b"")
    te.write_engine_meta(tmp_path / te.PLAN_FILE, te.engine_meta(
        onnx_path="model.onnx", profiles=[te.ShapeProfile((1, 1), (8, 64), (8, 64))],
        fp16=True, bf16=False, workspace=1 << 20, plugin=False, tensorrt_version="10.7",
        device_name="NVIDIA H100", capability=(9, 0)))
    with pytest.raises(ValueError, match=r"^dtype: this tensorrt plan was built for float16"):
        make_runner(tmp_path, backend="tensorrt", dtype="bfloat16")
    with pytest.raises(ValueError, match=r"^device: the tensorrt backend runs on CUDA"):
        make_runner(tmp_path, backend="tensorrt", device="cpu")
    with pytest.raises(RuntimeError, match="TensorRT is not installed"):  # options fine
        make_runner(tmp_path, backend="tensorrt", dtype="float16")
