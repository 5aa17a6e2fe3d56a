"""The checked bf16 pass and backend openvino: ``CheckedRunner`` re-runs exactly the rows with a
piece near the threshold (on fakes, where every number is known), OpenVINO fp32 matches ONNX
Runtime on a tiny export, the checked pass gives ONNX Runtime fp32's labels, backend auto picks it
only on a CPU with AMX and OpenVINO (never with dtype float32), and options it cannot honour are
refused by name."""

from __future__ import annotations

import numpy as np
import pytest

from mhmla_fast.serve import export_cache, options, runners
from mhmla_fast.serve.options import ServeOptions, resolve_options
from mhmla_fast.serve.runners import CheckedRunner, check_margin_option

# ------------------------------------------------------------------ CheckedRunner on fakes


class Table:
    """A runner whose P(error) at row r, column j is ``table[ids[r, 0], j]`` (row ids carry
    their row's key in column 0); it records the shapes it is called with."""

    backend, device = "fake", "cpu"

    def __init__(self, table: np.ndarray):
        self.table, self.calls = table, []

    def __call__(self, ids, mask):
        self.calls.append(ids.shape)
        return self.table[ids[:, 0], :ids.shape[1]].astype(np.float32).copy()


def _batch(lengths, T):
    ids = np.zeros((len(lengths), T), dtype=np.int64)
    ids[:, 0] = np.arange(len(lengths))
    mask = (np.arange(T) < np.asarray(lengths)[:, None]).astype(np.int64)
    return ids, mask


def test_checked_runner_reruns_exactly_the_rows_near_the_threshold():
    """Rows 1 and 3 have a word piece within the margin of 0.5; row 2 only at [CLS],
    [SEP] and padded columns; row 0 nowhere. Rows 1 and 3 come back exact (trimmed to their
    longest, 5 pieces), the others as the fast runner gave them."""
    exact = np.array([[0.10, 0.20, 0.90, 0.30, 0.10, 0.70],
                      [0.10, 0.52, 0.10, 0.10, 0.10, 0.10],
                      [0.50, 0.10, 0.20, 0.51, 0.49, 0.49],
                      [0.10, 0.10, 0.10, 0.47, 0.10, 0.10]], dtype=np.float32)
    fast_table = exact.copy()
    fast_table[1, 1] = 0.47  # exact 0.52: "i"; fast: "c" - a flip inside the margin
    fast_table[0, 2] = 0.80  # far from the threshold: kept, wrong probability and all
    fast, slow = Table(fast_table), Table(exact)
    runner = CheckedRunner(fast, slow, threshold=0.5, margin=0.05)
    ids, mask = _batch([6, 4, 4, 5], 6)
    p = runner(ids, mask)
    assert slow.calls == [(2, 5)]
    assert np.array_equal(p[[1, 3], :5], exact[[1, 3], :5])
    assert np.array_equal(p[[0, 2]], fast_table[[0, 2]])
    assert (runner.rows, runner.rechecked) == (4, 2)
    assert (p[1, 1] >= 0.5) == (exact[1, 1] >= 0.5)
    runner.set_threshold(0.83)  # now row 0's 0.80 (and only it) is near
    slow.calls.clear()
    p = runner(ids, mask)
    assert slow.calls == [(1, 6)] and p[0, 2] == np.float32(0.90)


