"""The on-disk model format shared by the GED tagger and the essay scorer.

A model directory holds ``config.json``, ``model.safetensors`` and the tokenizer files.
Tensors that training left frozen and that the base encoder package ships are not stored:
``config.base_tensors`` maps their keys to the base encoder's keys, and they are read from
the encoder's own ``model.safetensors`` at load time. A trained tensor of which training
changed a few rows only (the word-piece embeddings: Adam leaves the rows of pieces never seen
untouched) can be stored as a row delta against the base tensor instead (:func:`row_delta`:
the changed rows' indices and their differences in int8 with a scale per row); it is listed
in ``base_tensors`` too, and its delta is applied at load time. The same holds for a fully
fine-tuned encoder's matrices (:meth:`ModelDirMixin.trained_encoder_matrices`): every row
changes, but by little (fine-tuning moved MiniLM's matrices by about 1% of their size), so the
int8 delta on the fp32 base is closer to the trained tensor than an fp16 copy (half its error
on the AES scorer's matrices) at half the bytes. :class:`ModelDirMixin` gives a model class its
``save`` and ``load`` in this format.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn

from .durable import current_umask, fsync_dir, fsync_file
from .encoder import EMBEDDED_ENCODER, resolve_encoder

__all__ = ["EMBEDDED_ENCODER", "resolve_encoder", "frozen_encoder_keys", "state_to_save",
           "row_delta", "apply_row_delta", "DELTA_PARTS", "require_model_dir", "check_save_target",
           "write_model_dir", "install_model_dir", "candidate_dir", "staging_paths",
           "recover_model_dir",
           "read_model_state", "load_checked_state", "ModelDirMixin"]

def frozen_encoder_keys(model: nn.Module) -> dict[str, str]:
    """Frozen ``encoder.*`` parameters of ``model``: model key -> base encoder key."""
    return {name: name[len("encoder."):] for name, p in model.named_parameters()
            if not p.requires_grad and name.startswith("encoder.")}


def state_to_save(model: nn.Module, base_tensors: dict[str, str], dtype: torch.dtype
                  ) -> dict[str, torch.Tensor]:
    """``model``'s state on the CPU, floating tensors in ``dtype``, without ``base_tensors``."""
    return {k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype).contiguous()
            for k, v in model.state_dict().items() if k not in base_tensors}


# the stored parts of a row delta of tensor KEY: "KEY:delta_rows" etc.
DELTA_PARTS = ("delta_rows", "delta_q", "delta_scale")


def row_delta(trained: torch.Tensor, base: torch.Tensor) -> dict[str, torch.Tensor]:
    """``trained`` [V, C] as a row delta against ``base`` [V, C]:

        rows  = {i : trained[i] != base[i]}                              [R] int64
        d     = trained[rows] - base[rows]                              [R, C] (fp32)
        scale = max_c |d| / 127                                         [R] fp32
        q     = round(d / scale)                                        [R, C] int8

    so that ``apply_row_delta`` gives ``trained`` exactly on the unchanged rows and within
    ``scale / 2`` (plus fp32 rounding) elementwise on the changed ones. Keys: DELTA_PARTS."""
    if trained.shape != base.shape or trained.dim() != 2:
        raise ValueError(f"row delta: expected two [V, C] tensors of one shape, got "
                         f"{tuple(trained.shape)} and {tuple(base.shape)}")
    trained, base = trained.detach().float().cpu(), base.detach().float().cpu()
    if not bool(torch.isfinite(trained).all()):
        raise ValueError("row delta: the trained tensor has non-finite values")
    rows = (trained != base).any(dim=1).nonzero().flatten()
    d = trained[rows] - base[rows]
    scale = d.abs().amax(dim=1) / 127
    q = torch.round(d / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return dict(zip(DELTA_PARTS, (rows, q, scale)))


def apply_row_delta(base: torch.Tensor, rows: torch.Tensor, q: torch.Tensor,
                    scale: torch.Tensor) -> torch.Tensor:
    """``base`` [V, C] with ``q * scale`` [R, C] added at ``rows`` [R] (see :func:`row_delta`),
    in fp32. ValueError when the parts do not fit ``base`` or each other, a row repeats, the
    rows are not integers or a scale is not finite."""
    V, C = base.shape
    R = rows.numel()
    shapes = rows.dim() == 1 and q.shape == (R, C) and scale.shape == (R,)
    dtypes = (q.dtype == torch.int8 and scale.is_floating_point()
              and rows.dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8))
    if not (shapes and dtypes and bool(torch.isfinite(scale).all())
            and (R == 0 or 0 <= int(rows.min()) <= int(rows.max()) < V)
            and torch.unique(rows).numel() == R):  # in range, each row once
        raise ValueError(f"row delta: parts {tuple(rows.shape)}, {tuple(q.shape)} {q.dtype}, "
                         f"{tuple(scale.shape)} do not fit a base tensor of {V} x {C}")
    out = base.float().clone()
    out[rows.long()] += q.float() * scale.float()[:, None]
    return out


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


