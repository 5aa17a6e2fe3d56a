"""What a wheel carries: every package folder and every shipped model file is listed in
pyproject.toml (a non-editable ``pip install`` would otherwise leave it out, and the tests,
run from the checkout, would not notice)."""

from __future__ import annotations

import fnmatch
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[1]


def _setuptools() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]


def _package_dir(name: str, package_dir: dict[str, str]) -> Path:
    for prefix in sorted(package_dir, key=len, reverse=True):
        if name == prefix or name.startswith(prefix + "."):
            rest = name[len(prefix):].lstrip(".")
            return ROOT / package_dir[prefix] / rest.replace(".", "/")
    return ROOT / name.replace(".", "/")


def test_every_python_package_folder_is_listed():
    cfg = _setuptools()
    listed = {_package_dir(n, cfg.get("package-dir", {})) for n in cfg["packages"]}
    folders = {p.parent for top in ("mhmla_fast", "kernels")
               for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts}
    assert folders <= listed, sorted(map(str, folders - listed))


def test_every_shipped_model_file_goes_into_the_wheel():
    cfg = _setuptools()
    patterns = cfg["package-data"]["mhmla_fast.models"]
    models = ROOT / "mhmla_fast" / "models"
    files = [p.relative_to(models).as_posix() for p in models.rglob("*")
             if p.is_file() and "__pycache__" not in p.parts]
    assert any(f.endswith("model.safetensors") for f in files)
    missed = [f for f in files if not any(fnmatch.fnmatch(f, pat) for pat in patterns)]
    assert not missed, f"shipped model files left out of the wheel: {missed}"
    assert "embedded_encoder_checksums.json" in cfg["package-data"]["mhmla_fast"]
    assert (ROOT / "mhmla_fast" / "embedded_encoder_checksums.json").is_file()


def test_the_commit_is_this_projects_only(tmp_path, monkeypatch):
    """An installed package inside another git repository recorded that repository's HEAD as
    its commit in every results file; the commit is read only where the package's root is a
    repository's root, and the installed version is recorded beside it."""
    import shutil
    import subprocess

    from mhmla_fast import provenance

    if shutil.which("git") is None:  # (the GPU machine's copy of the tree may have no git)
        pytest.skip("git is not installed")

    monkeypatch.delenv("MHMLA_COMMIT", raising=False)
    other = tmp_path / "other"
    (other / "venv" / "site-packages").mkdir(parents=True)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(other)]
    subprocess.run([*git, "init", "-q"], check=True)
    (other / "f").write_text("x")
    subprocess.run([*git, "add", "f"], check=True)
    subprocess.run([*git, "commit", "-qm", "c"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    monkeypatch.setattr(provenance, "_ROOT", other / "venv" / "site-packages")
    assert provenance.git_commit() == "unknown"
    monkeypatch.setattr(provenance, "_ROOT", other.resolve())
    assert provenance.git_commit() == head
    (other / "f").write_text("y")
    assert provenance.git_commit() == head + "-dirty"
    monkeypatch.setenv("MHMLA_COMMIT", "abc123")
    assert provenance.git_commit() == "abc123"
    record = provenance.provenance()
    assert record["commit"] == "abc123"
    assert record["mhmla_fast"] == tomllib.load(open(ROOT / "pyproject.toml", "rb"))["project"]["version"]
