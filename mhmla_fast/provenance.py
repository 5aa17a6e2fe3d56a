"""What a results file records about where it came from: versions, commit, device."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path


# the project's root in a checkout (the folder holding mhmla_fast/ and kernels/)
_ROOT = Path(__file__).resolve().parents[1]


def git_commit() -> str:
    """This project's HEAD in a checkout, with ``-dirty`` for uncommitted changes to tracked
    files (``$MHMLA_COMMIT`` wins, for copies without .git); "unknown" elsewhere, including an
    installed package that happens to lie inside another git repository (whose HEAD it
    recorded before: see :func:`package_version` for what an installed package is)."""
    if os.environ.get("MHMLA_COMMIT"):
        return os.environ["MHMLA_COMMIT"]

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=_ROOT,
                              timeout=10)

    try:
        top = git("rev-parse", "--show-toplevel")
        if top.returncode != 0 or Path(top.stdout.strip()).resolve() != _ROOT:
            return "unknown"
        out = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
        if out.returncode == 0:
            return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def package_version() -> str | None:
    """The installed mhmla-fast distribution's version (None when not installed, e.g. run
    from a checkout on ``sys.path``)."""
    from importlib import metadata

    try:
        return metadata.version("mhmla-fast")
    except metadata.PackageNotFoundError:
        return None


def cpu_info() -> dict:
    """CPU model name (from /proc/cpuinfo), logical and physical cores, usable cores."""
    from .devices import cpuinfo_fields, physical_cores, usable_cpus

    model = next((v for k, v in cpuinfo_fields() if k == "model name"), None)
    return {"cpu": model or platform.processor() or platform.machine(),
            "logical_cores": os.cpu_count(), "physical_cores": physical_cores(),
            "usable_cores": usable_cpus()}


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def dated_results_path(out: str | None, stem: str, default_dir: Path,
                       today: datetime.date | None = None) -> Path:
    """``out`` when it names a ``.json`` file; else ``<out or default_dir>/<stem>_<date>.json``,
    with ``-2``, ``-3``... appended rather than overwriting an existing file."""
    if out is not None and out.endswith(".json"):
        return Path(out)
    directory = Path(out) if out is not None else default_dir
    name = f"{stem}_{(today or datetime.date.today()).isoformat()}"
    path, i = directory / f"{name}.json", 2
    while path.exists():
        path, i = directory / f"{name}-{i}.json", i + 1
    return path


def provenance() -> dict:
    import torch
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name()
    else:
        device = f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} logical cores"
    return {
        "device": device, "torch": torch.__version__, "triton": triton_version,
        "transformers": transformers.__version__, "python": platform.python_version(),
        "mhmla_fast": package_version(), "commit": git_commit(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(shlex.quote(a) for a in [Path(sys.argv[0]).name, *sys.argv[1:]]),
    }
