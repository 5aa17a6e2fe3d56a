"""Triton kernels (installed as ``mhmla_fast.kernels``); import a submodule to register its ops."""
