"""Command-line flags generated from a config dataclass, so that a field cannot be forgotten.

:func:`add_config_flags` adds one flag per field of a config (and of the groups it holds,
:data:`mhmla_fast.configs.GROUPS`): ``--<field-name>`` (``--num-heads``, ``--max-length``;
a field may name its flag in its metadata, as ``EncoderSpec.name_or_path`` does with
``--encoder``), with the field's type, default, choices and help. :func:`config_from_args`
builds the config back from the parsed arguments. Flags of before stay as aliases that warn
(:data:`RENAMED`).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
import warnings
from typing import Any

from ..configs import GROUPS

__all__ = ["add_config_flags", "config_from_args", "config_flags", "RENAMED"]

# old flag -> (new flag, dest, the value a flag without argument stands for)
RENAMED: dict[str, tuple[str, str, Any]] = {
    "--heads": ("--num-heads", "num_heads", None),
    "--head": ("--mode", "mode", None),
    "--freeze-word-embeddings": ("--freeze word_embeddings", "freeze", "word_embeddings"),
}


class _RenamedFlag(argparse.Action):
    """An old flag: sets the new flag's destination and warns (FutureWarning)."""

    def __init__(self, option_strings, dest, new: str = "", **kw):
        self.new = new
        super().__init__(option_strings, dest, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        warnings.warn(f"{option_string} is deprecated and will be removed: use {self.new}",
                      FutureWarning, stacklevel=2)
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)


def _default_of(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return f.default


def config_flags(cls: type) -> list[tuple[str, dataclasses.Field, Any, Any]]:
    """Every flag of ``cls``: (flag, field, type hint, default), groups expanded (a group's
    fields take the defaults of ``cls``'s default group, e.g. GED's max length 128)."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.metadata.get("cli", True):
            continue
        if f.name in GROUPS:
            group = _default_of(f)
            group_hints = typing.get_type_hints(GROUPS[f.name])
            for g in dataclasses.fields(GROUPS[f.name]):
                flag = g.metadata.get("flag", "--" + g.name.replace("_", "-"))
                out.append((flag, g, group_hints[g.name], getattr(group, g.name)))
            continue
        flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
        out.append((flag, f, hints[f.name], _default_of(f)))
    dests = [f.name for _, f, _, _ in out]
    if len(set(dests)) != len(dests):
        raise TypeError(f"{cls.__name__}: a field name occurs twice among its groups: {dests}")
    return out


def _base_type(hint: Any) -> tuple[Any, bool]:
    """(the type inside ``X | None``, whether None is allowed)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return hint, False


def add_config_flags(parser: argparse.ArgumentParser, cls: type, *, required: tuple[str, ...] = (),
                     optional: tuple[str, ...] = (), renamed: bool = True) -> None:
    """One flag per field of ``cls`` (see the module doc). ``required``: fields whose flag
    must be given; ``optional``: fields without a default whose flag defaults to None (the
    command fills them in); any other field without a default is required too. ``renamed``:
    also the old flags of :data:`RENAMED` whose destination is a field here."""
    dests: dict[str, dict[str, Any]] = {}
    for flag, f, hint, default in config_flags(cls):
        kw: dict[str, Any] = {"dest": f.name, "help": f.metadata.get("help")}
        if "choices" in f.metadata:
            kw["choices"] = f.metadata["choices"]
        base, _ = _base_type(hint)
        if default is dataclasses.MISSING:
            if f.name in optional:
                kw["default"] = None
            else:
                kw["required"] = True
        else:
            kw["default"] = default
        if f.name in required:
            kw.pop("default", None)
            kw["required"] = True
        if base is bool:
            kw["action"] = argparse.BooleanOptionalAction if default is True else "store_true"
        elif typing.get_origin(base) is tuple:
            kw.update(nargs="+", type=typing.get_args(base)[0])
        elif base in (int, float, str):
            kw["type"] = base
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: no flag for type {hint!r} "
                            "(give it metadata={'cli': False})")
        if "default" in kw and kw["default"] not in (None, False, True) and (
                "default" not in (kw["help"] or "")):
            kw["help"] = f"{kw['help']} (default {kw['default']})" if kw["help"] else (
                f"default {kw['default']}")
        parser.add_argument(flag, **kw)
        dests[f.name] = {k: kw[k] for k in ("type", "choices") if k in kw}
    if renamed:
        for old, (new, dest, const) in RENAMED.items():
            if dest in dests:
                how = {"nargs": 0, "const": const} if const is not None else dests[dest]
                parser.add_argument(old, dest=dest, action=_RenamedFlag, new=new,
                                    default=argparse.SUPPRESS, help=f"deprecated: {new}", **how)


def config_from_args(cls: type, args: argparse.Namespace, **values: Any) -> Any:
    """The ``cls`` that the flags of :func:`add_config_flags` describe; ``values`` override."""
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in values:
            kw[f.name] = values[f.name]
        elif f.name in GROUPS:
            group = GROUPS[f.name]
            kw[f.name] = group(**{g.name: getattr(args, g.name) for g in dataclasses.fields(group)})
        elif f.metadata.get("cli", True):
            kw[f.name] = getattr(args, f.name)
    return cls(**kw)
