"""Finished per-model results ("units") of the CPU protocol on disk, and when one is reused.

A unit is one model on one fold and prompt (or one joint model on a fold): its test and dev
predictions and scores, the settings it was made with and a digest of the essays of its splits.
:func:`reuse_unit` gives a stored unit back only for the same settings and the same essays;
anything else raises, so a rerun never reports results of other settings or other data.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from ..configs import nest_flat
from .data import Essay, digest_essays
from .heads import HeadTrainConfig

__all__ = ["data_digest", "nested_settings", "reuse_unit"]


def nested_settings(settings: dict | None) -> dict | None:
    """Settings of a unit written before issue 15 (the head's fields flat: ``head``,
    ``num_heads``, ``key_size``, ``dropout``) in today's layout (``layer_attention``)."""
    if not settings or "head" not in settings:
        return settings
    flat = {k: settings[k] for k in ("head", "num_heads", "key_size", "dropout") if k in settings}
    rest = {k: v for k, v in settings.items() if k not in flat}
    group = nest_flat(HeadTrainConfig, flat)["layer_attention"]
    return {**rest, "layer_attention": json.loads(json.dumps(asdict(group)))}


def data_digest(splits: dict, prompts: Sequence[int]) -> str:
    """A fingerprint of the essays a unit learns from, is selected on and is scored on: each
    prompt's train, dev and test essays in order (id, score and text)."""
    h = hashlib.sha256()
    for p in prompts:
        for name in ("train", "dev", "test"):
            h.update(f"\0{p}/{name}".encode())
            digest_essays(h, splits[p][name])
    return h.hexdigest()


def reuse_unit(path: Path, settings: dict, data: str, test: dict[int, list[Essay]]) -> dict | None:
    """A finished unit of the same settings and data, or None; another settings' or another
    data's unit raises. ``data``: :func:`data_digest` of the unit's splits; a unit from before
    the digest was stored is checked by its test essays and gold scores (``test``: prompt ->
    test essays)."""
    if not path.is_file():
        return None
    unit = json.loads(path.read_text())
    joint = "settings" not in unit
    old = next(iter(unit.values())).get("settings") if joint else unit.get("settings")
    want = json.loads(json.dumps(settings))
    if isinstance(old, dict) and "encoder_sha256" not in old:
        # a unit from before the encoder's fingerprint was stored: its name is all it recorded
        want.pop("encoder_sha256", None)
    old_now = nested_settings(old)
    if isinstance(old_now, dict) and old_now != want and (
            {**old_now, "encoder_sha256": None} == {**want, "encoder_sha256": None}):
        raise ValueError(f"{path} was made with other files under the encoder name "
                         f"{want.get('encoder')!r} (their sha256 differs); use another run "
                         "folder or remove it")
    if old_now != want:
        raise ValueError(f"{path} was made with other settings ({old} vs {settings}); "
                         "use another run folder or remove it")
    per_prompt = {int(p): u for p, u in unit.items()} if joint else {next(iter(test)): unit}
    stored = {u.get("data") for u in per_prompt.values()}
    same = (stored == {data} if stored != {None} else all(
        sorted(zip(u["ids"], u["gold"])) == sorted((e.essay_id, e.score) for e in test[p])
        for p, u in per_prompt.items()))
    if not same:
        raise ValueError(f"{path} was made from other essays or folds than this run's (the data "
                         "file or the fold ids changed); use another run folder or remove it")
    return unit
