"""Grammatical error detection (GED): data readers (``.data``) and token-level metrics (``.metrics``)."""
