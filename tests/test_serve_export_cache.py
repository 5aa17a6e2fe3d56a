"""``backend="auto"`` and its ONNX export cache (``mhmla_fast.serve.export_cache``): auto runs ONNX
Runtime on a cached export on the CPU and torch without onnxruntime; the cache is found again
without hashing and without a second export, also across processes, whose warm start imports no
torch; a failed export or validation is remembered and falls back to torch with one line; a
leftover staging directory is ignored; two exporters of one model export once; the labels equal
torch fp32's (tiny tagger, and the shipped one on learner sentences)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnx", reason="the ONNX export needs onnx (pip install onnx)")
pytest.importorskip("onnxruntime", reason="the ONNX runner needs onnxruntime")

from mhmla_fast.serve import export_cache, options  # noqa: E402
from mhmla_fast.serve.engine import Engine, default_tagger_path  # noqa: E402
from mhmla_fast.serve.export_cache import (  # noqa: E402
    ExportUnavailable, auto_runner, cache_root, ensure_export, lookup,
)
from mhmla_fast.serve.onnx_export import (  # noqa: E402
    VALIDATION_SENTENCES, ExportValidationError, validate_onnx,
)
from export_cache_fixtures import Lines, cache  # noqa: E402, F401 - the fixture

TEXTS = [
    "He go to school every days .",
    "They goes to the house and she see the dog .",
    "A cat .",
    "We went home , but the school was closed because of the snow and every dog in the "
    "house was barking at the postman who delivers letters every single morning .",
    *VALIDATION_SENTENCES,
]


def fake_exporter(calls: list, delay: float = 0.0, fail: Exception | None = None):
    """An exporter that writes a stand-in export (no torch), counting its calls."""

    def export(model_dir: Path, out: Path, threads: int | None = None) -> dict:
        calls.append(out)
        time.sleep(delay)
        if fail is not None:
            raise fail
        (out / "model.onnx").write_bytes(b"not really ONNX")
        (out / "export.json").write_text("{}")
        return {"validation": {"max_abs_diff": 0.0}}

    return export


@pytest.fixture(scope="module")
def warm(tiny_tagger_dir, tmp_path_factory) -> Path:
    """A cache holding the tiny tagger's real export (made once for the module)."""
    root = tmp_path_factory.mktemp("warm-cache")
    log = Lines()
    entry = ensure_export(tiny_tagger_dir, root, log=log)
    assert (entry.path / "model.onnx").is_file() and (entry.path / "cache.json").is_file()
    (line,) = log.lines  # one line: what, where, how long
    assert line.startswith("mhmla-fast: exporting tagger to ONNX once") and str(entry.path) in line
    assert line.endswith(" s") and " done in " in line
    return root


# ------------------------------------------------------------------------------ the rule


def test_auto_runs_onnx_from_the_cache_and_tags_like_torch(warm, tiny_tagger_dir, tiny_engine,
                                                           monkeypatch):
    monkeypatch.setenv("MHMLA_CACHE_DIR", str(warm))
    engine = Engine.load(tiny_tagger_dir, device="cpu", threads=1)  # backend auto by default
    assert engine.runner.backend == "onnx"
    assert engine.runner.path.parent.parent == warm / "onnx"
    got, want = engine.tag_texts(TEXTS), tiny_engine.tag_texts(TEXTS)
    assert [r.labels for r in got] == [r.labels for r in want]
    assert any("i" in r.labels for r in want) and any("c" in r.labels for r in want)
    np.testing.assert_allclose(np.concatenate([r.probs for r in got]),
                               np.concatenate([r.probs for r in want]), atol=1e-5)


