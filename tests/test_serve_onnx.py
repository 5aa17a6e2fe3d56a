"""ONNX export of a tiny random GED tagger: the export validates itself against torch, the
ONNX Runtime runner (fp32 and int8) agrees with the torch runner, a wrong graph is refused
and leaves the output directory alone, and the engine tags the same over either runner."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch

pytest.importorskip("onnx", reason="the ONNX export needs onnx (pip install onnx)")
pytest.importorskip("onnxruntime", reason="the ONNX runner needs onnxruntime")

import onnx  # noqa: E402

from mhmla_fast.ged.model import GedTagger, TaggerConfig, load_tokenizer  # noqa: E402
from mhmla_fast.serve import onnx_export  # noqa: E402
from mhmla_fast.serve.engine import Engine  # noqa: E402
from mhmla_fast.serve.onnx_export import (  # noqa: E402
    ExportValidationError, Int8Tolerance, OnnxRunner, export_onnx, validation_batches,
)
from mhmla_fast.serve.runners import TorchRunner, make_runner  # noqa: E402

MAX_POSITIONS = 64
TEXTS = [
    "He go to school every day .",
    "They goes to the house and she see the dog .",
    "A cat .",
    "We went home , but the school was closed because of the snow and every dog in the "
    "house was barking at the postman who delivers letters every single morning .",
]


def make_tagger(tiny_tagger_dir, out, *, head: str = "mhmla", scale: float = 15.0):
    """A tagger with a fresh random head and classifier (seed 0; classifier weights scaled by
    ``scale`` so that error probabilities spread over (0, 1)) on the tiny encoder of conftest's
    ``tiny_tagger_dir``, saved at ``out`` with its tokenizer. Milder than that tagger's x30, so
    that the int8 graph stays well inside its tolerance (Int8Tolerance)."""
    base = TaggerConfig.from_json((tiny_tagger_dir / "config.json").read_text())
    assert base.encoder_config["max_position_embeddings"] == MAX_POSITIONS
    torch.manual_seed(0)
    tagger = GedTagger(TaggerConfig(encoder=base.encoder, num_heads=4, head=head))
    with torch.no_grad():
        tagger.classifier.weight.mul_(scale)
    return tagger.save(out, tokenizer=load_tokenizer(tiny_tagger_dir))


@pytest.fixture(scope="module")
def tagger_dir(tiny_tagger_dir, tmp_path_factory):
    return make_tagger(tiny_tagger_dir, tmp_path_factory.mktemp("onnx") / "tagger")


@pytest.fixture(scope="module")
def export_dir(tagger_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "engine"
    path = export_onnx(tagger_dir, out, int8=True)
    assert path == out / "model.onnx"
    return out


def ragged(seed: int, shapes, vocab: int = 30522):
    return validation_batches(MAX_POSITIONS, vocab, 0, seed=seed, shapes=shapes)


def test_export_is_a_self_contained_validated_engine_directory(export_dir, tagger_dir):
    names = {p.name for p in export_dir.iterdir()}
    assert {"model.onnx", "model.int8.onnx", "export.json", "config.json",
            "tokenizer.json", "tokenizer_config.json"} <= names
    assert not any(n.startswith(".onnx-export-") for n in names), "staging dir removed"

    model = onnx.load(str(export_dir / "model.onnx"))
    ins = {i.name: i.type.tensor_type for i in model.graph.input}
    assert list(ins) == ["input_ids", "attention_mask"]
    for t in ins.values():
        assert t.elem_type == onnx.TensorProto.INT64
        assert [d.dim_param for d in t.shape.dim] == ["batch", "sequence"]
    (out,) = model.graph.output
    assert out.name == "error_prob"
    assert out.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert [d.dim_param for d in out.type.tensor_type.shape.dim] == ["batch", "sequence"]
    assert {op.domain for op in model.opset_import} <= {"", "ai.onnx"}
    assert not any(n.domain not in ("", "ai.onnx") for n in model.graph.node), "standard ops"

    meta = json.loads((export_dir / "export.json").read_text())
    assert meta["opset"] == 17 and meta["exporter"] == "torchscript"
    # the attention traced in transformers' eager form: no SDPA NaN guards in the graph
    assert meta["attention"] == "eager"
    assert not any(n.op_type == "IsNaN" for n in model.graph.node)
    assert {"torch", "onnx", "onnxruntime", "transformers"} <= set(meta["versions"])
    assert meta["source"]["model_dir"] == str(tagger_dir.resolve())
    val = meta["validation"]
    assert val["atol"] == 1e-4 and 0 <= val["max_abs_diff"] <= 1e-4
    shapes = [tuple(b["shape"]) for b in val["batches"]]
    assert (1, 1) in shapes and (2, MAX_POSITIONS) in shapes and (8, 16) in shapes
    q, tol = meta["int8"]["validation"], Int8Tolerance()
    assert meta["int8"]["tolerance"] == {"max_abs": tol.max_abs, "mean_abs": tol.mean_abs,
                                         "min_label_agreement": tol.min_label_agreement}
    assert meta["int8"]["per_channel"] and meta["int8"]["reduce_range"]
    assert q["atol"] == tol.max_abs and q["max_abs_diff"] <= tol.max_abs
    assert q["mean_atol"] == tol.mean_abs and q["mean_abs_diff"] <= tol.mean_abs
    assert q["min_label_agreement"] == tol.min_label_agreement
    assert tol.min_label_agreement <= q["label_agreement"] <= 1.0 and q["threshold"] == 0.5


def test_onnx_runner_matches_torch_on_ragged_batches(export_dir, tagger_dir):
    onnx_runner = make_runner(export_dir, backend="onnx")
    assert isinstance(onnx_runner, OnnxRunner) and onnx_runner.path.name == "model.onnx"
    torch_runner = TorchRunner(tagger_dir, device="cpu")
    worst = 0.0
    for ids, mask in ragged(7, [(1, 1), (5, 9), (3, MAX_POSITIONS), (16, 23)]):
        got, ref = onnx_runner(ids, mask), torch_runner(ids, mask)
        assert got.shape == ids.shape and got.dtype == np.float32
        real = mask.astype(bool)
        worst = max(worst, float(np.abs(got[real] - ref[real]).max()))
    assert worst <= 1e-4, worst

    int8 = OnnxRunner.from_model_dir(export_dir, dtype="int8")
    assert int8.path.name == "model.int8.onnx"
    ids, mask = ragged(8, [(4, 30)])[0]
    real = mask.astype(bool)
    diff = np.abs(int8(ids, mask)[real] - torch_runner(ids, mask)[real])
    assert diff.max() <= Int8Tolerance().max_abs and diff.mean() <= Int8Tolerance().mean_abs


def test_a_wrong_graph_is_refused_and_leaves_out_dir_alone(export_dir, tagger_dir, monkeypatch):
    def state():
        meta = (export_dir / "export.json").read_text()
        return (export_dir / "model.onnx").stat().st_mtime_ns, meta

    before = state()
    real_call = OnnxRunner.__call__
    monkeypatch.setattr(OnnxRunner, "__call__",
                        lambda self, ids, mask: real_call(self, ids, mask) + 0.01)
    with pytest.raises(ExportValidationError, match=r"max abs 0\.01 > atol 0\.0001") as err:
        export_onnx(tagger_dir, export_dir)
    assert "[1, 1]" in str(err.value) and "[batch, sequence]" in str(err.value)
    assert state() == before, "a failed export must not replace the previous one"
    assert not any(p.name.startswith(".onnx-export-") for p in export_dir.iterdir())


def test_int8_is_held_to_its_own_tolerance(tagger_dir, tmp_path):
    # the fp32 graph passes at 1e-4, the int8 graph cannot pass tolerances that tight
    for tol, message in ((Int8Tolerance(max_abs=1e-6), "max abs"),
                         (Int8Tolerance(mean_abs=1e-7), "on average")):
        with pytest.raises(ExportValidationError, match=rf"model\.int8\.onnx \(int8\).*{message}"):
            export_onnx(tagger_dir, tmp_path / "e", int8=True, int8_tolerance=tol)
        assert not (tmp_path / "e" / "model.onnx").exists()
    with pytest.raises(ValueError, match="min_label_agreement"):
        Int8Tolerance(min_label_agreement=1.5)


def test_validation_checks_mean_difference_and_label_agreement(export_dir, tagger_dir):
    """validate_onnx's int8 criteria: the mean abs difference and the share of labels at the
    threshold that agree with the reference, each an error when missed, named in the error."""
    from mhmla_fast.serve.onnx_export import validate_onnx

    batches = ragged(9, [(3, 12), (2, 40)])
    ref = [TorchRunner(tagger_dir, device="cpu")(ids, mask) for ids, mask in batches]
    path = export_dir / "model.onnx"
    ok = validate_onnx(path, ref, batches, atol=1e-4, mean_atol=1e-4, min_agreement=1.0,
                       threshold=0.5)
    assert ok["label_agreement"] == 1.0 and ok["mean_abs_diff"] <= 1e-4
    flipped = [1.0 - r for r in ref]  # nearly every label at 0.5 flips
    with pytest.raises(ExportValidationError, match=r"is torch's at 0\.\d+ of \d+ positions"):
        validate_onnx(path, flipped, batches, atol=2.0, mean_atol=2.0, min_agreement=0.9,
                      threshold=0.5)
    with pytest.raises(ExportValidationError, match="on average"):
        validate_onnx(path, [r + 0.01 for r in ref], batches, atol=2.0, mean_atol=1e-3)
    with pytest.raises(ValueError, match="needs the threshold"):
        validate_onnx(path, ref, batches, atol=1.0, min_agreement=0.9)


def test_export_into_the_tagger_directory_itself(tagger_dir, tmp_path):
    """An export beside the weights: it changes neither the model's fingerprint (an output
    begun before still resumes) nor the export cache's key (auto exported the same weights
    again before); once the weights change, the ONNX runner refuses the stale graph (it ran
    the old weights' graph under the new config, silently). A re-export removes a TensorRT
    plan built from the graph it replaces."""
    import shutil

    from safetensors.torch import load_file, save_file

    from mhmla_fast.serve.export_cache import source_files
    from mhmla_fast.serve.outputs import directory_fingerprint

    here = shutil.copytree(tagger_dir, tmp_path / "tagger")
    before = directory_fingerprint(here), [p.name for p in source_files(here)]
    (here / "model.plan").write_text("an engine of another graph")
    export_onnx(here, here)
    assert {"model.onnx", "export.json", "model.safetensors", "config.json"} <= {
        p.name for p in here.iterdir()}
    assert not (here / "model.plan").exists()
    assert (directory_fingerprint(here), [p.name for p in source_files(here)]) == before
    ids, mask = ragged(2, [(2, 12)])[0]
    real = mask.astype(bool)
    onnx_probs = make_runner(here, backend="onnx")(ids, mask)
    torch_probs = make_runner(here, backend="torch", device="cpu")(ids, mask)
    assert np.abs(onnx_probs[real] - torch_probs[real]).max() <= 1e-4
    state = load_file(here / "model.safetensors")
    state["classifier.bias"] = state["classifier.bias"] + 1.0  # retrained in place
    save_file(state, here / "model.safetensors")
    for backend in ("onnx", "openvino"):
        if backend == "openvino" and importlib.util.find_spec("openvino") is None:
            continue
        with pytest.raises(ValueError, match="its ONNX export is stale"):
            make_runner(here, backend=backend)


def test_a_failed_export_leaves_no_new_folder(tagger_dir, tmp_path):
    with pytest.raises(ExportValidationError):
        export_onnx(tagger_dir, tmp_path / "new" / "sub", atol=1e-12)
    assert not (tmp_path / "new").exists()


def test_an_export_never_writes_into_a_folder_that_is_not_an_export(tagger_dir, tmp_path,
                                                                     capsys):
    """Into another model's folder an export would replace its config and tokenizer (another
    tagger's threshold changed its labels): refused, before any work, by the library and by
    `mhmla-serve export`, nothing touched; an earlier export is replaced; the staging folders
    of exports killed part-way are removed by the next export there."""
    import shutil

    from mhmla_fast.commands.serve import main

    other = shutil.copytree(tagger_dir, tmp_path / "other-tagger")
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    for target, message in ((other, "holds files that are not an earlier export"),
                            (notes, r"holds files that are not an earlier export \(todo.txt\)")):
        before = {f.name: f.read_bytes() for f in target.iterdir()}
        with pytest.raises(ValueError, match=message):
            export_onnx(tagger_dir, target)
        assert main(["export", "--onnx", str(target), "--model", str(tagger_dir)]) == 2
        assert "holds files that are not an earlier export" in capsys.readouterr().err
        assert {f.name: f.read_bytes() for f in target.iterdir()} == before
    with pytest.raises(ValueError, match="is a file"):
        export_onnx(tagger_dir, notes / "todo.txt")
    out = tmp_path / "engine"
    export_onnx(tagger_dir, out)
    killed = out / ".onnx-export-999999999-abc"  # a pid no process has
    killed.mkdir()
    (killed / "model.onnx").write_bytes(b"half")
    export_onnx(tagger_dir, out)  # an earlier export: replaced; the dead stage removed
    assert not killed.exists() and (out / "model.onnx").stat().st_size > 4


def test_missing_export_says_how_to_make_it(tagger_dir, tmp_path):
    """The hint is a command that works: without --model it exported the shipped tagger and
    refused the folder (from the installed-wheel review); for the shipped tagger, whose folder
    is in the installed package, it points to --backend auto or a folder of the user's."""
    import shlex
    import shutil

    from mhmla_fast.commands.serve import main as serve_main
    from mhmla_fast.serve.engine import default_tagger_path

    own = tmp_path / "own"
    shutil.copytree(tagger_dir, own)
    with pytest.raises(FileNotFoundError, match=r"mhmla-serve export --onnx .*own --model .*own") as err:
        OnnxRunner.from_model_dir(own)
    command = str(err.value).split("first: ", 1)[1].split(" (or ", 1)[0]
    assert serve_main(shlex.split(command)[1:]) == 0
    assert OnnxRunner.from_model_dir(own) is not None
    with pytest.raises(FileNotFoundError, match="shipped tagger runs from its cached export "
                                                "with --backend auto"):
        OnnxRunner.from_model_dir(default_tagger_path())
    with pytest.raises(FileNotFoundError, match="mhmla-serve export --onnx --int8"):
        OnnxRunner.from_model_dir(tagger_dir, dtype="int8")
    with pytest.raises(ValueError, match="'float32' .* 'int8'"):
        OnnxRunner.from_model_dir(tagger_dir, dtype="bfloat16")
    with pytest.raises(FileNotFoundError):
        OnnxRunner(tmp_path / "nope.onnx")


def test_engine_over_onnx_tags_like_engine_over_torch(export_dir, tagger_dir):
    tok = load_tokenizer(export_dir)
    over_torch = Engine(TorchRunner(tagger_dir, device="cpu"), tok, threshold=0.5,
                        max_pieces=MAX_POSITIONS)
    over_onnx = Engine(OnnxRunner.from_model_dir(export_dir), tok, threshold=0.5,
                       max_pieces=MAX_POSITIONS)
    a, b = over_torch.tag_texts(TEXTS), over_onnx.tag_texts(TEXTS)
    probs_a = np.concatenate([r.probs for r in a])
    probs_b = np.concatenate([r.probs for r in b])
    assert np.abs(probs_a - probs_b).max() <= 1e-4
    assert np.abs(probs_a - 0.5).min() > 1e-3, "no word so close to the threshold it could flip"
    assert [r.labels for r in a] == [r.labels for r in b]
    assert [r.spans for r in a] == [r.spans for r in b]
    assert {"i", "c"} <= {lab for r in a for lab in r.labels}, "a test that can tell labels apart"
    # the export directory alone is enough for Engine.load (config + tokenizer copied)
    loaded = Engine.load(export_dir, backend="onnx", threshold=0.5)
    assert [r.labels for r in loaded.tag_texts(TEXTS)] == [r.labels for r in b]


def test_validation_batches_are_ragged_and_clipped():
    batches = validation_batches(20, 100, pad_id=0, seed=1, shapes=[(1, 1), (4, 50), (4, 20)])
    assert [ids.shape for ids, _ in batches] == [(1, 1), (4, 20)]  # 50 clips to 20: deduplicated
    for ids, mask in batches:
        assert ids.dtype == mask.dtype == np.int64
        assert mask[0].all() and mask.sum(1).min() >= 1
        assert (ids[mask == 0] == 0).all() and (ids[mask == 1] >= 1).all()


def test_physical_cores_is_positive():
    assert 1 <= onnx_export.physical_cores() <= (len(__import__("os").sched_getaffinity(0)))


def test_dynamo_exporter_also_validates(tagger_dir, tmp_path):
    pytest.importorskip("onnxscript", reason="exporter='dynamo' needs onnxscript")
    path = export_onnx(tagger_dir, tmp_path / "dyn", exporter="dynamo")
    meta = json.loads((tmp_path / "dyn" / "export.json").read_text())
    assert meta["exporter"] == "dynamo" and meta["validation"]["max_abs_diff"] <= 1e-4
    assert path.is_file() and not (tmp_path / "dyn" / "model.int8.onnx").exists()


def test_onnx_runner_honours_device_dtype_kernels_and_threads(export_dir, monkeypatch):
    import onnxruntime as ort

    runner = make_runner(export_dir, backend="onnx", device="cpu", threads=1)
    assert runner.device == "cpu" and runner.threads == 1
    assert runner.session.get_providers() == ["CPUExecutionProvider"]
    int8 = make_runner(export_dir, backend="onnx", device="cpu", dtype="int8", kernels="torch")
    assert int8.path.name == "model.int8.onnx"
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    assert make_runner(export_dir, backend="onnx").device == "cpu"  # the default on a CPU build
    with pytest.raises(ValueError, match=r"^device: 'cuda:1' with the onnx backend needs "
                                         r"onnxruntime's CUDAExecutionProvider"):
        OnnxRunner.from_model_dir(export_dir, device="cuda:1")
    with pytest.raises(ValueError, match=r"^kernels: the onnx backend .*eager"):
        make_runner(export_dir, backend="onnx", kernels="triton")
    assert onnx_export._providers("cuda:1") == [
        ("CUDAExecutionProvider", {"device_id": 1}), "CPUExecutionProvider"]
    assert onnx_export._providers("cpu") == ["CPUExecutionProvider"]


def test_onnx_lanes_give_the_same_probabilities_and_engine_results(export_dir):
    """Two passes at a time on single-threaded lanes of one session: bit for bit the
    probabilities of one pass at a time, and the engine's results unchanged; the lane threads
    stop at close and start again on the next call."""
    import threading

    one = make_runner(export_dir, backend="onnx", device="cpu", threads=2)
    two = make_runner(export_dir, backend="onnx", device="cpu", threads=2, lanes=2)
    assert (one.lanes, one.threads, two.lanes, two.threads) == (1, 2, 2, 2)
    assert "lanes=2" in repr(two)
    batches = ragged(11, [(1, 1), (5, 9), (3, MAX_POSITIONS), (16, 23), (7, 40), (2, 5)])
    pending = [two.submit(ids, mask) for ids, mask in batches]  # all in flight at once
    for (ids, mask), job in zip(batches, pending):
        assert np.array_equal(job.result(), one(ids, mask))
    texts = TEXTS * 40
    engines = [Engine(r, load_tokenizer(export_dir), token_budget=64) for r in (one, two)]
    want, got = (e.tag_texts(texts) for e in engines)
    assert [r.to_dict() for r in got] == [r.to_dict() for r in want]
    lanes = lambda: [t for t in threading.enumerate() if t.name.startswith("mhmla-lane")]
    assert lanes()
    engines[1].close()
    assert not lanes()
    assert [r.to_dict() for r in engines[1].tag_texts(texts[:8])] == [
        r.to_dict() for r in want[:8]]
    engines[1].close()
    with pytest.raises(ValueError, match=r"^lanes: 3 passes at a time need at least as many "
                                         r"threads, got threads 2"):
        make_runner(export_dir, backend="onnx", device="cpu", threads=2, lanes=3)


def test_auto_on_an_export_names_the_option_that_makes_it_torch(export_dir):
    """backend auto runs torch for a dtype ONNX Runtime's float32 graph cannot honour; on an
    export folder that said "not a tagger directory", naming no option."""
    from mhmla_fast.serve.options import checked_bf16_available

    if checked_bf16_available():
        pytest.skip("here auto runs bfloat16 as the checked OpenVINO pass, not torch")
    with pytest.raises(ValueError, match=r"is an ONNX export, .* with dtype='bfloat16'"):
        Engine.load(export_dir, dtype="bfloat16")
    assert Engine.load(export_dir).runner is not None  # float32: run as it is


def test_engine_on_an_export_imports_no_torch(export_dir):
    """The ONNX path needs neither torch nor the model classes: start-up stays short."""
    import subprocess
    import sys

    code = ("import sys; from mhmla_fast.serve.engine import Engine; "
            f"e = Engine.load({str(export_dir)!r}, backend='onnx', threads=1); "
            "r = e.tag_texts(['He go to school .']); assert r[0].tokens[0] == 'He'; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_eager_attention_switches_the_encoder_and_restores_it(tagger_dir):
    tagger = GedTagger.load(tagger_dir, device="cpu", dtype=torch.float32, backend="torch")
    own = tagger.encoder.config._attn_implementation
    assert own != "eager", "the tiny encoder loads with its default (SDPA) attention"
    with onnx_export.eager_attention(tagger.encoder) as traced:
        assert traced == "eager" and tagger.encoder.config._attn_implementation == "eager"
    assert tagger.encoder.config._attn_implementation == own
    with pytest.raises(RuntimeError, match="inside"):
        with onnx_export.eager_attention(tagger.encoder):
            raise RuntimeError("inside")
    assert tagger.encoder.config._attn_implementation == own, "restored after an error too"