def test_checked_runner_without_a_margin_runs_the_fast_runner_alone_and_lanes_agree():
    rng = np.random.default_rng(0)
    exact = rng.random((16, 12)).astype(np.float32)
    fast_table = exact + rng.uniform(-0.02, 0.02, exact.shape).astype(np.float32)
    ids, mask = _batch(rng.integers(2, 13, 16).tolist(), 12)
    slow = Table(exact)
    alone = CheckedRunner(Table(fast_table), slow, threshold=0.5, margin=0)
    assert alone.exact is None
    assert np.array_equal(alone(ids, mask), fast_table)
    assert slow.calls == []
    one = CheckedRunner(Table(fast_table), Table(exact), threshold=0.5, margin=0.03)
    two = CheckedRunner(Table(fast_table), Table(exact), threshold=0.5, margin=0.03, lanes=2)
    halves = [two.submit(ids[:8], mask[:8]), two.submit(ids[8:], mask[8:])]
    got = np.concatenate([h.result() for h in halves])
    want = one(ids, mask)
    real = mask > 0
    assert np.array_equal(got[real], want[real])
    # every label at a real piece (not [CLS]/[SEP]) is the exact runner's: errors < margin
    inner = real.copy()
    inner[:, 0] = False
    inner[np.arange(16), mask.sum(1) - 1] = False
    assert np.array_equal(want[inner] >= 0.5, exact[inner] >= 0.5)
    two.close()
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match=r"^margin: expected 0 <= margin < 1"):
            CheckedRunner(Table(exact), Table(exact), threshold=0.5, margin=bad)


def test_checked_runner_rechecks_only_rows_near_the_threshold_at_a_read_piece():
    """With ``read`` (the pieces a caller reads labels from), a row near the threshold only at
    pieces nobody reads is not run again: row 1's near piece is read, row 3's is not (so it
    keeps the fast probabilities), and lanes pass ``read`` on. A ``read`` of another shape is
    refused."""
    exact = np.array([[0.10, 0.20, 0.90, 0.30, 0.10, 0.70],
                      [0.10, 0.52, 0.10, 0.10, 0.10, 0.10],
                      [0.10, 0.10, 0.20, 0.30, 0.10, 0.10],
                      [0.10, 0.10, 0.10, 0.51, 0.10, 0.10]], dtype=np.float32)
    fast_table = exact.copy()
    fast_table[[1, 3], [1, 3]] = 0.47
    ids, mask = _batch([6, 4, 4, 5], 6)
    read = np.zeros(ids.shape, dtype=bool)
    read[:, [1, 2]] = True  # the first pieces of two words per row
    for lanes in (1, 2):
        slow = Table(exact)
        runner = CheckedRunner(Table(fast_table), slow, threshold=0.5, margin=0.05, lanes=lanes)
        p = runner.submit(ids, mask, read).result()
        assert slow.calls == [(1, 4)] and (runner.rows, runner.rechecked) == (4, 1)
        assert np.array_equal(p[1, :4], exact[1, :4])
        assert np.array_equal(p[[0, 2, 3]], fast_table[[0, 2, 3]])
        assert runners.submit(runner, ids, mask).result()[3, 3] == exact[3, 3]  # no read: all
        runner.close()
    with pytest.raises(ValueError, match=r"^read \[4, 5\]: expected the pass's shape \[4, 6\]"):
        runner(ids, mask, read[:, :5])


# ------------------------------------------------------------------------------ options


def test_openvino_options_and_what_it_cannot_honour(monkeypatch):
    monkeypatch.setattr(options.devices, "cuda_available", lambda backend="torch": False)
    assert resolve_options("openvino") == ServeOptions("openvino", "cpu", "float32", "auto")
    assert resolve_options("openvino", dtype="bf16").dtype == "bfloat16"
    for kw, message in ((dict(device="cuda"), r"^device: the openvino backend runs on the CPU"),
                        (dict(dtype="int8"), r"^dtype: the openvino backend has"),
                        (dict(dtype="float16"), r"^dtype: the openvino backend has"),
                        (dict(kernels="triton"), r"^kernels: the openvino backend")):
        with pytest.raises(ValueError, match=message):
            resolve_options("openvino", **kw)
    with pytest.raises(ValueError, match=r"^check_margin: only the checked bf16 pass"):
        check_margin_option(0.1, resolve_options("onnx"))
    with pytest.raises(ValueError, match=r"^check_margin: only the checked bf16 pass"):
        check_margin_option(0.1, resolve_options("openvino"))  # float32: nothing to check
    with pytest.raises(ValueError, match=r"^check_margin: expected 0 <= margin < 1"):
        check_margin_option(1.5, resolve_options("openvino", dtype="bfloat16"))
    assert check_margin_option(None, resolve_options("onnx")) is None
    assert check_margin_option(0, resolve_options("openvino", dtype="bfloat16")) == 0.0