def staging_paths(path: str | os.PathLike) -> tuple[Path, Path]:
    """The sibling folders :func:`write_model_dir` stages in: the new directory being written
    and the old one between the two renames, ``.<name>.mhmla-save.tmp`` and
    ``.<name>.mhmla-save.old`` (names no user picks: a ``<name>.old`` backup of a user's is
    never touched; hidden, so the package's data globs leave a leftover out of a wheel)."""
    full = Path(path).absolute()
    stem = f".{full.name}.mhmla-save"
    return full.with_name(stem + ".tmp"), full.with_name(stem + ".old")


def write_model_dir(path: str | os.PathLike, state: dict[str, torch.Tensor], config_json: str,
                    tokenizer=None, metadata: dict[str, str] | None = None) -> Path:
    """Write a model directory: complete and fsynced in a sibling staging folder first
    (:func:`staging_paths`; ``config.json`` written last, so a staged folder that has it is
    whole), then swapped in by two renames (the old one to the ``.old`` staging name, removed
    last). A crash leaves the old directory, the new one, or (between the renames) both staged,
    which :func:`recover_model_dir` sorts out.

    ``path`` must be absent, empty, or a model directory (FileExistsError otherwise, before
    anything is written): a directory is replaced whole, so a folder of other files is never
    taken for one."""
    from safetensors.torch import save_file

    path = Path(path)
    check_save_target(path)
    full = path.absolute()
    tmp, old = staging_paths(full)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt", **(metadata or {})})
    # safetensors creates its file private (0600) whatever the umask; a model folder is read
    # by whoever serves it, so its weights get the mode of any other new file
    os.chmod(tmp / "model.safetensors", 0o666 & ~current_umask())
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    (tmp / "config.json").write_text(config_json)  # last: its presence marks a whole folder
    for f in tmp.iterdir():
        fsync_file(f)
    fsync_dir(tmp)
    _swap_in(tmp, full, old)
    return path


def install_model_dir(staged: str | os.PathLike, path: str | os.PathLike) -> Path:
    """Put the whole model directory ``staged`` (written and checked beside ``path``, on the
    same file system) in place at ``path``, replacing a model directory there, by the two
    renames of :func:`write_model_dir`: a script that ships a model checks it in a folder of
    its own first, so that the shipped one is replaced only by one that passed."""
    path = Path(path)
    check_save_target(path)
    full = path.absolute()
    _swap_in(Path(staged).absolute(), full, staging_paths(full)[1])
    return path


@contextlib.contextmanager
def candidate_dir(path: str | os.PathLike) -> Iterator[Path]:
    """A fresh folder ``.<name>.candidate`` beside ``path`` for a model to be written and
    checked in, removed on leaving the block; :func:`install_model_dir` (inside the block)
    puts one that passed in place. So a ship script replaces a shipped model only with a
    checked one, and one cut short or refused leaves it untouched."""
    path = Path(path)
    staged = path.with_name(f".{path.name}.candidate")
    if staged.exists():
        shutil.rmtree(staged)
    try:
        yield staged
    finally:
        shutil.rmtree(staged, ignore_errors=True)


def _swap_in(new: Path, full: Path, old: Path) -> None:
    """``new`` to ``full``; a directory there first to ``old``, removed after the swap."""
    if full.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(full, old)
        os.replace(new, full)
        fsync_dir(full.parent)
        shutil.rmtree(old)
    else:
        os.replace(new, full)
    fsync_dir(full.parent)


def recover_model_dir(path: str | os.PathLike) -> None:
    """Finish what a killed :func:`write_model_dir` left at ``path``: when the directory is
    missing (a kill between the two renames, or during a first save), the staged new one is
    put in place if it is whole (its ``config.json``, written last, is there), else the staged
    old one; leftover staging folders are then removed. Nothing else is touched."""
    full = Path(path).absolute()
    tmp, old = staging_paths(full)
    # (<name>.tmp and <name>.old: the staging names of versions before 2026-12-07, taken only
    # when nothing else is there, and never removed: such a folder may be a user's)
    legacy = (full.with_name(full.name + ".tmp"), full.with_name(full.name + ".old"))
    if not full.exists():
        for candidate in (tmp, old, *legacy):
            if (candidate / "config.json").is_file() and (candidate / "model.safetensors").is_file():
                os.replace(candidate, full)
                fsync_dir(full.parent)
                break
    for leftover in (tmp, old):
        if leftover.exists():
            shutil.rmtree(leftover, ignore_errors=True)


