"""Console commands: one module per command, each exposing ``main``."""