def test_auto_picks_the_checked_pass_only_on_amx_with_openvino(monkeypatch):
    """Unset dtype (or bfloat16) on such a CPU: the checked pass; float32 asked for: ONNX
    Runtime fp32; no AMX, no OpenVINO or $MHMLA_NO_OPENVINO: as before."""
    from mhmla_fast.serve import openvino_runner

    monkeypatch.setattr(options.devices, "cuda_available", lambda backend="torch": False)
    monkeypatch.setattr(options, "onnx_importable", lambda: True)
    monkeypatch.setattr(openvino_runner, "openvino_importable", lambda: True)
    monkeypatch.setattr(openvino_runner, "openvino_bf16_native", lambda: True)
    monkeypatch.delenv("MHMLA_NO_OPENVINO", raising=False)
    checked = ServeOptions("auto", "cpu", "bfloat16", "auto")
    assert resolve_options() == checked
    assert resolve_options("auto", dtype="bf16") == checked
    assert resolve_options("auto", dtype="float32") == ServeOptions("auto", "cpu", "float32",
                                                                    "auto")
    assert resolve_options("auto", dtype="float16").backend == "torch"
    assert resolve_options("auto", device="cpu", kernels="torch") == ServeOptions(
        "auto", "cpu", "bfloat16", "torch")
    monkeypatch.setenv("MHMLA_NO_OPENVINO", "1")
    assert resolve_options().dtype == "float32"
    monkeypatch.delenv("MHMLA_NO_OPENVINO")
    monkeypatch.setattr(openvino_runner, "openvino_bf16_native", lambda: False)
    assert resolve_options() == ServeOptions("auto", "cpu", "float32", "auto")
    assert resolve_options("auto", dtype="bf16").backend == "torch"  # as before: torch bf16


