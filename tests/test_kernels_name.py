"""The top-level ``kernels/`` folder never shadows Hugging Face's ``kernels`` package.

With the repository root first on ``sys.path`` (a ``python -c`` run there), ``import kernels``
must give the installed package of that name (transformers >= 5.25 imports it), while
``mhmla_fast.kernels`` stays this repository's folder; with no such package installed, the
name falls back to the folder, which is then an empty module.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_PROBE = """
import json, sys
import kernels
out = {"kernels": kernels.__file__, "attr": getattr(kernels, "CUDAProperties", None)}
if len(sys.argv) > 1:
    import mhmla_fast.kernels as ours
    from kernels import CUDAProperties  # what transformers does
    out["ours"] = ours.__file__
    out["ours_name"] = ours.__name__
print(json.dumps(out))
"""


def _probe(*flags: str, pythonpath: Path | None = None, ours: bool = True) -> dict:
    import json

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    done = subprocess.run([sys.executable, *flags, "-c", _PROBE, *(["ours"] if ours else [])],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_an_installed_kernels_package_wins_over_the_folder(tmp_path):
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text('CUDAProperties = "hub"\n')
    out = _probe(pythonpath=site)
    assert Path(out["kernels"]) == site / "kernels" / "__init__.py"
    assert out["attr"] == "hub"
    assert Path(out["ours"]) == REPO / "kernels" / "__init__.py"
    assert out["ours_name"] == "mhmla_fast.kernels"


def test_without_one_the_name_stays_the_empty_folder():
    # -S: no site-packages, so no installed `kernels` can be found; '' (the root) is first
    out = _probe("-S", ours=False)
    assert Path(out["kernels"]) == REPO / "kernels" / "__init__.py"
    assert out["attr"] is None