_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
BASE_CHECKSUMS = "base_checksums"  # model.safetensors' metadata key (JSON: base key -> checksum)


def tensor_checksum(t: torch.Tensor) -> str:
    """``shape|dtype|sum``: the tensor's shape, dtype and the exact sum (mod 2^64) of its bit
    patterns read as integers; a fingerprint of a base tensor that a saved model completes
    itself with, cheap enough for every load (57 ms for all of MiniLM's tensors)."""
    flat = t.detach().reshape(-1).contiguous()
    total = int(flat.view(_INT_OF_SIZE[flat.element_size()]).sum(dtype=torch.int64))
    return f"{list(t.shape)}|{str(t.dtype).removeprefix('torch.')}|{total}"


@functools.lru_cache(maxsize=1)
def _embedded_checksums() -> dict[str, str]:
    """The checksums of the embedded encoder's tensors that the models shipped before the
    record (``embedded_encoder_checksums.json``) were made against."""
    return json.loads((Path(__file__).parent / "embedded_encoder_checksums.json").read_text())


def _check_base(path: Path, base_file: Path, base: dict[str, torch.Tensor],
                base_tensors: dict[str, str], recorded: dict[str, str] | None) -> None:
    """ValueError when a base tensor ``path`` completes itself with differs from the one it was
    saved against (``recorded``, from its file's metadata): its weights would silently be
    others. A file from before the record, on the embedded encoder, is compared with the
    checksums of the encoder the shipped models were made against, and only warned about (a
    stand-in encoder with rounded weights, on purpose, is such a case)."""
    import warnings

    legacy = recorded is None
    if legacy:
        if Path(resolve_encoder(EMBEDDED_ENCODER)).resolve() != base_file.parent.resolve():
            return
        recorded = _embedded_checksums()
    differ = sorted(b for b in set(base_tensors.values())  # (a missing one: said by the caller)
                    if b in recorded and b in base and tensor_checksum(base[b]) != recorded[b])
    if not differ:
        return
    message = (f"{path}: made against other encoder files than {base_file} ({len(differ)} "
               f"base tensors differ, e.g. {differ[0]!r}): its weights would not be the saved "
               "ones; install the encoder it was made with")
    if not legacy:
        raise ValueError(message)
    warnings.warn(message, stacklevel=3)


def base_checksums(base_tensors: dict[str, str], encoder_dir: str | os.PathLike
                   ) -> dict[str, str]:
    """:func:`tensor_checksum` of each base tensor named by ``base_tensors`` in
    ``encoder_dir``'s ``model.safetensors`` (what a save records)."""
    from safetensors import safe_open

    with safe_open(str(Path(encoder_dir) / "model.safetensors"), "pt") as f:
        return {b: tensor_checksum(f.get_tensor(b)) for b in sorted(set(base_tensors.values()))}