def test_amx_is_read_from_the_cpu_flags(monkeypatch):
    from mhmla_fast.serve import openvino_runner

    monkeypatch.setattr(options.devices, "cpu_flags",
                        lambda: frozenset({"avx512f", "avx512_bf16", "amx_bf16"}))
    assert openvino_runner.openvino_bf16_native()
    monkeypatch.setattr(options.devices, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    assert not openvino_runner.openvino_bf16_native()  # Zen 4: never measured faster


# ------------------------------------------------------------------- on a tiny export

ov = pytest.importorskip("openvino", reason="backend openvino needs openvino")
pytest.importorskip("onnxruntime", reason="the exact re-check runs ONNX Runtime")
pytest.importorskip("onnx", reason="the export needs onnx")

from mhmla_fast.ged.model import load_tokenizer  # noqa: E402
from mhmla_fast.serve.engine import Engine  # noqa: E402
from mhmla_fast.serve.onnx_export import OnnxRunner, export_onnx  # noqa: E402
from mhmla_fast.serve.openvino_runner import OpenVinoRunner, checked_runner  # noqa: E402

from test_serve_onnx import TEXTS, make_tagger, ragged  # noqa: E402


def _bf16_here() -> bool:
    return "BF16" in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")


@pytest.fixture(scope="module")
def export_dir(tiny_tagger_dir, tmp_path_factory):
    tagger = make_tagger(tiny_tagger_dir, tmp_path_factory.mktemp("ov") / "tagger")
    out = tmp_path_factory.mktemp("ov-export") / "engine"
    export_onnx(tagger, out)
    return out


def test_openvino_fp32_matches_onnx_runtime_on_ragged_batches(export_dir):
    ovr = runners.make_runner(export_dir, backend="openvino", threads=1)
    ort = OnnxRunner.from_model_dir(export_dir, threads=1)
    assert isinstance(ovr, OpenVinoRunner) and ovr.threads == 1 and ovr.dtype == "float32"
    for ids, mask in ragged(3, [(1, 1), (5, 9), (3, 64), (16, 23)]):
        got, want = ovr(ids, mask), ort(ids, mask)
        assert got.shape == want.shape and got.dtype == np.float32
        real = mask > 0
        assert np.abs(got[real] - want[real]).max() < 1e-5
    two = runners.make_runner(export_dir, backend="openvino", threads=2, lanes=2)
    # many passes in flight, each of a new shape: the lanes hand their requests the arrays in
    # place (set under a lock, run unlocked), so each result must still be its own batch's
    shapes = [(4, 12), (7, 30), (2, 64), (9, 5)] + [
        (int(b), int(t)) for b, t in np.random.default_rng(5).integers((1, 2), (12, 64), (36, 2))]
    batches = ragged(4, shapes)
    pending = [two.submit(ids, mask) for ids, mask in batches]
    for (ids, mask), job in zip(batches, pending):
        real = mask > 0
        assert np.abs(job.result()[real] - ort(ids, mask)[real]).max() < 1e-5
    two.close()
    with pytest.raises(FileNotFoundError, match="mhmla-serve export --onnx"):
        OpenVinoRunner.from_model_dir(export_dir.parent)
    with pytest.raises(ValueError, match=r"^lanes: 3 passes at a time need"):
        runners.make_runner(export_dir, backend="openvino", threads=2, lanes=3)


def test_the_checked_pass_gives_onnx_runtime_fp32_labels(export_dir):
    """The engine over the checked pass tags the texts with ONNX Runtime fp32's labels at the
    model's threshold and at another one set on the engine; probabilities near the threshold
    are fp32's (the margin is wide: bf16 errs more on this tiny tagger, its logits scaled up). Without a CPU with bf16, asking for it is refused by name."""
    if not _bf16_here():
        with pytest.raises(ValueError, match=r"^dtype: 'bfloat16' with the openvino backend "
                                             r"needs a CPU with bf16"):
            OpenVinoRunner.from_model_dir(export_dir, "bfloat16")
        pytest.skip("this CPU has no bf16 instructions for OpenVINO")
    tok = load_tokenizer(export_dir)
    texts = TEXTS * 10
    exact = Engine(OnnxRunner.from_model_dir(export_dir, threads=2), tok, token_budget=96)
    want = exact.tag_texts(texts)
    engine = Engine.load(export_dir, backend="openvino", dtype="bfloat16", threads=2, lanes=2,
                         token_budget=96, check_margin=0.2)  # the tiny tagger's logits x15
    assert isinstance(engine.runner, CheckedRunner) and engine.runner.lanes == 2
    assert engine.runner.threshold == engine.threshold
    for threshold in (engine.threshold, 0.3):
        engine.threshold = exact.threshold = threshold
        assert engine.runner.threshold == threshold
        got, want = engine.tag_texts(texts), exact.tag_texts(texts)
        assert [r.labels for r in got] == [r.labels for r in want]
        for g, w in zip(got, want):
            near = np.abs(np.asarray(w.probs) - threshold) < 0.02
            assert np.allclose(np.asarray(g.probs)[near], np.asarray(w.probs)[near], atol=1e-5)
    assert engine.runner.rechecked > 0
    engine.close()
    alone = checked_runner(export_dir, threshold=0.5, margin=0)
    assert alone.exact is None


def test_auto_runs_the_checked_pass_and_falls_back_to_onnx_runtime(export_dir, monkeypatch):
    """backend auto in bfloat16 on an export: the checked pass; when OpenVINO fails, ONNX
    Runtime fp32 with one line saying why (the export itself is fine)."""
    from mhmla_fast.serve import openvino_runner

    lines = []
    made = []
    monkeypatch.setattr(openvino_runner, "checked_runner",
                        lambda path, **kw: made.append(kw) or "checked")
    got = export_cache.auto_runner(export_dir, dtype="bfloat16", threshold=0.3, threads=1,
                                   check_margin=0.07, log=lines.append)
    assert got == "checked" and lines == []
    assert made == [dict(threshold=0.3, threads=1, lanes=1, margin=0.07,
                         cache_dir=None)]  # a user's export: nothing written into it

    def broken(path, **kw):
        raise RuntimeError("no AMX today")

    monkeypatch.setattr(openvino_runner, "checked_runner", broken)
    got = export_cache.auto_runner(export_dir, dtype="bfloat16", threads=1, log=lines.append)
    assert isinstance(got, OnnxRunner)
    assert lines == ["mhmla-fast: backend auto runs ONNX Runtime fp32: OpenVINO's checked bf16 "
                     "pass failed (RuntimeError: no AMX today)"]
    assert isinstance(export_cache.auto_runner(export_dir, threads=1), OnnxRunner)  # float32


def test_the_cli_refuses_a_check_margin_it_cannot_honour(tmp_path, capsys):
    from mhmla_fast.commands import serve as cli

    src = tmp_path / "in.txt"
    src.write_text("He go to school .\n")
    code = cli.main(["tag", str(src), "-o", str(tmp_path / "t.jsonl"), "--backend", "onnx",
                     "--check-margin", "0.1", "--no-progress"])
    assert code == 2
    assert "--check-margin: only the checked bf16 pass" in capsys.readouterr().err
    code = cli.main(["tag", str(src), "-o", str(tmp_path / "r.jsonl"), "--check-margin", "0.1",
                     "--ray", "--no-progress"])
    assert code == 2
    assert "--check-margin applies to one process" in capsys.readouterr().err


class Recorder:
    """A runner that takes ``read`` (as the checked pass does) and records each pass; every
    probability is 0."""

    backend, device, takes_read = "fake", "cpu", True

    def __init__(self):
        self.passes = []

    def __call__(self, ids, mask, read=None):
        self.passes.append((ids.copy(), read))
        return np.zeros(ids.shape, dtype=np.float32)


def test_the_engine_marks_each_words_first_piece_for_a_runner_that_reads(tiny_tagger_dir):
    """The engine hands a runner that takes ``read`` (the checked pass) exactly the positions
    of each word's first piece, in whole rows and in the windows of a long input (tag_tokens
    and tag_windows); a runner without it gets two arguments, as ever."""
    tok = load_tokenizer(tiny_tagger_dir)
    recorder = Recorder()
    engine = Engine(recorder, tok, token_budget=64, max_pieces=24, long_window=12)
    sentences = [["unbelievably", "tokenisation", "is", "fine"], ["a"],
                 ["internationalisation"] * 9 + ["of", "words"] * 4]  # the last: windows
    engine.tag_tokens(sentences)
    plans = [engine.plan_tokens(sentences[2])]
    engine.tag_windows([(plans[0], k) for k in range(len(plans[0].windows))])
    by_ids = {}
    for s in sentences:
        ids, first = engine._encode([s])[0]
        for start, end in engine.window_spans(len(ids)):
            by_ids[tuple(ids[start:end])] = first[start:end] >= 0
    seen = 0
    for ids, read in recorder.passes:
        assert read is not None and read.shape == ids.shape and not read[:, 0].any()
        for row, marks in zip(ids, read):
            n = int((row != engine.pad_id).sum()) - 2
            want = by_ids[tuple(row[1:n + 1])]
            assert np.array_equal(marks[1:n + 1], want) and not marks[n + 1:].any()
            seen += 1
    assert seen > len(sentences)  # whole rows and windows, twice for the long one
    assert any(not m.all() for m in by_ids.values())  # some words have several pieces

    class Plain:
        backend, device = "fake", "cpu"

        def __call__(self, ids, mask):  # two arguments only
            return np.zeros(ids.shape, dtype=np.float32)

    got = Engine(Plain(), tok, token_budget=64, max_pieces=24, long_window=12).tag_tokens(sentences)
    assert [r.tokens for r in got] == [list(s) for s in sentences]