def test_auto_runs_torch_without_onnxruntime(tiny_tagger_dir, cache, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # "import onnxruntime" fails
    assert options.resolve_options("auto", "cpu").backend == "torch"
    engine = Engine.load(tiny_tagger_dir, threads=1)
    assert engine.runner.backend == "torch" and not cache.exists()


def test_options_only_torch_has_make_auto_torch(warm, tiny_tagger_dir, monkeypatch):
    monkeypatch.setenv("MHMLA_CACHE_DIR", str(warm))
    engine = Engine.load(tiny_tagger_dir, device="cpu", dtype="float16", threads=1)
    assert engine.runner.backend == "torch" and engine.runner.dtype.itemsize == 2


def test_no_cache_runs_torch_and_writes_nothing(tiny_tagger_dir, cache, monkeypatch):
    assert Engine.load(tiny_tagger_dir, device="cpu", threads=1, cache=False
                       ).runner.backend == "torch"
    monkeypatch.setenv("MHMLA_NO_CACHE", "1")
    assert auto_runner(tiny_tagger_dir, threads=1).backend == "torch"
    assert not cache.exists()


def test_the_no_cache_option_of_the_command(tiny_tagger_dir, tiny_engine, cache, tmp_path,
                                            monkeypatch):
    from mhmla_fast.commands import serve as cli
    from mhmla_fast.serve import engine as engine_module

    seen = []
    real = engine_module.Engine.load.__func__

    def spy(cls, path, **kw):
        engine = real(cls, path, **kw)
        seen.append(engine.runner.backend)
        return engine

    monkeypatch.setattr(engine_module.Engine, "load", classmethod(spy))
    src, out = tmp_path / "in.txt", tmp_path / "out.jsonl"
    src.write_text("He go to school every days .\n")
    assert cli.main(["tag", str(src), "-o", str(out), "--model", str(tiny_tagger_dir),
                     "--no-progress", "--threads", "1", "--no-cache"]) == 0
    assert seen == ["torch"] and not cache.exists()
    assert json.loads(out.read_text())["labels"] == tiny_engine.tag_texts(
        ["He go to school every days ."])[0].labels


def test_an_export_directory_is_run_as_it_is(warm, tiny_tagger_dir, cache):
    entry = lookup(tiny_tagger_dir, warm).entry
    runner = auto_runner(entry.path, threads=1)
    assert runner.backend == "onnx" and runner.path == entry.path / "model.onnx"
    assert not cache.exists()


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MHMLA_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "a"
    monkeypatch.delenv("MHMLA_CACHE_DIR")
    assert cache_root() == tmp_path / "xdg" / "mhmla-fast"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root() == Path.home() / ".cache" / "mhmla-fast"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # the XDG spec: ignored
    assert cache_root() == Path.home() / ".cache" / "mhmla-fast"


def test_no_home_directory_makes_auto_run_torch(tiny_tagger_dir, monkeypatch):
    """No $HOME and no passwd entry (a container's arbitrary uid): auto runs torch with one
    line saying how to give it a cache, instead of failing to start."""
    monkeypatch.delenv("MHMLA_CACHE_DIR", raising=False)
    monkeypatch.delenv("MHMLA_NO_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    with pytest.raises(ExportUnavailable, match="MHMLA_CACHE_DIR"):
        cache_root()
    log = Lines()
    runner = auto_runner(tiny_tagger_dir, threads=1, log=log)
    assert runner.backend == "torch"
    assert "no home directory" in log.text and "MHMLA_CACHE_DIR" in log.text


# ---------------------------------------------------------------------------- the cache


def test_the_cache_is_reused_without_a_second_export_or_hashing(tiny_tagger_dir, cache,
                                                                monkeypatch):
    calls: list = []
    first = ensure_export(tiny_tagger_dir, cache, log=Lines(), exporter=fake_exporter(calls))
    assert len(calls) == 1 and first.path.parent == cache / "onnx"
    hashed: list = []
    real = export_cache.content_key
    monkeypatch.setattr(export_cache, "content_key", lambda files: hashed.append(1) or real(files))
    log = Lines()
    assert ensure_export(tiny_tagger_dir, cache, log=log, exporter=fake_exporter(calls)) == first
    assert len(calls) == 1 and hashed == [] and log.text == ""  # quick key: no hashing, silent
    # a touched file: hashed again, the same content finds the same entry (no export)
    config = tiny_tagger_dir / "config.json"
    st = config.stat()
    try:
        os.utime(config, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        assert ensure_export(tiny_tagger_dir, cache, log=log, exporter=fake_exporter(calls)) == first
        assert len(calls) == 1 and hashed == [1] and log.text == ""
    finally:
        os.utime(config, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_new_content_or_versions_make_a_new_entry(tiny_tagger_dir, cache, tmp_path, monkeypatch):
    import shutil

    calls: list = []
    first = ensure_export(tiny_tagger_dir, cache, log=Lines(), exporter=fake_exporter(calls))
    other = tmp_path / "other"
    shutil.copytree(tiny_tagger_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["threshold"] = 0.25
    (other / "config.json").write_text(json.dumps(config))
    second = ensure_export(other, cache, log=Lines(), exporter=fake_exporter(calls))
    assert second.key != first.key and len(calls) == 2
    real = export_cache.runtime_versions
    monkeypatch.setattr(export_cache, "runtime_versions", lambda: {**real(), "onnxruntime": "9"})
    third = ensure_export(tiny_tagger_dir, cache, log=Lines(), exporter=fake_exporter(calls))
    assert third.key not in (first.key, second.key) and len(calls) == 3


def test_a_failed_validation_is_remembered_and_falls_back_to_torch(tiny_tagger_dir, cache,
                                                                   monkeypatch, capsys):
    calls: list = []
    boom = ExportValidationError("model.onnx (fp32): the label (p >= 0.5) differs from torch's "
                                 "at 1 of 900 positions")
    monkeypatch.setattr(export_cache, "_default_export", fake_exporter(calls, fail=boom))
    runner = auto_runner(tiny_tagger_dir, threads=1)
    assert runner.backend == "torch" and len(calls) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2  # the export's own line (ending in "failed"), then why torch runs
    assert err[0].startswith("mhmla-fast: exporting tagger") and " failed after " in err[0]
    assert err[1].startswith("mhmla-fast: backend auto runs torch for tagger: its ONNX export "
                             "failed on ") and "differs from torch's" in err[1]
    (record,) = (cache / "onnx").glob("*.failed.json")
    assert "ExportValidationError" in json.loads(record.read_text())["error"]
    assert str(record) in err[1]
    # the next run does not try again: one line, the same reason, no export
    assert auto_runner(tiny_tagger_dir, threads=1).backend == "torch" and len(calls) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert "differs from torch's" in line and "delete it to try again" in line
    with pytest.raises(ExportUnavailable, match="its ONNX export failed"):
        ensure_export(tiny_tagger_dir, cache, exporter=fake_exporter(calls))
    record.unlink()  # deleting the record retries
    ensure_export(tiny_tagger_dir, cache, log=Lines(), exporter=fake_exporter(calls))
    assert len(calls) == 2


def test_a_failure_to_write_is_not_remembered(tiny_tagger_dir, cache):
    calls: list = []
    full = OSError(28, "No space left on device")
    with pytest.raises(ExportUnavailable, match="could not be written .*No space left"):
        ensure_export(tiny_tagger_dir, cache, log=Lines(), exporter=fake_exporter(calls, fail=full))
    assert list((cache / "onnx").glob("*.failed.json")) == []
    ensure_export(tiny_tagger_dir, cache, log=Lines(), exporter=fake_exporter(calls))
    assert len(calls) == 2  # tried again, and made


@pytest.mark.parametrize("error", [
    ImportError("no module named onnxruntime.quantization"), MemoryError(),
    RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"),
    RuntimeError("Could not allocate bytes object!"),
    type("Fail", (Exception,), {})(  # ONNX Runtime's own classes are not RuntimeErrors
        "[ONNXRuntimeError] : 1 : FAIL : Failed to allocate memory for requested buffer"),
    type("RuntimeException", (Exception,), {})("std::bad_alloc"),
])
def test_an_environment_failure_is_not_remembered(tiny_tagger_dir, cache, error):
    calls: list = []
    with pytest.raises(ExportUnavailable, match="could not be made here"):
        ensure_export(tiny_tagger_dir, cache, log=Lines(), exporter=fake_exporter(calls, fail=error))
    assert list((cache / "onnx").glob("*.failed.json")) == []


def test_a_model_changed_during_its_export_is_neither_kept_nor_recorded(tiny_tagger_dir, cache,
                                                                       tmp_path):
    """The entry is named by the content read before the export: if the files change while it
    runs (a trainer publishing a new checkpoint), what was exported is not that content, so it
    is dropped, and a failure then is not the old content's to record."""
    import shutil

    model = tmp_path / "tagger"
    shutil.copytree(tiny_tagger_dir, model)
    config = json.loads((model / "config.json").read_text())

    def publish(changed: dict) -> None:
        (model / "config.json").write_text(json.dumps({**config, **changed}))

    for fail in (None, ValueError("the new checkpoint does not trace")):
        calls: list = []
        exporter = fake_exporter(calls, fail=fail)

        def racing(model_dir, out, exporter=exporter):
            publish({"threshold": 0.123 if fail is None else 0.456})
            return exporter(model_dir, out)

        publish({})
        with pytest.raises(ExportUnavailable, match="changed during its export"):
            ensure_export(model, cache, log=Lines(), exporter=racing)
        onnx = cache / "onnx"
        assert [p for p in onnx.iterdir() if p.is_dir() and p.name != "index"] == []
        assert list(onnx.glob("*.failed.json")) == []
    publish({})  # the old content again: exported afresh, not served the new one's export
    calls = []
    entry = ensure_export(model, cache, log=Lines(), exporter=fake_exporter(calls))
    assert len(calls) == 1 and (entry.path / "model.onnx").is_file()


def test_an_entry_is_readable_by_others_by_the_umask(tiny_tagger_dir, cache):
    """A cache made ahead (an image build) by one user is read by another: the entry's folder
    takes the umask's mode, not a temporary folder's 0700."""
    old = os.umask(0o022)
    try:
        entry = ensure_export(tiny_tagger_dir, cache, log=Lines(), exporter=fake_exporter([]))
    finally:
        os.umask(old)
    assert entry.path.stat().st_mode & 0o777 == 0o755


def test_threads_reach_the_export_and_omp_num_threads_the_default(tiny_tagger_dir, cache,
                                                                 monkeypatch):
    """--threads holds for the export made on first use (torch and the validation's ONNX
    Runtime), and with none given ONNX Runtime takes $OMP_NUM_THREADS, as torch does."""
    from mhmla_fast.devices import default_threads, physical_cores

    seen: list = []
    real = export_cache._default_export
    monkeypatch.setattr(export_cache, "_default_export",
                        lambda m, o, threads=None: (seen.append(threads), real(m, o, threads))[1])
    runner = auto_runner(tiny_tagger_dir, threads=1, log=Lines())
    assert seen == [1] and runner.backend == "onnx" and runner.threads == 1
    meta = json.loads((runner.path.parent / "cache.json").read_text())
    assert meta["validation"] is not None
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert default_threads() == 1
    assert auto_runner(tiny_tagger_dir, log=Lines()).threads == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "junk")
    assert default_threads() == physical_cores()


def test_stale_staging_folders_of_any_key_are_removed(tiny_tagger_dir, cache):
    """A run killed mid-export of a model that then changed leaves a staging folder under a
    key nobody exports again: the next export of any model removes such folders once they are
    a day old, and leaves younger ones (a live exporter's) alone."""
    onnx = cache / "onnx"
    onnx.mkdir(parents=True)
    old, young, aside = onnx / ".tmp-0123abcd-xyz", onnx / ".tmp-4567ef01-abc", onnx / ".bad-89-1-2"
    for d in (old, young, aside):
        d.mkdir()
        (d / "model.onnx").write_bytes(b"half")
    day_ago = time.time() - export_cache.STALE_S - 60
    for d in (old, aside):
        os.utime(d, (day_ago, day_ago))
    ensure_export(tiny_tagger_dir, cache, log=Lines(), exporter=fake_exporter([]))
    assert not old.exists() and not aside.exists() and young.is_dir()


def test_entries_unused_for_30_days_are_removed_by_the_next_export(tiny_tagger_dir, cache,
                                                                     monkeypatch):
    """Each model version's export is ~100 MB: an entry (or failure record) that no start has
    used for UNUSED_S is removed by the next export, with the index record that named it. A
    start that finds an entry marks it used, and one whose model file was read since counts as
    used (a user who cannot mark it); an entry being made again (its lock held) stays."""
    from mhmla_fast import filelock

    real = export_cache.runtime_versions
    made = {}
    for name in ("old", "used", "locked", "young"):  # four versions of onnxruntime: four keys
        monkeypatch.setattr(export_cache, "runtime_versions",
                            lambda name=name: {**real(), "onnxruntime": name})
        made[name] = ensure_export(tiny_tagger_dir, cache, log=Lines(), exporter=fake_exporter([]))
    onnx = cache / "onnx"
    failed_old, failed_young = onnx / ("0" * 64 + ".failed.json"), onnx / ("1" * 64 + ".failed.json")
    for record in (failed_old, failed_young):
        record.write_text("{}")
    month_ago = time.time() - export_cache.UNUSED_S - 60
    for path in (made["old"].path, made["used"].path, made["locked"].path, failed_old):
        os.utime(path, (month_ago, month_ago))
        if path.is_dir():  # its model file last read a month ago too
            os.utime(path / "model.onnx", (month_ago, month_ago))
    # "young" was last marked a month ago, but read since (another user, who cannot mark it)
    os.utime(made["young"].path, (month_ago, month_ago))
    assert len(list((onnx / "index").glob("*.json"))) == 4
    # a start of the "used" version finds its entry (by the quick key): it is used again
    monkeypatch.setattr(export_cache, "runtime_versions", lambda: {**real(), "onnxruntime": "used"})
    assert lookup(tiny_tagger_dir, cache).entry == made["used"]
    monkeypatch.setattr(export_cache, "runtime_versions", lambda: {**real(), "onnxruntime": "new"})
    with open(onnx / f"{made['locked'].key}.lock", "a+b") as held:
        assert filelock.try_lock(held.fileno())
        new = ensure_export(tiny_tagger_dir, cache, log=Lines(), exporter=fake_exporter([]))
    assert not made["old"].path.exists() and not failed_old.exists()
    for kept in (made["used"].path, made["locked"].path, made["young"].path, new.path,
                 failed_young):
        assert kept.exists(), kept
    named = {json.loads(r.read_text())["entry"] for r in (onnx / "index").glob("*.json")}
    assert named == {made[k].key for k in ("used", "locked", "young")} | {new.key}
    assert not list(onnx.glob(".bad-*"))  # set aside, then removed
    # the removed entry's lock and stamp went with it (its lock stayed for ever before)
    assert not (onnx / f"{made['old'].key}.lock").exists()
    assert not (onnx / f"{made['old'].key}.stamp.json").exists()
    for k in ("used", "locked", "young"):
        assert (onnx / f"{made[k].key}.stamp.json").is_file()
    # an older version's leftover lock with neither entry nor failure record: removed once a
    # day old, by the next export
    orphan = onnx / ("2" * 32 + ".lock")
    orphan.touch()
    os.utime(orphan, (month_ago, month_ago))
    fresh = onnx / ("3" * 32 + ".lock")
    fresh.touch()
    monkeypatch.setattr(export_cache, "runtime_versions", lambda: {**real(), "onnxruntime": "x"})
    ensure_export(tiny_tagger_dir, cache, log=Lines(), exporter=fake_exporter([]))
    assert not orphan.exists() and fresh.exists()
    # the entry whose lock was held before is unused and free now: removed with its lock
    assert not made["locked"].path.exists()
    assert not (onnx / f"{made['locked'].key}.lock").exists()


def test_waiting_for_another_exporter_is_bounded(tmp_path):
    """A stopped or hung exporter holding the lock: a later start waits a bounded time, then
    runs without the export (ExportUnavailable), rather than hanging."""
    from mhmla_fast import filelock

    lock = tmp_path / "key.lock"
    with open(lock, "a+b") as held:
        assert filelock.try_lock(held.fileno())
        waited: list = []
        t0 = time.monotonic()
        with pytest.raises(ExportUnavailable, match="held the export lock"):
            with export_cache._locked(lock, lambda: waited.append(1), limit_s=0.5):
                pass
        assert waited == [1] and 0.5 <= time.monotonic() - t0 < 5
        filelock.unlock(held.fileno())
    with export_cache._locked(lock, lambda: waited.append(2), limit_s=0.5):
        pass  # free again: taken at once
    assert waited == [1]


@pytest.mark.parametrize("damage", ["cut short", "model.onnx missing", "export.json missing"])
def test_an_incomplete_entry_is_made_again(tiny_tagger_dir, cache, damage):
    """cache.json lists every file's size: an entry with a file cut short or missing is not
    used; the next export replaces it (it used to be re-exported and then ignored forever)."""
    calls: list = []
    entry = ensure_export(tiny_tagger_dir, cache, log=Lines(), exporter=fake_exporter(calls))
    assert json.loads((entry.path / "cache.json").read_text())["files"] == {
        "export.json": 2, "model.onnx": len(b"not really ONNX")}
    if damage == "cut short":
        (entry.path / "model.onnx").write_bytes(b"not")
    else:
        (entry.path / damage.split()[0]).unlink()
    assert lookup(tiny_tagger_dir, cache).entry is None
    again = ensure_export(tiny_tagger_dir, cache, log=Lines(), exporter=fake_exporter(calls))
    assert len(calls) == 2 and again.path == entry.path
    assert (again.path / "model.onnx").read_bytes() == b"not really ONNX"
    assert lookup(tiny_tagger_dir, cache).entry is not None
    ensure_export(tiny_tagger_dir, cache, log=Lines(), exporter=fake_exporter(calls))
    assert len(calls) == 2  # whole again: reused
    assert [p.name for p in (cache / "onnx").iterdir() if p.name.startswith(".bad-")] == []


def test_an_entry_changed_at_the_same_size_is_made_again_and_hashed_only_after_a_change(
        tiny_tagger_dir, cache, monkeypatch):
    """cache.json lists every file's SHA-256: a byte changed in place (the size unchanged) is
    seen, and the entry made again, where it used to load (and might run) as it was. The
    check hashes only when a file's stat differs from the stamp written when they last
    matched: a start that finds a whole entry hashes nothing."""
    calls: list = []
    entry = ensure_export(tiny_tagger_dir, cache, log=Lines(), exporter=fake_exporter(calls))
    sums = json.loads((entry.path / "cache.json").read_text())["files_sha256"]
    assert set(sums) == {"export.json", "model.onnx"}
    assert (cache / "onnx" / f"{entry.key}.stamp.json").is_file()
    hashed: list = []
    real = export_cache._files_sha256
    monkeypatch.setattr(export_cache, "_files_sha256",
                        lambda folder, names: hashed.append(1) or real(folder, names))
    assert lookup(tiny_tagger_dir, cache).entry == entry and hashed == []
    # a copy of the cache (new inodes and ctimes, same contents): hashed once, then stamped
    (cache / "onnx" / f"{entry.key}.stamp.json").unlink()
    assert lookup(tiny_tagger_dir, cache).entry == entry and hashed == [1]
    assert lookup(tiny_tagger_dir, cache).entry == entry and hashed == [1]
    model = entry.path / "model.onnx"
    st = model.stat()
    model.write_bytes(b"NOT really ONNX")  # the same size, its mtime put back
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert lookup(tiny_tagger_dir, cache).entry is None
    again = ensure_export(tiny_tagger_dir, cache, log=Lines(), exporter=fake_exporter(calls))
    assert len(calls) == 2 and again.path == entry.path
    assert model.read_bytes() == b"not really ONNX"
    n = len(hashed)
    assert lookup(tiny_tagger_dir, cache).entry == again and len(hashed) == n


def test_an_entry_that_will_not_load_is_set_aside_and_torch_runs(tiny_tagger_dir, cache,
                                                                 capsys):
    """A damaged export of the right size (or one from before sizes were listed) fails in ONNX
    Runtime: auto runs torch with one line, and the entry is removed so the next run makes a
    new one."""
    calls: list = []
    entry = ensure_export(tiny_tagger_dir, cache, log=Lines(), exporter=fake_exporter(calls))
    runner = auto_runner(tiny_tagger_dir, threads=1)  # "not really ONNX" will not parse
    assert runner.backend == "torch"
    (line,) = capsys.readouterr().err.splitlines()
    assert "runs torch" in line and "would not load" in line and "made again" in line
    assert not entry.path.exists()
    assert not [p for p in (cache / "onnx").iterdir() if p.name.startswith(".bad-")]


def test_an_entry_that_will_not_load_for_lack_of_memory_is_kept(tiny_tagger_dir, cache,
                                                                  capsys, monkeypatch):
    """Out of memory while ONNX Runtime loads an entry is the machine's state: torch runs, and
    the entry (shared by other processes and users) stays."""
    from mhmla_fast.serve import export_cache as ec

    calls: list = []
    entry = ensure_export(tiny_tagger_dir, cache, log=Lines(), exporter=fake_exporter(calls))

    def no_memory(*a, **kw):
        raise type("RuntimeException", (Exception,), {})("std::bad_alloc")

    monkeypatch.setattr(ec, "_onnx_runner", no_memory)
    assert auto_runner(tiny_tagger_dir, threads=1).backend == "torch"
    (line,) = capsys.readouterr().err.splitlines()
    assert "not enough memory to load its cached ONNX export" in line
    assert entry.path.exists()


def test_an_unwritable_cache_falls_back_to_torch_with_one_line(tiny_tagger_dir, tmp_path,
                                                               monkeypatch, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("MHMLA_CACHE_DIR", str(blocker / "cache"))
    assert auto_runner(tiny_tagger_dir, threads=1).backend == "torch"
    (line,) = capsys.readouterr().err.splitlines()
    assert "runs torch" in line and "cannot be written" in line


def test_a_leftover_staging_directory_is_ignored_and_cleaned(tiny_tagger_dir, cache):
    found = lookup(tiny_tagger_dir, cache)
    assert found.entry is None and found.failed is None and found.key
    half = cache / "onnx" / f".tmp-{found.key}-dead"  # a killed exporter's, half written
    half.mkdir(parents=True)
    (half / "model.onnx").write_bytes(b"half")
    assert lookup(tiny_tagger_dir, cache).entry is None  # never read
    calls: list = []
    entry = ensure_export(tiny_tagger_dir, cache, log=Lines(), exporter=fake_exporter(calls))
    assert len(calls) == 1 and not half.exists()
    assert (entry.path / "model.onnx").read_bytes() == b"not really ONNX"
    assert [p.name for p in (cache / "onnx").iterdir() if p.name.startswith(".tmp-")] == []


def test_an_entry_appears_whole_or_not_at_all(tiny_tagger_dir, cache):
    """While the exporter writes, the entry's name does not exist; cache.json is in it once it
    does."""
    seen: list = []

    def export(model_dir: Path, out: Path) -> dict:
        (out / "model.onnx").write_bytes(b"x")
        seen.append(lookup(model_dir, cache).entry)
        seen.append(sorted(p.name for p in (cache / "onnx").iterdir() if not p.name.startswith(
            (".tmp-", "index")) and not p.name.endswith(".lock")))
        return {}

    entry = ensure_export(tiny_tagger_dir, cache, log=Lines(), exporter=export)
    assert seen == [None, []]
    assert json.loads((entry.path / "cache.json").read_text())["key"] == entry.key


def test_two_exporters_of_one_model_export_once(tiny_tagger_dir, cache):
    calls: list = []
    logs = [Lines(), Lines()]
    results: list = [None, None]

    def run(k: int) -> None:
        results[k] = ensure_export(tiny_tagger_dir, cache, log=logs[k],
                                   exporter=fake_exporter(calls, delay=0.5))

    threads = [threading.Thread(target=run, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
        time.sleep(0.1)
    for t in threads:
        t.join(30)
    assert len(calls) == 1 and results[0] == results[1] is not None
    assert any("waiting for another process" in log.text for log in logs)


def test_two_processes_export_once_and_read_only_whole_exports(tiny_tagger_dir, cache):
    """Two processes start a first run at once: one exports (slowly), the other waits on the
    lock, then uses that export; neither sees the entry before it is complete."""
    code = f"""
import sys, time
from pathlib import Path
from mhmla_fast.serve.export_cache import ensure_export, lookup

def export(model_dir, out):
    print("EXPORT", flush=True)
    (out / "model.onnx").write_bytes(b"part")
    time.sleep(1.5)
    assert lookup(model_dir, {str(cache)!r}).entry is None  # not visible while written
    (out / "model.onnx").write_bytes(b"whole")
    return {{}}

entry = ensure_export({str(tiny_tagger_dir)!r}, {str(cache)!r}, exporter=export)
print("GOT", (entry.path / "model.onnx").read_bytes().decode(), flush=True)
"""
    procs = []
    for _ in range(2):
        procs.append(subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
        time.sleep(0.3)
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    stdout = "".join(o for o, _ in outs)
    assert stdout.count("EXPORT") == 1 and stdout.count("GOT whole") == 2, outs
    assert "waiting for another process" in "".join(e for _, e in outs)


# ------------------------------------------------------------------------- validation


def test_validation_requires_identical_labels():
    """A probability within the tolerance but on the other side of a threshold fails."""
    from mhmla_fast.serve import onnx_export

    class Fixed:
        def __init__(self, *a, **k):
            pass

        def __call__(self, ids, mask):
            return np.array([[0.3, 0.50001, 0.9]], dtype=np.float32)

    ids, mask = np.ones((1, 3), dtype=np.int64), np.ones((1, 3), dtype=np.int64)
    ref = [np.array([[0.3, 0.49999, 0.9]], dtype=np.float32)]
    real = onnx_export.OnnxRunner
    onnx_export.OnnxRunner = Fixed
    try:
        report = validate_onnx("x.onnx", ref, [(ids, mask)], atol=1e-4, exact_labels=(0.7,))
        assert report["labels"] == {"thresholds": [0.7], "positions": 3, "differing": [0]}
        with pytest.raises(ExportValidationError, match=r"label \(p >= 0.5\) differs from torch's "
                                                        r"at 1 of 3 positions"):
            validate_onnx("x.onnx", ref, [(ids, mask)], atol=1e-4, exact_labels=(0.7, 0.5))
    finally:
        onnx_export.OnnxRunner = real


def test_the_export_checks_labels_on_sentences(warm, tiny_tagger_dir):
    meta = json.loads((lookup(tiny_tagger_dir, warm).entry.path / "export.json").read_text())
    labels = meta["validation"]["labels"]
    assert labels["thresholds"] == [0.5] and labels["differing"] == [0]  # tiny: threshold 0.5
    rows = [b["shape"][0] for b in meta["validation"]["batches"]]
    assert len(VALIDATION_SENTENCES) in rows  # the sentence batch, beside the random ones


# ---------------------------------------------------------------------- the processes


def _run(code: str, cache: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "MHMLA_CACHE_DIR": str(cache), **env})


def test_a_warm_start_imports_no_torch(warm, tiny_tagger_dir):
    code = ("import sys; from mhmla_fast.serve.engine import Engine; "
            f"e = Engine.load({str(tiny_tagger_dir)!r}, threads=1); "
            "r = e.tag_texts(['He go to school .']); assert r[0].tokens[0] == 'He'; "
            "print(e.runner.backend, sorted(m for m in ('torch', 'transformers.modeling_utils') "
            "if m in sys.modules))")
    done = _run(code, warm)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["onnx", "[]"], done.stdout + done.stderr
    assert "mhmla-fast" not in done.stderr  # nothing to say on a warm start


def test_the_command_exports_once_then_reuses(tiny_tagger_dir, tiny_engine, tmp_path):
    """``mhmla-serve tag`` (default backend) in two processes on a cold cache: the first says on
    one stderr line that it exports; the second is silent; both write torch's labels."""
    src = tmp_path / "in.txt"
    src.write_text("\n".join(TEXTS) + "\n")
    root = tmp_path / "cache"
    want = [r.labels for r in tiny_engine.tag_texts(TEXTS)]
    errs = []
    for k in (1, 2):
        out = tmp_path / f"out{k}.jsonl"
        code = ("import sys; from mhmla_fast.commands.serve import main; sys.exit(main(['tag', "
                f"{str(src)!r}, '-o', {str(out)!r}, '--model', {str(tiny_tagger_dir)!r}, "
                "'--no-progress', '--threads', '1']))")
        done = _run(code, root)
        assert done.returncode == 0, done.stderr
        assert [json.loads(x)["labels"] for x in out.read_text().splitlines()] == want
        assert json.loads(Path(f"{out}.meta.json").read_text())["made_from"]["backend"] == "auto"
        errs.append(done.stderr)
    (line,) = errs[0].splitlines()
    assert line.startswith("mhmla-fast: exporting tagger to ONNX once") and "done in" in line
    assert errs[1] == ""
    assert len([p for p in (root / "onnx").iterdir() if (p / "cache.json").is_file()]) == 1


@pytest.mark.skipif(not (default_tagger_path() / "config.json").is_file(),
                    reason="the shipped tagger is not installed")
def test_the_shipped_tagger_on_auto_tags_like_torch_fp32(cache, capsys):
    """The shipped model's validated export (about 5 s to make here) gives torch fp32's labels on
    learner sentences at the model's threshold, and ``Engine.load()`` finds it."""
    import torch

    entry = ensure_export(default_tagger_path(), cache, log=Lines())
    meta = json.loads((entry.path / "export.json").read_text())
    assert len(meta["validation"]["labels"]["thresholds"]) == 2  # the model's and 0.5
    assert meta["validation"]["labels"]["differing"] == [0, 0]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        want = Engine.load(backend="torch", device="cpu").tag_texts(TEXTS)
    finally:
        torch.set_num_threads(threads)
    engine = Engine.load(threads=2)  # the defaults: auto, the shipped model
    assert engine.runner.backend == "onnx" and engine.runner.path.parent == entry.path
    assert capsys.readouterr().err == ""  # found, not exported again
    got = engine.tag_texts(TEXTS)
    assert [r.labels for r in got] == [r.labels for r in want]
    assert got[0].labels == ["c", "i", "c", "c", "c", "i", "c"]  # He [go] ... every [days] .
