"""Automated essay scoring (AES) on ASAP: data reader, Taghipour & Ng folds, windows, metrics.

``data``: read ``training_set_rel3`` line by line, the 5-fold id lists, score scaling.
``windows``: split long essays into fixed-length word-piece windows and average window
predictions per essay. ``metrics``: quadratic weighted kappa and exact agreement.

The ASAP data is licensed research data: it is read from the shared data folder
(``mhmla_fast.paths.shared_data_dir()``) or a user-given path, never shipped with the package.
"""
