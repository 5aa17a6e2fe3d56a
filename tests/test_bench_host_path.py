"""bench/benchmark_host_path.py: the engine's host path with a runner that costs nothing, with
this process's CPU per sentence split by thread."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bench_scripts import load_bench_script

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_thread_cpu_names_each_thread_and_counts_its_own_work():
    script = load_bench_script("benchmark_host_path")
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    worker = threading.Thread(target=spin, name="spinner")
    before = script.thread_cpu_s()
    worker.start()
    try:  # read while the spinner runs, until it has a clock tick of its own (a loaded machine
        deadline = time.monotonic() + 10.0  # may give it little CPU at first)
        while (seen := script.thread_cpu_s()).get("spinner", 0.0) < 0.01 \
                and time.monotonic() < deadline:
            time.sleep(0.02)  # the main thread sleeps: its own CPU stays small
    finally:
        stop.set()
        worker.join()
    assert "MainThread" in before and "spinner" in seen
    assert seen["spinner"] >= 0.01  # at least a clock tick of its own spinning
    assert seen["MainThread"] - before["MainThread"] < seen["spinner"] + 0.5
    assert all(v >= 0 for v in seen.values())


def test_rows_record_this_process_cpu_per_sentence(tmp_path, monkeypatch):
    """A small run of the script (no host workers): every warm row has the process CPU per
    sentence, positive, and (on Linux) the main thread's share of it."""
    script = load_bench_script("benchmark_host_path")
    data = tmp_path / "ged.tsv"
    data.write_text("".join(f"He\tc\ngo\ti\nto\tc\nschool\tc\n{i}\tc\n\n" for i in range(4000)),
                    encoding="utf-8")
    out = tmp_path / "host.json"
    monkeypatch.chdir(tmp_path)
    assert script.main(["--data", str(data), "--repeat", "1", "--runs", "1",
                        "--host-workers", "0", "--out", str(out)]) == 0
    rows = [r for r in json.loads(out.read_text())["rows"] if r["cache"] == "warm"]
    assert {r["path"] for r in rows} == {"tag_tokens", "tag_texts", "tag_command"}
    command, = (r for r in rows if r["path"] == "tag_command")  # mhmla-serve tag's host path
    assert command["records"] == 4000 and command["process_cpu_us_per_record"] > 0
    assert len(command["output_sha256"]) == 64
    rows.remove(command)
    for row in rows:
        assert row["process_cpu_us_per_sentence"] > 0
        if sys.platform.startswith("linux"):  # 4,000 sentences: many clock ticks of work
            assert row["process_cpu_us_per_sentence_by_thread"]["MainThread"] > 0


def test_tag_command_row_alone_and_code_from_another_checkout(tmp_path):
    """--only tag_command runs that row alone; --code imports mhmla_fast from the checkout it
    names (here this one, in a subprocess: it is read before the import) and the result says
    which; a --code that came too late to apply is refused."""
    data = tmp_path / "ged.tsv"
    data.write_text("".join(f"He\tc\ngo\ti\n{i}\tc\n\n" for i in range(300)), encoding="utf-8")
    out = tmp_path / "host.json"
    script = REPO / "bench" / "benchmark_host_path.py"
    subprocess.run([sys.executable, str(script), "--only", "tag_command", "--code", str(REPO),
                    "--data", str(data), "--repeat", "1", "--runs", "1", "--out", str(out)],
                   check=True, capture_output=True, cwd=tmp_path)
    result = json.loads(out.read_text())
    assert [r["path"] for r in result["rows"]] == ["tag_command"]
    assert result["code"] == str(REPO) and result["profile_tag_texts"] == []
    with pytest.raises(SystemExit, match="already imported"):
        load_bench_script("benchmark_host_path").main(
            ["--only", "tag_command", "--code", str(tmp_path), "--data", str(data)])
