"""Saving a model directory never deletes a user's files: only an absent or empty folder, or a
model directory (which is replaced whole), is written; the swap leaves no sibling behind."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from mhmla_fast.model_dir import check_save_target, write_model_dir


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
