"""The on-disk model format shared by the GED tagger and the essay scorer.

A model directory holds ``config.json``, ``model.safetensors`` and the tokenizer files.
Tensors that training left frozen and that the base encoder package ships are not stored:
``config.base_tensors`` maps their keys to the base encoder's keys, and they are read from
the encoder's own ``model.safetensors`` at load time. :class:`ModelDirMixin` gives a model
class its ``save`` and ``load`` in this format.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn

from .durable import fsync_dir, fsync_file
from .encoder import EMBEDDED_ENCODER, resolve_encoder

__all__ = ["EMBEDDED_ENCODER", "resolve_encoder", "frozen_encoder_keys", "state_to_save",
           "require_model_dir", "check_save_target", "write_model_dir", "read_model_state", "load_checked_state",
           "ModelDirMixin"]

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


def check_save_target(path: Path) -> None:
    """FileExistsError unless ``path`` is absent, an empty directory or a model directory (it
    holds config.json and model.safetensors, and no folder): replacing anything else would
    delete a user's files."""
    if not path.exists() and not path.is_symlink():
        return
    if not path.is_dir() or path.is_symlink():
        raise FileExistsError(f"{path}: exists and is not a directory; give a new folder for "
                              "the model")
    entries = list(path.iterdir())
    if not entries:
        return
    is_model = (path / "config.json").is_file() and (path / "model.safetensors").is_file()
    folders = [e.name for e in entries if e.is_dir()]
    if not is_model or folders:
        what = (f"holds folders ({', '.join(sorted(folders)[:3])})" if is_model
                else "is not a model directory (no config.json and model.safetensors)")
        raise FileExistsError(f"{path}: exists and {what}; a model is saved into a new or empty "
                              "folder or over a model directory, which it replaces whole. "
                              "Give another folder")


def _umask() -> int:
    """The process's umask (read by setting it, then putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_model_dir(path: str | os.PathLike, state: dict[str, torch.Tensor], config_json: str,
                    tokenizer=None) -> Path:
    """Write a model directory: complete and fsynced in a sibling ``<name>.tmp`` first, then
    swapped in by two renames (the old one to ``<name>.old``, removed last). A crash leaves
    the old directory, the new one, or (between the renames) the old one as ``<name>.old``.

    ``path`` must be absent, empty, or a model directory (FileExistsError otherwise, before
    anything is written): a directory is replaced whole, so a folder of other files is never
    taken for one."""
    from safetensors.torch import save_file

    path = Path(path)
    check_save_target(path)
    full = path.absolute()
    tmp = full.with_name(full.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    # safetensors creates its file private (0600) whatever the umask; a model folder is read
    # by whoever serves it, so its weights get the mode of any other new file
    os.chmod(tmp / "model.safetensors", 0o666 & ~_umask())
    (tmp / "config.json").write_text(config_json)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    for f in tmp.iterdir():
        fsync_file(f)
    fsync_dir(tmp)
    if full.exists():
        old = full.with_name(full.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        os.replace(full, old)
        os.replace(tmp, full)
        fsync_dir(full.parent)
        shutil.rmtree(old)
    else:
        os.replace(tmp, full)
    fsync_dir(full.parent)
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


M = TypeVar("M", bound="ModelDirMixin")


class ModelDirMixin:
    """``save``/``load`` of a model directory for an ``nn.Module`` built as
    ``cls(config, pretrained=False, backend=...)`` whose ``config`` has ``encoder_spec``
    (:class:`~mhmla_fast.configs.EncoderSpec`), ``base_tensors``, ``to_json()`` and
    ``config_class.from_json()`` (which reads the flat layout of older files too).

    With the embedded encoder, the frozen ``encoder.*`` tensors are not stored (they are read
    back from the encoder package). Subclasses set ``config_class`` and ``model_kind`` (the
    word in "not a <kind> directory"), and may extend :meth:`_after_load`.
    """

    config_class: ClassVar[Any]
    model_kind: ClassVar[str]
    tokenizer: Any = None  # saved with the model when ``save`` is given none

    def save(self, path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
             tokenizer=None) -> Path:
        """Write ``config.json``, ``model.safetensors`` (in ``dtype``) and the tokenizer
        (``tokenizer``, else ``self.tokenizer``, if any) atomically."""
        embedded = self.config.encoder_spec.name_or_path == EMBEDDED_ENCODER
        base = frozen_encoder_keys(self) if embedded else {}
        self.config.base_tensors = base
        state = state_to_save(self, base, dtype)
        return write_model_dir(path, state, self.config.to_json(), tokenizer or self.tokenizer)

    @classmethod
    def load(cls: type[M], path: str | os.PathLike, *, device: str | torch.device = "cpu",
             dtype: torch.dtype = torch.float32, backend: str = "auto") -> M:
        """Rebuild a saved model offline (no network, no hub), in eval mode."""
        path = require_model_dir(path, cls.model_kind)
        config = cls.config_class.from_json((path / "config.json").read_text())
        model = cls(config, pretrained=False, backend=backend)
        state = read_model_state(path, config.base_tensors, resolve_encoder(config.encoder_spec))
        load_checked_state(model, state, path)
        model._after_load(path)
        return model.to(device=device, dtype=dtype).eval()

    def _after_load(self, path: Path) -> None:
        """Called by :meth:`load` once the weights are in (nothing by default)."""
