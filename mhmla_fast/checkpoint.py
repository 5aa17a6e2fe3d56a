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

A training run holds :func:`run_lock` on its folder: a second process started on the same
folder stops at once with :class:`RunLockedError` instead of interleaving its checkpoints,
log and best model with the first one's.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from . import filelock
from .durable import atomic_write_text, current_umask, replace_durably

__all__ = ["save_checkpoint", "load_checkpoint", "checkpoint_meta", "check_same_data", "check_same_precision",
           "check_same_inputs", "precision_recorded", "CheckpointWriter",
           "run_lock", "RunLockedError", "LOCK_FILE", "check_run_folder"]

LOCK_FILE = ".lock"


class RunLockedError(RuntimeError):
    """Another process is training into the same run folder."""


@contextmanager
def run_lock(out: Path, *, held: bool = True) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``out/.lock`` (holding this process's id) for the block.

    Raises :class:`RunLockedError` at once, naming the folder and the holder's process id, when
    another process holds it. ``held=False`` takes no lock: the other ranks of a torchrun job
    work in rank 0's folder under rank 0's lock. The lock goes with the process (a killed run
    leaves nothing held); where locks do not exist (Windows) none is taken.
    """
    if not held or not filelock.SUPPORTED:
        yield
        return
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if not filelock.try_lock(fd):
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise RunLockedError(
                f"{out}: another process (pid {holder}) is training into this folder; wait "
                "for it to finish or give this run another output folder")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def check_run_folder(out: Path, made: tuple[str, ...]) -> None:
    """Before a run starts or resumes in ``out``, what would otherwise fail or be lost only
    after its first epoch: ValueError if ``out`` is a file; FileExistsError if ``out/best`` is
    there and is not a model directory (:func:`~mhmla_fast.model_dir.check_save_target`);
    ValueError if ``out`` has no checkpoint but holds what a run writes there (``made``, e.g.
    ``("best", "log.json")``): a run whose checkpoint was removed, whose model and log a new
    run would replace."""
    from .model_dir import check_save_target

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out}: is a file; the output is a run folder (checkpoints, log, "
                         "best/): give a folder's name")
    check_save_target(out / "best")
    if not (out / "checkpoint.json").is_file():
        found = [n + ("/" if (out / n).is_dir() else "") for n in made if (out / n).exists()]
        if found:
            raise ValueError(
                f"{out}: holds {' and '.join(found)} of an earlier run but no checkpoint to "
                "resume it from, so a new run there would replace them; give another output "
                "folder, or move them away to start this one over")


def recover_run_dir(out: Path) -> None:
    """(Holding :func:`run_lock`, before a run starts or resumes.) Tidy what a killed run left
    in ``out``: its ``best/`` model directory caught between the two renames of a save is put
    back (:func:`~mhmla_fast.model_dir.recover_model_dir`), and the temporary files of writes a
    kill cut short (safetensors' ``.tmpXXXXXX``, ``.<name>.<random>.tmp`` of atomic writes) are
    removed."""
    from .model_dir import recover_model_dir

    if not out.is_dir():
        return
    recover_model_dir(out / "best")
    for f in out.iterdir():
        if f.is_file() and (re.fullmatch(r"\.tmp\w{6,}", f.name)
                            or (f.name.startswith(".") and f.name.endswith(".tmp"))):
            f.unlink(missing_ok=True)


def _snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, list]:
    """Copies on the CPU of the model's and optimizer's tensors and the RNG states (safe to
    write while training goes on), and the optimizer's param groups as JSON-able lists."""
    def copy(t) -> torch.Tensor:
        return torch.as_tensor(t).detach().to("cpu", copy=True).contiguous()

    tensors = {f"model.{k}": copy(v) for k, v in model.state_dict().items()}
    opt = optimizer.state_dict()
    for idx, st in opt["state"].items():
        for name, value in st.items():
            tensors[f"optim.{idx}.{name}"] = copy(value)
    tensors["rng.cpu"] = torch.get_rng_state()
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = s
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()}
              for g in opt["param_groups"]]
    return tensors, groups


def _write(out: Path, tensors: dict, groups: list, state_json: str, step: int) -> None:
    """The files of one checkpoint, in the order that keeps one complete checkpoint at any
    point (module docstring). ``state_json``: the caller's state, already as JSON."""
    from safetensors.torch import save_file

    name = f"checkpoint-{step}.safetensors"
    tmp = out / (name + ".tmp")
    save_file(tensors, tmp)
    os.chmod(tmp, 0o666 & ~current_umask())  # safetensors makes it 0600, whatever the umask
    replace_durably(tmp, out / name)
    meta = {**json.loads(state_json), "tensors": name, "param_groups": groups}
    atomic_write_text(out / "checkpoint.json", json.dumps(meta, indent=1))
    for old in [*out.glob("checkpoint-*.safetensors"), *out.glob("checkpoint-*.safetensors.tmp")]:
        if old.name != name:  # older checkpoints, and files of writes a kill cut short
            old.unlink(missing_ok=True)


def save_checkpoint(out: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    state: dict, step: int) -> None:
    """Write the checkpoint of ``model``, ``optimizer``, the RNGs and ``state`` (JSON-able)
    into ``out`` as ``checkpoint-<step>.safetensors`` + ``checkpoint.json``."""
    tensors, groups = _snapshot(model, optimizer)
    _write(out, tensors, groups, json.dumps(state), step)


