"""The on-disk model format shared by the GED tagger and the essay scorer.

A model directory holds ``config.json``, ``model.safetensors`` and the tokenizer files.
Tensors that training left frozen and that the base encoder package ships are not stored:
``config.base_tensors`` maps their keys to the base encoder's keys, and they are read from
the encoder's own ``model.safetensors`` at load time.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from torch import nn

__all__ = ["frozen_encoder_keys", "state_to_save", "require_model_dir", "write_model_dir",
           "read_model_state", "load_checked_state"]


def frozen_encoder_keys(model: nn.Module) -> dict[str, str]:
    """Frozen ``encoder.*`` parameters of ``model``: model key -> base encoder key."""
    return {name: name[len("encoder."):] for name, p in model.named_parameters()
            if not p.requires_grad and name.startswith("encoder.")}


def state_to_save(model: nn.Module, base_tensors: dict[str, str], dtype: torch.dtype
                  ) -> dict[str, torch.Tensor]:
    """``model``'s state on the CPU, floating tensors in ``dtype``, without ``base_tensors``."""
    return {k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype).contiguous()
            for k, v in model.state_dict().items() if k not in base_tensors}


def require_model_dir(path: str | os.PathLike, what: str) -> Path:
    """``path`` as a Path; FileNotFoundError unless it holds config.json and model.safetensors."""
    path = Path(path)
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"{path}: not a {what} directory (needs config.json and "
                                "model.safetensors)")
    return path


def write_model_dir(path: str | os.PathLike, state: dict[str, torch.Tensor], config_json: str,
                    tokenizer=None) -> Path:
    """Write a model directory atomically: a complete sibling is swapped in at the end."""
    from safetensors.torch import save_file

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    (tmp / "config.json").write_text(config_json)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if path.exists():
        old = path.with_name(path.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old)
    else:
        os.replace(tmp, path)
    return path


def read_model_state(path: str | os.PathLike, base_tensors: dict[str, str],
                     encoder_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """``model.safetensors`` of ``path`` completed with the frozen tensors of the base
    encoder in ``encoder_dir``."""
    from safetensors.torch import load_file

    path = Path(path)
    state = load_file(path / "model.safetensors")
    if base_tensors:
        base_file = Path(encoder_dir) / "model.safetensors"
        base = load_file(base_file)
        for key, base_key in base_tensors.items():
            if base_key not in base:
                raise ValueError(f"{base_file}: lacks {base_key!r} needed by {path}")
            state[key] = base[base_key]
    return state


def load_checked_state(model: nn.Module, state: dict[str, torch.Tensor], path) -> None:
    """Load ``state`` into ``model``; anything missing or unexpected is an error (buffers
    such as ``position_ids``, absent from older files, excepted)."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("position_ids")]
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not match the config: missing {missing}, "
                         f"unexpected {unexpected}")
