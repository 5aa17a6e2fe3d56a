"""A model's weights in fp16 parts of bounded size, and back: how an encoder too large for one
device call travels to a lent GPU (``bench/gpu_issue13.sh``).

    python bench/weight_parts.py split MODEL_DIR OUT_DIR [--part-mb 28]   # OUT_DIR/1..K/part-K.safetensors
    python bench/weight_parts.py merge DIR                                # DIR/part-*.safetensors -> DIR/model/model.safetensors

``split``: every floating tensor in fp16, packed in order into parts of at most ``--part-mb``
MiB; a tensor that does not fit whole is cut into row blocks named ``<name>@<first row>``
that fill each part's room (unless only a sliver of it is left); part 1 also gets ``parts.json`` {"parts":
K, "tensors": N} and the model's other files (config, tokenizer) under ``model/``. ``merge``: every part present (else an error
naming how many are missing), the row blocks concatenated in row order, floating tensors
upcast to fp32, N tensors checked, written as one ``model.safetensors``; the parts are removed.
The merged weights are the original's rounded to fp16, exactly.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".h5", ".onnx", ".msgpack", ".ot")


def split_state(state: dict[str, torch.Tensor], limit_bytes: float
                ) -> list[list[tuple[str, torch.Tensor]]]:
    """The parts of ``state`` (fp16 where floating), each at most ``limit_bytes``, packed in
    order. A tensor that does not fit in the current part's room is cut into row blocks
    ``<name>@<first row>`` that fill the room left, part by part; it starts the next part
    instead where that room is a sliver (under an eighth of a part) or it has no rows (a
    scalar). Before 2026-12-07 only tensors larger than half a part were cut: MPNet's
    4.5 MiB matrices then left about 3.5 MiB of each 17 MiB part empty (15 parts, not 13)."""
    parts: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0

    def add(name: str, t: torch.Tensor) -> None:
        nonlocal size
        parts[-1].append((name, t))
        size += t.numel() * t.element_size()

    def next_part() -> None:
        nonlocal size
        parts.append([])
        size = 0

    for name, t in state.items():
        t = (t.half() if t.is_floating_point() else t).contiguous()
        n = t.numel() * t.element_size()
        if size + n <= limit_bytes:
            add(name, t)
        elif not t.dim() or (limit_bytes - size < limit_bytes // 8 and n <= limit_bytes):
            next_part()
            add(name, t)
        else:
            row = t[0].numel() * t.element_size()
            first = 0
            while first < t.shape[0]:
                rows = min(int((limit_bytes - size) // row), t.shape[0] - first)
                if rows < 1 and size == 0:
                    raise ValueError(f"{name}: one row ({row} bytes) is larger than a part")
                if rows < 1 or (rows < t.shape[0] - first and rows * row < limit_bytes // 8):
                    next_part()  # no room, or only a sliver of it: a fresh part
                    continue
                add(f"{name}@{first}", t[first:first + rows].clone())
                first += rows
    return [part for part in parts if part]


def merge_state(parts: list[dict[str, torch.Tensor]], expected: int) -> dict[str, torch.Tensor]:
    """The tensors of ``parts`` with their row blocks joined, floating ones in fp32."""
    blocks: dict[str, list[tuple[int, torch.Tensor]]] = {}
    state: dict[str, torch.Tensor] = {}
    for part in parts:
        for name, t in part.items():
            if "@" in name:
                base, first = name.rsplit("@", 1)
                blocks.setdefault(base, []).append((int(first), t))
            else:
                state[name] = t
    for base, rows in blocks.items():
        state[base] = torch.cat([t for _, t in sorted(rows, key=lambda r: r[0])])
    if len(state) != expected:
        raise ValueError(f"{len(state)} tensors rebuilt, {expected} expected")
    return {k: (v.float() if v.is_floating_point() else v).contiguous() for k, v in state.items()}


def split(model_dir: Path, out: Path, part_mb: float) -> list[Path]:
    from safetensors.torch import load_file, save_file

    state = load_file(str(model_dir / "model.safetensors"))
    parts = split_state(state, part_mb * 2**20)
    folders = []
    for k, part in enumerate(parts, 1):
        folder = out / str(k)
        folder.mkdir(parents=True, exist_ok=False)
        save_file(dict(part), str(folder / f"part-{k}.safetensors"))
        folders.append(folder)
    (out / "1" / "model").mkdir()
    for f in model_dir.iterdir():
        if f.is_file() and f.suffix not in WEIGHT_SUFFIXES:
            shutil.copy(f, out / "1" / "model" / f.name)
    (out / "1" / "parts.json").write_text(json.dumps({"parts": len(parts), "tensors": len(state)}))
    return folders


def merge(root: Path) -> Path:
    from safetensors.torch import load_file, save_file

    meta = json.loads((root / "parts.json").read_text())
    found = sorted(root.glob("part-*.safetensors"))
    if len(found) != meta["parts"]:
        raise ValueError(f"{len(found)} of {meta['parts']} parts in {root}: put the missing ones")
    state = merge_state([load_file(str(f)) for f in found], meta["tensors"])
    out = root / "model" / "model.safetensors"
    save_file(state, str(out), metadata={"format": "pt"})
    for f in found:
        f.unlink()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("split")
    s.add_argument("model_dir", type=Path)
    s.add_argument("out", type=Path)
    s.add_argument("--part-mb", type=float, default=28.0)
    m = sub.add_parser("merge")
    m.add_argument("root", type=Path)
    args = p.parse_args(argv)
    if args.command == "split":
        for folder in split(args.model_dir, args.out, args.part_mb):
            mb = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20
            print(f"part {folder.name}: {mb:.1f} MiB")
    else:
        print(f"wrote {merge(args.root)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
