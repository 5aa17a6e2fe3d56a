"""Resumable training checkpoints as safetensors + JSON (never pickle).

A checkpoint of a folder ``out`` is two files::

    checkpoint-<step>.safetensors   "model.<name>"        the model's state_dict tensors
                                    "optim.<i>.<name>"    optimizer state of parameter i
                                    "rng.cpu", "rng.cuda.<d>"  torch RNG states
    checkpoint.json                 the caller's ``state`` (JSON), "tensors": the file's name,
                                    "param_groups": the optimizer's groups (tuples as lists)

The tensors are written (and fsynced) under a new name first, then the JSON that names them
replaces the old JSON atomically, and only then are older tensor files removed: a run killed
at any point leaves one complete checkpoint. Used by the GED trainer and AES fine-tuning.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

__all__ = ["atomic_write_text", "save_checkpoint", "load_checkpoint"]


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a fsynced temporary file and a rename."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(out: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    state: dict, step: int) -> None:
    """Write the checkpoint of ``model``, ``optimizer``, the RNGs and ``state`` (JSON-able)
    into ``out`` as ``checkpoint-<step>.safetensors`` + ``checkpoint.json``."""
    from safetensors.torch import save_file

    tensors = {f"model.{k}": v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    opt = optimizer.state_dict()
    for idx, st in opt["state"].items():
        for name, value in st.items():
            tensors[f"optim.{idx}.{name}"] = torch.as_tensor(value).cpu().contiguous()
    tensors["rng.cpu"] = torch.get_rng_state()
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = s
    name = f"checkpoint-{step}.safetensors"
    tmp = out / (name + ".tmp")
    save_file(tensors, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, out / name)
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()}
              for g in opt["param_groups"]]
    atomic_write_text(out / "checkpoint.json",
                      json.dumps({**state, "tensors": name, "param_groups": groups}, indent=1))
    for old in out.glob("checkpoint-*.safetensors"):
        if old.name != name:
            old.unlink(missing_ok=True)


def load_checkpoint(out: Path, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer) -> dict | None:
    """Restore ``model``, ``optimizer`` and the RNGs from ``out``'s checkpoint; returns its
    JSON (the saved ``state`` plus "tensors" and "param_groups"), or None when there is none."""
    from safetensors.torch import load_file

    meta_path = out / "checkpoint.json"
    if not meta_path.is_file():
        return None
    meta = json.loads(meta_path.read_text())
    tensors = load_file(out / meta["tensors"])
    model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, idx, name = key.split(".", 2)
            state.setdefault(int(idx), {})[name] = value
    groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()}
              for g in meta["param_groups"]]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    torch.set_rng_state(tensors["rng.cpu"])
    if torch.cuda.is_available():
        cuda = [tensors[k] for k in sorted(k for k in tensors if k.startswith("rng.cuda."))]
        if cuda:
            torch.cuda.set_rng_state_all(cuda)
    return meta