class CheckpointWriter:
    """:func:`save_checkpoint` with the writing off the training loop: :meth:`save` copies the
    tensors to the CPU and captures ``state`` at once (what is saved is the call's moment), and
    a background thread writes the files; a save waits for the previous write to finish, and
    :meth:`close` (or leaving a ``with`` block) waits for the last. A write's error is raised
    by the next :meth:`save` or :meth:`close`. A run killed mid-write keeps the previous
    checkpoint (the same file order as :func:`save_checkpoint`)."""

    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict,
             step: int) -> None:
        self.wait()
        tensors, groups = _snapshot(model, optimizer)
        state_json = json.dumps(state)

        def run() -> None:
            try:
                _write(self.out, tensors, groups, state_json, step)
            except BaseException as err:  # raised in the training thread by the next call
                self._error = err

        self._thread = threading.Thread(target=run, name="mhmla-checkpoint", daemon=False)
        self._thread.start()

    def wait(self) -> None:
        """Wait for the write in progress, if any; raise its error, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"writing a checkpoint in {self.out} failed: {err}") from err

    close = wait

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.wait()
        elif self._thread is not None:  # leaving on an error: finish the write, raise nothing
            self._thread.join()
            self._thread = None


def check_same_data(meta: dict, data: dict[str, str], out: Path) -> None:
    """Refuse to resume on other data: ``data`` maps a data set's name ("train", "dev") to a
    digest of its content as read now, and ``meta["data"]`` holds the digests the run started
    with. A checkpoint written before digests were stored has none, and is not checked."""
    saved = meta.get("data") or {}
    changed = sorted(k for k in data if k in saved and saved[k] != data[k])
    if changed:
        raise ValueError(f"{out}: the {' and '.join(changed)} data differ from those the "
                         "checkpoint was trained on (same file names, other content); restore "
                         "them, or use another --out to train afresh")


def check_same_precision(meta: dict, applied: str, out: Path) -> None:
    """Refuse to go on in another arithmetic: ``applied`` is what this run's steps would run in
    ("fp32" or "bf16", :func:`mhmla_fast.devices.applied_precision`) and
    ``meta["precision_applied"]`` what the checkpoint's ran in ("auto" is bf16 on CUDA and on
    CPUs with bf16 instructions, fp32 on other CPUs, so a run moved between them would change
    silently). When both are recorded and equal, the configs may spell the precision
    differently ("auto" on a CPU without bf16 instructions and "fp32"): see
    :func:`precision_recorded`. A checkpoint from before the record is not checked here (its
    config's precision is compared as before)."""
    saved = meta.get("precision_applied")
    if saved is not None and saved != applied:
        raise ValueError(f"{out}: the checkpoint's steps ran in {saved} and this run's would run "
                         f"in {applied} (--precision auto means bf16 on CUDA and on CPUs with "
                         f"bf16 instructions, fp32 on other CPUs); pass --precision {saved} to "
                         "go on as the run started, or use another --out to train afresh")


def check_same_inputs(meta: dict, precision: str, data: dict[str, str], out: Path) -> None:
    """What a resume checks beyond its config, in this order: the same arithmetic
    (:func:`check_same_precision`, ``precision`` as applied now) and the same data
    (:func:`check_same_data`, ``data`` the digests of the sets as read now)."""
    check_same_precision(meta, precision, out)
    check_same_data(meta, data, out)


def precision_recorded(meta: dict) -> bool:
    """Whether the checkpoint records the arithmetic its steps ran in: then the config's
    ``precision`` field is compared by :func:`check_same_precision` instead of as spelled."""
    return meta.get("precision_applied") is not None


_UNREADABLE = ("{out}: the checkpoint cannot be read ({why}); remove checkpoint.json and "
               "checkpoint-*.safetensors there to start the run over, or use another --out")


def checkpoint_meta(out: Path) -> dict | None:
    """The JSON of ``out``'s checkpoint (its ``state`` plus "tensors" and "param_groups"), or
    None when there is none; no tensor is read. A run checks it before costly set-up that a
    checkpoint of another run would waste. An unreadable one raises ValueError naming the
    folder."""
    meta_path = out / "checkpoint.json"
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(_UNREADABLE.format(out=out, why=f"checkpoint.json: {err}")) from err
    if not (isinstance(meta, dict) and isinstance(meta.get("tensors"), str)):
        raise ValueError(_UNREADABLE.format(out=out, why="checkpoint.json names no tensors file"))
    return meta


def load_checkpoint(out: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    check: Callable[[dict], None] | None = None) -> dict | None:
    """Restore ``model``, ``optimizer`` and the RNGs from ``out``'s checkpoint; returns its
    JSON (the saved ``state`` plus "tensors" and "param_groups"), or None when there is none.

    ``check(meta)`` runs on the JSON before any tensor is loaded (a caller refuses a checkpoint
    of another run there, with its own message rather than a tensor size mismatch). A
    checkpoint that cannot be read raises ValueError naming the folder."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    meta = checkpoint_meta(out)
    if meta is None:
        return None
    tensors_path = out / meta["tensors"]
    if check is not None:
        check(meta)
    try:
        tensors = load_file(tensors_path)
    except (OSError, SafetensorError) as err:
        raise ValueError(_UNREADABLE.format(out=out, why=f"{meta['tensors']}: {err}")) from err
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
        # device i's state is rng.cuda.<i> (in device order, not name order: 10 after 9); a
        # run resumed with fewer devices visible restores theirs only
        saved = sorted((int(k.rsplit(".", 1)[1]), v) for k, v in tensors.items()
                       if k.startswith("rng.cuda."))
        for i, value in saved[:torch.cuda.device_count()]:
            torch.cuda.set_rng_state(value, i)
    return meta
