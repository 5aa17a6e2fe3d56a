"""bench/data_pack.py: the data a device call carries, as one xz tarball: unpacked it gives the
same files byte for byte; a missing folder or archive is an error; unsafe members are refused.
And gpu_issue11.sh's prepare unpacks it in place, once."""

from __future__ import annotations

import io
import subprocess
import tarfile
from pathlib import Path

import pytest

from bench_scripts import load_bench_script

REPO = Path(__file__).resolve().parents[1]


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_pack_then_unpack_gives_the_same_files(tmp_path, capsys):
    dp = load_bench_script("data_pack")
    data = tmp_path / "data"
    (data / "fce").mkdir(parents=True)
    (data / "asap_aes").mkdir()
    (data / "wheels").mkdir()
    (data / "fce" / "fce-public.dev.original.tsv").write_text("Dear\tc\nSir\ti\n" * 500, encoding="utf-8")
    (data / "asap_aes" / "t.tsv").write_bytes("essay_id\tprompt\n1\t1\tÉté, naïve\n".encode() * 100)
    (data / "wheels" / "x.whl").write_bytes(b"zip")
    before = _tree(data)

    assert dp.main(["pack", str(data), "fce", "asap_aes"]) == 0
    assert "data.tar.xz" in capsys.readouterr().out
    assert sorted(p.name for p in data.iterdir()) == ["data.tar.xz", "wheels"]  # the packed folders gone
    assert (data / "data.tar.xz").stat().st_size < sum(map(len, before.values())) / 4

    assert dp.main(["unpack", str(data)]) == 0
    assert capsys.readouterr().out.strip().endswith("unpacked asap_aes fce")
    after = _tree(data)
    del after["data.tar.xz"], after["data.tar.xz.unpacked"]
    assert after == before
    # an extraction cut short (no marker) is done again; a finished one is not
    (data / "fce" / "fce-public.dev.original.tsv").unlink()
    (data / "data.tar.xz.unpacked").unlink()
    assert dp.unpack(data) == ["asap_aes", "fce"] and dp.unpack(data) == []
    assert (data / "fce" / "fce-public.dev.original.tsv").is_file()
    assert dp.main(["pack", str(data), "fce/sub"]) == 2
    assert "name folders directly in" in capsys.readouterr().err

    assert dp.main(["pack", str(data), "nope"]) == 2
    assert "no folder nope to pack" in capsys.readouterr().err
    assert dp.main(["unpack", str(tmp_path / "empty")]) == 2
    assert "no such archive" in capsys.readouterr().err


def test_unpack_refuses_a_member_outside_the_folder(tmp_path):
    dp = load_bench_script("data_pack")
    folder = tmp_path / "data"
    folder.mkdir()
    with tarfile.open(folder / "data.tar.xz", "w:xz") as tar:
        info = tarfile.TarInfo("../escaped.txt")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    with pytest.raises(tarfile.TarError):
        dp.unpack(folder)
    assert not (tmp_path / "escaped.txt").exists()


def test_prepare_unpacks_the_carried_data_in_place_once(tmp_path):
    """gpu_issue11.sh's prepare (its data step, travel.sh's unpack_data; the device's
    environment and the stand-in encoder left out) on a tree that carries only the tarball."""
    dp = load_bench_script("data_pack")
    data = tmp_path / ".gpu" / "data"
    (data / "fce").mkdir(parents=True)
    (data / "fce" / "fce-public.test.original.tsv").write_text("A\tc\n")
    dp.pack(data, ["fce"])
    (tmp_path / "bench").mkdir()
    for name in ("data_pack.py", "travel.sh"):
        (tmp_path / "bench" / name).write_text((REPO / "bench" / name).read_text())
    script = (REPO / "bench" / "gpu_issue11.sh").read_text()
    prepare = script[script.index("prepare() {"):]
    prepare = prepare[:prepare.index("\n}\n") + 3]
    # keep the data step only: everything from the environment on is the device's
    prepare = prepare[:prepare.index("  device_env")] + "}\n"
    run = f"source bench/travel.sh\n{prepare}\nprepare && prepare && ls .gpu/data/fce"
    out = subprocess.run(["bash", "-c", run], cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    # unpacked by the first call only
    assert out.splitlines() == [".gpu/data: unpacked fce", ".gpu/data: already unpacked",
                                "fce-public.test.original.tsv"]
    # a folder carried unpacked (no archive): nothing to do
    (data / "data.tar.xz").unlink()
    out = subprocess.run(["bash", "-c", run], cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["fce-public.test.original.tsv"]
    assert (data / "fce" / "fce-public.test.original.tsv").read_text() == "A\tc\n"
