"""Checkpoints written in the background (:class:`mhmla_fast.checkpoint.CheckpointWriter`):
what is saved is the moment of the call, the files are those of ``save_checkpoint``, and a
failed write is raised in the training thread."""

from __future__ import annotations

import json

import pytest
import torch

from mhmla_fast.checkpoint import (LOCK_FILE, CheckpointWriter, RunLockedError, check_same_inputs,
                                   load_checkpoint, run_lock, save_checkpoint)


def model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return model, opt


def test_background_write_saves_the_moment_of_the_call(tmp_path):
    model, opt = model_and_optimizer(0)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    state = {"epoch": 1, "log": [{"loss": 0.5}]}
    with CheckpointWriter(tmp_path) as writer:
        writer.save(model, opt, state, step=7)
        with torch.no_grad():  # training goes on while the file is written
            for p in model.parameters():
                p.add_(1.0)
        state["log"].append({"loss": 0.1})
    other, other_opt = model_and_optimizer(1)
    meta = load_checkpoint(tmp_path, other, other_opt)
    assert meta["tensors"] == "checkpoint-7.safetensors" and meta["log"] == [{"loss": 0.5}]
    for k, v in other.state_dict().items():
        assert torch.equal(v, want[k]), k
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-7.safetensors",
                                                         "checkpoint.json"]
    # the same files as the synchronous writer
    sync = tmp_path / "sync"
    sync.mkdir()
    model, opt = model_and_optimizer(0)
    save_checkpoint(sync, model, opt, {"epoch": 1, "log": [{"loss": 0.5}]}, 7)
    assert json.loads((sync / "checkpoint.json").read_text()) == meta


def test_a_failed_write_is_raised_by_the_next_call(tmp_path):
    model, opt = model_and_optimizer(0)
    writer = CheckpointWriter(tmp_path / "missing" / "folder")
    writer.save(model, opt, {}, step=1)
    with pytest.raises(RuntimeError, match="writing a checkpoint in .* failed"):
        writer.close()
    writer.close()  # reported once


def test_run_lock_refuses_a_second_holder_until_released(tmp_path):
    import os
    import subprocess
    import sys

    out = tmp_path / "run"
    with run_lock(out):
        assert (out / LOCK_FILE).read_text().strip() == str(os.getpid())
        with pytest.raises(RunLockedError, match=rf"pid {os.getpid()}\b.*another output folder"):
            with run_lock(out):
                pass
        # another process is refused too (flock, not a file's mere existence)
        code = ("import sys; from mhmla_fast.checkpoint import run_lock, RunLockedError\n"
                "try:\n    run_lock(sys.argv[1]).__enter__()\nexcept RunLockedError: sys.exit(3)")
        assert subprocess.run([sys.executable, "-c", code, str(out)]).returncode == 3
        with run_lock(out, held=False):  # torchrun's other ranks take no lock
            pass
    with run_lock(out):  # released on leaving, although the file stays
        pass


def test_an_unreadable_checkpoint_is_a_clear_error_and_check_runs_before_tensors(tmp_path):
    model, opt = model_and_optimizer(0)
    save_checkpoint(tmp_path, model, opt, {"config": {"heads": 4}}, step=3)
    seen = []

    def refuse(meta):
        seen.append(meta["config"])
        raise ValueError("a checkpoint of a different run exists")

    (tmp_path / "checkpoint-3.safetensors").write_bytes(b"torn")  # check() sees no tensors
    with pytest.raises(ValueError, match="a checkpoint of a different run"):
        load_checkpoint(tmp_path, model, opt, check=refuse)
    assert seen == [{"heads": 4}]
    with pytest.raises(ValueError, match=r"cannot be read \(checkpoint-3.safetensors: .*remove "
                                         r"checkpoint.json"):
        load_checkpoint(tmp_path, model, opt)
    (tmp_path / "checkpoint-3.safetensors").unlink()
    with pytest.raises(ValueError, match="cannot be read .*checkpoint-3.safetensors"):
        load_checkpoint(tmp_path, model, opt)
    (tmp_path / "checkpoint.json").write_text('{"tensors": "checkpoint-3.saf')  # torn JSON
    with pytest.raises(ValueError, match=rf"{tmp_path}: the checkpoint cannot be read "
                                         r"\(checkpoint.json: Unterminated string"):
        load_checkpoint(tmp_path, model, opt)


def test_a_write_cut_short_leaves_no_file_behind_the_next_save(tmp_path):
    model, opt = model_and_optimizer(0)
    save_checkpoint(tmp_path, model, opt, {}, step=2)
    (tmp_path / "checkpoint-4.safetensors.tmp").write_bytes(b"x" * 100)  # killed mid-write
    save_checkpoint(tmp_path, model, opt, {}, step=6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-6.safetensors",
                                                          "checkpoint.json"]


def test_cuda_random_states_are_restored_in_device_order(tmp_path, monkeypatch):
    """rng.cuda.<i> goes back to device i (10 after 9, not after 1); with fewer devices
    visible than saved, theirs only. No GPU needed: torch.cuda is stubbed."""
    model, opt = model_and_optimizer(0)
    save_checkpoint(tmp_path, model, opt, {}, step=1)
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "checkpoint-1.safetensors")
    for i in range(12):
        tensors[f"rng.cuda.{i}"] = torch.full((4,), i, dtype=torch.uint8)
    save_file(tensors, tmp_path / "checkpoint-1.safetensors")
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, i: restored.append((i, int(s[0]))))
    for visible, want in ((12, list(range(12))), (2, [0, 1])):
        monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
        restored.clear()
        load_checkpoint(tmp_path, model, opt)
        assert restored == [(i, i) for i in want]


def test_a_resume_is_refused_on_other_arithmetic_first_then_on_other_data(tmp_path):
    meta = {"precision_applied": "fp32", "data": {"train": "a", "dev": "b"}}
    check_same_inputs(meta, "fp32", {"train": "a", "dev": "b"}, tmp_path)  # the same: passes
    with pytest.raises(ValueError, match="ran in fp32 and this run's would run in bf16"):
        check_same_inputs(meta, "bf16", {"train": "x", "dev": "b"}, tmp_path)
    with pytest.raises(ValueError, match="the dev and train data differ"):
        check_same_inputs(meta, "fp32", {"train": "x", "dev": "y"}, tmp_path)
    # a checkpoint from before either record resumes unchecked
    check_same_inputs({}, "bf16", {"train": "x"}, tmp_path)


def test_checkpoint_files_follow_the_umask_like_every_other_file(tmp_path):
    """safetensors writes its files 0600 whatever the umask: checkpoints were private while
    the model folders and results beside them were not."""
    from mhmla_fast.durable import current_umask

    model, opt = model_and_optimizer(0)
    save_checkpoint(tmp_path, model, opt, {"epoch": 1}, 3)
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert modes == {"checkpoint-3.safetensors": 0o666 & ~current_umask(),
                     "checkpoint.json": 0o666 & ~current_umask()}, modes
