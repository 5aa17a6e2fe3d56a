"""pytest-benchmark settings for ``pytest bench/ --benchmark-only`` (never part of CI, which
collects only ``tests/``).

* Without ``--benchmark-json`` the run's JSON report goes to
  ``bench/results/pytest_benchmark_<device-slug>_<date>.json`` (UTC date; ``-2``, ``-3`` ...
  appended rather than overwriting). pytest-benchmark writes it only when a benchmark ran.
* ``machine_info`` in that report, and every benchmark's ``extra_info``, carry the device
  name and the torch / triton / CUDA / transformers versions and the commit
  (:func:`device_info`).

Nothing runs at import: torch is imported by the hooks, when pytest configures the run.
"""

from __future__ import annotations

import datetime
import functools
import os
import re
from pathlib import Path

import pytest

RESULTS_DIR = Path(__file__).resolve().parent / "results"
JSON_STEM = "pytest_benchmark"


@functools.cache
def device_info() -> dict:
    """Where the benchmarks run: ``device`` (the CUDA device name, or ``cpu: <model>``),
    ``device_kind`` ("cuda" or "cpu"), ``torch``, ``triton`` (None if absent), ``cuda``
    (``torch.version.cuda``; None on CPU builds), ``transformers``, ``python``, ``commit``
    (``$MHMLA_COMMIT``, else ``git rev-parse HEAD`` with ``-dirty`` for a modified tree, else
    ``$MHMLA_BENCH_COMMIT``, else "unknown") and ``torch_threads``."""
    import torch

    from mhmla_fast import provenance

    base = provenance.provenance()
    if torch.cuda.is_available():
        device, kind = torch.cuda.get_device_name(), "cuda"
    else:
        device, kind = f"cpu: {provenance.cpu_info()['cpu']}", "cpu"
    commit = base["commit"]
    if commit == "unknown":
        commit = os.environ.get("MHMLA_BENCH_COMMIT", "").strip() or commit
    return {"device": device, "device_kind": kind, "torch": base["torch"], "triton": base["triton"],
            "cuda": torch.version.cuda, "transformers": base["transformers"], "python": base["python"],
            "commit": commit, "torch_threads": torch.get_num_threads()}


def device_slug(device: str) -> str:
    """"NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"; "cpu: Intel(R) Xeon(R) ..." -> "cpu-intel-r-xeon-r-..."."""
    return re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-") or "device"


def default_json_path(today: datetime.date | None = None) -> Path:
    """``bench/results/pytest_benchmark_<device-slug>_<date>.json``, not overwriting."""
    from mhmla_fast.provenance import dated_results_path

    today = today or datetime.datetime.now(datetime.timezone.utc).date()
    return dated_results_path(None, f"{JSON_STEM}_{device_slug(device_info()['device'])}", RESULTS_DIR, today)


class LazyJsonPath(os.PathLike):
    """The report path handed to pytest-benchmark, created only when the report is written.

    pytest-benchmark >= 5 opens ``--benchmark-json`` itself (``open(path, "wb")``: this is an
    ``os.PathLike``); 4.x expects the open file that ``argparse.FileType("wb")`` made and
    writes ``with json as fh`` (this opens the file on entry)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._fh = None

    def __fspath__(self) -> str:
        return str(self.path)

    def __str__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"LazyJsonPath({str(self.path)!r})"

    @property
    def name(self) -> str:
        return str(self.path)

    def __enter__(self):
        self._fh = open(self.path, "wb")  # noqa: SIM115 - closed in __exit__
        return self._fh

    def __exit__(self, *exc) -> None:
        self._fh.close()
        self._fh = None


@pytest.hookimpl(tryfirst=True)  # before pytest-benchmark's own pytest_configure reads the option
def pytest_configure(config: pytest.Config) -> None:
    if not config.pluginmanager.hasplugin("benchmark"):
        raise pytest.UsageError("the benchmarks under bench/ need pytest-benchmark: "
                                "pip install 'pytest-benchmark>=4' (or the [bench] extra)")
    if config.getoption("benchmark_json") is not None or config.getoption("benchmark_disable"):
        return
    if config.getoption("collectonly") or config.getoption("help"):
        return
    path = default_json_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    config.option.benchmark_json = LazyJsonPath(path)


def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict) -> None:
    machine_info["mhmla_fast"] = device_info()


@pytest.fixture(autouse=True)
def _device_in_extra_info(request: pytest.FixtureRequest) -> None:
    """Every benchmark's ``extra_info`` names the device and versions (a row stands alone)."""
    if "benchmark" in request.fixturenames:
        request.getfixturevalue("benchmark").extra_info.update(device_info())
