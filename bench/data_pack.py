"""A data folder's subfolders as one xz tarball for a device call, and back.

    python bench/data_pack.py pack .gpu/data fce asap_aes   # -> .gpu/data/data.tar.xz, the folders removed
    python bench/data_pack.py unpack .gpu/data              # on the device: the folders back, in place (once)

A device call carries at most 64 MiB with the tree (bench/travel.sh); the GED and AES text
files shrink about 4.7x in xz (7.0 to 1.5 MB for FCE and the ASAP sample of
``gpu_issue11.sh pack``). Python's ``tarfile`` does both ends, so the device needs no ``xz``
binary; ``unpack`` extracts with the ``data`` filter (no absolute paths, links out of the
folder or device files).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tarfile
from pathlib import Path

ARCHIVE = "data.tar.xz"


def pack(folder: Path, names: list[str]) -> Path:
    """``folder/<name>`` for each name into ``folder/data.tar.xz`` (written beside, then
    renamed), then those subfolders removed."""
    nested = [n for n in names if "/" in n or n in ("", ".", "..")]
    if nested:
        raise ValueError(f"{', '.join(nested)}: name folders directly in {folder}")
    missing = [n for n in names if not (folder / n).is_dir()]
    if missing:
        raise FileNotFoundError(f"{folder}: no folder {', '.join(missing)} to pack")
    archive, partial = folder / ARCHIVE, folder / (ARCHIVE + ".partial")
    with tarfile.open(partial, "w:xz", preset=9) as tar:
        for name in names:
            tar.add(folder / name, arcname=name)
    partial.replace(archive)
    for name in names:
        shutil.rmtree(folder / name)
    return archive


def unpack(folder: Path) -> list[str]:
    """``folder/data.tar.xz`` extracted into ``folder`` (the archive stays), unless this
    archive was extracted there in full already (a second call on a warm machine: the marker
    ``data.tar.xz.unpacked`` holds the archive's size and modification time, written after
    the extraction, so a cut-short one is done again). Returns the top-level names it
    extracted."""
    archive, marker = folder / ARCHIVE, folder / (ARCHIVE + ".unpacked")
    if not archive.is_file():
        raise FileNotFoundError(f"{archive}: no such archive (run 'pack' where the data is)")
    stamp = f"{archive.stat().st_size} {archive.stat().st_mtime_ns}"
    if marker.is_file() and marker.read_text() == stamp:
        return []
    with tarfile.open(archive, "r:xz") as tar:
        names = sorted({m.name.split("/", 1)[0] for m in tar.getmembers()})
        tar.extractall(folder, filter="data")
    marker.write_text(stamp)
    return names


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="data_pack.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("pack", help="subfolders of FOLDER into FOLDER/data.tar.xz (the subfolders removed)")
    a.add_argument("folder", type=Path)
    a.add_argument("names", nargs="+")
    b = sub.add_parser("unpack", help="FOLDER/data.tar.xz extracted into FOLDER")
    b.add_argument("folder", type=Path)
    args = p.parse_args(argv)
    try:
        if args.cmd == "pack":
            archive = pack(args.folder, args.names)
            print(f"{archive}: {archive.stat().st_size / 2**20:.1f} MiB ({' '.join(args.names)})")
        else:
            names = unpack(args.folder)
            print(f"{args.folder}: unpacked {' '.join(names)}" if names else
                  f"{args.folder}: already unpacked")
    except (OSError, ValueError, tarfile.TarError) as e:
        print(f"data_pack.py: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
