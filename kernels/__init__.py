"""Triton kernels of mhmla-fast, installed as the package ``mhmla_fast.kernels``.

This folder sits at the top of the repository (``kernels/``, the layout the project was
asked for) and ``pyproject.toml`` maps it into the package (``[tool.setuptools.package-dir]``:
``"mhmla_fast.kernels" = "kernels"``; ``kernels`` alone is another project's name on PyPI).
Import it by its installed name, ``mhmla_fast.kernels.layer_attention``, never as ``kernels``.

Importing ``mhmla_fast.kernels.layer_attention`` imports Triton and registers the custom ops
``mhmla_fast::layer_attention_fwd`` / ``_bwd``; nothing else happens on import.

Imported as plain ``kernels`` (which happens only when the repository root is on ``sys.path``:
``python -m`` or ``python -c`` run there), this folder would shadow Hugging Face's ``kernels``
package, which transformers >= 5.25 imports when it loads a model. In that case, and only then,
it hands the name over: if a package ``kernels`` is installed elsewhere on ``sys.path``, that
package is loaded as ``kernels`` in this module's place (a module may replace itself in
``sys.modules`` while it is imported); if none is installed, this empty module stays.
"""

if __name__ == "kernels":

    def _hand_over_name() -> None:
        import importlib.machinery
        import importlib.util
        import os
        import sys

        root = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = [p for p in sys.path if os.path.realpath(p or os.curdir) != root]
        spec = importlib.machinery.PathFinder.find_spec("kernels", path)
        if spec is None or spec.origin is None or spec.loader is None:  # none, or a namespace
            return
        module = importlib.util.module_from_spec(spec)
        sys.modules["kernels"] = module
        spec.loader.exec_module(module)

    _hand_over_name()
    del _hand_over_name