def read_model_state(path: str | os.PathLike, base_tensors: dict[str, str],
                     encoder_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """``model.safetensors`` of ``path`` completed with the tensors of the base encoder in
    ``encoder_dir`` named by ``base_tensors``, each plus its row delta where the file has
    one (:func:`row_delta`); checked against the base tensors' checksums the file recorded
    (:func:`_check_base`)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(path)
    with safe_open(str(path / "model.safetensors"), "pt") as f:  # (once: tensors and metadata)
        state = {k: f.get_tensor(k) for k in f.keys()}
        recorded = (f.metadata() or {}).get(BASE_CHECKSUMS)
    if base_tensors:
        base_file = Path(encoder_dir) / "model.safetensors"
        base = load_file(base_file)
        _check_base(path, base_file, base, base_tensors,
                    json.loads(recorded) if recorded else None)
        for key, base_key in base_tensors.items():
            if base_key not in base:
                raise ValueError(f"{base_file}: lacks {base_key!r} needed by {path}")
            parts = [state.pop(f"{key}:{part}", None) for part in DELTA_PARTS]
            if all(p is None for p in parts):
                state[key] = base[base_key]
            elif any(p is None for p in parts):
                raise ValueError(f"{path / 'model.safetensors'}: the row delta of {key!r} is "
                                 f"incomplete (needs {', '.join(DELTA_PARTS)})")
            else:
                try:
                    state[key] = apply_row_delta(base[base_key], *parts)
                except ValueError as e:
                    raise ValueError(f"{path / 'model.safetensors'}: {key!r}: {e}") from None
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

    def trained_encoder_matrices(self) -> tuple[str, ...]:
        """The trained (not frozen) 2-D ``encoder.*`` parameters: what ``save(row_deltas=...)``
        can store as int8 row deltas against the embedded encoder."""
        return tuple(name for name, p in self.named_parameters()  # type: ignore[attr-defined]
                     if p.requires_grad and p.dim() == 2 and name.startswith("encoder."))

    def save(self, path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
             tokenizer=None, row_deltas: Sequence[str] = ()) -> Path:
        """Write ``config.json``, ``model.safetensors`` (in ``dtype``) and the tokenizer
        (``tokenizer``, else ``self.tokenizer``, if any) atomically.

        row_deltas: trained ``encoder.*`` tensors to store as a row delta against the embedded
        encoder's own (:func:`row_delta`; e.g. ``encoder.embeddings.word_embeddings.weight``
        trained with ``--freeze none``), ValueError with any other encoder."""
        embedded = self.config.encoder_spec.name_or_path == EMBEDDED_ENCODER
        if row_deltas and not embedded:
            raise ValueError(f"row_deltas: only against the embedded encoder "
                             f"({EMBEDDED_ENCODER}), not {self.config.encoder_spec.name_or_path!r}")
        base = frozen_encoder_keys(self) if embedded else {}
        params = dict(self.named_parameters())
        bad = [k for k in row_deltas if k not in params or not k.startswith("encoder.") or k in base]
        if bad:
            raise ValueError(f"row_deltas: {bad} are not trained encoder parameters")
        deltas = {k: k[len("encoder."):] for k in row_deltas}
        self.config.base_tensors = {**base, **deltas}
        state = state_to_save(self, self.config.base_tensors, dtype)
        if deltas:
            from safetensors import safe_open

            base_file = Path(resolve_encoder(EMBEDDED_ENCODER)) / "model.safetensors"
            with safe_open(base_file, "pt") as f:
                for key, base_key in deltas.items():
                    parts = row_delta(params[key], f.get_tensor(base_key))
                    state.update({f"{key}:{n}": t for n, t in parts.items()})
        metadata = {}
        if self.config.base_tensors:  # which base tensors it completes itself with, checked
            metadata[BASE_CHECKSUMS] = json.dumps(base_checksums(
                self.config.base_tensors, resolve_encoder(EMBEDDED_ENCODER)))
        return write_model_dir(path, state, self.config.to_json(), tokenizer or self.tokenizer,
                               metadata=metadata)

    @classmethod
    def load(cls: type[M], path: str | os.PathLike, *, device: str | torch.device = "cpu",
             dtype: torch.dtype = torch.float32, backend: str = "auto") -> M:
        """Rebuild a saved model offline (no network, no hub), in eval mode. A damaged folder
        (a config that does not parse or holds settings this version does not know, weights cut
        short or of another shape) is a ValueError naming the file."""
        from safetensors import SafetensorError

        path = require_model_dir(path, cls.model_kind)
        config_file, weights_file = path / "config.json", path / "model.safetensors"
        try:
            config = cls.config_class.from_json(config_file.read_text())
        except (ValueError, TypeError, KeyError, AttributeError) as err:
            newer = (" (settings of a newer mhmla-fast?)" if isinstance(err, TypeError)
                     and "unexpected" in str(err) else "")
            message = str(err).removeprefix("config.json: ")
            raise ValueError(f"{config_file}: not a usable {cls.model_kind} config: "
                             f"{message}{newer}") from err
        try:
            model = cls(config, pretrained=False, backend=backend)
        except ValueError as err:  # (a config's own complaint names the file, not the folder)
            if str(err).startswith("config.json: "):
                raise ValueError(f"{config_file}: {str(err).removeprefix('config.json: ')}"
                                 ) from err
            raise
        try:
            state = read_model_state(path, config.base_tensors,
                                     resolve_encoder(config.encoder_spec))
            load_checked_state(model, state, path)
        except (SafetensorError, RuntimeError) as err:  # (a truncated file, other shapes)
            raise ValueError(f"{weights_file}: does not load ({str(err).strip()[:500]})") from err
        model._after_load(path)
        return model.to(device=device, dtype=dtype).eval()

    def _after_load(self, path: Path) -> None:
        """Called by :meth:`load` once the weights are in (nothing by default)."""
