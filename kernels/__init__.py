"""Triton kernels of mhmla-fast, installed as the package ``mhmla_fast.kernels``.

This folder sits at the top of the repository (``kernels/``, the layout the project was
asked for) and ``pyproject.toml`` maps it into the package (``[tool.setuptools.package-dir]``:
``"mhmla_fast.kernels" = "kernels"``; ``kernels`` alone is another project's name on PyPI).
Import it by its installed name, ``mhmla_fast.kernels.layer_attention``, never as ``kernels``.

Importing ``mhmla_fast.kernels.layer_attention`` imports Triton and registers the custom ops
``mhmla_fast::layer_attention_fwd`` / ``_bwd``; nothing else happens on import.
"""
