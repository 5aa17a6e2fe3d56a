"""Issue 11's serving benchmark (bench/benchmark_serve.py) on the CPU: its arguments, the latency
summary of the HTTP load test, the targets judged on synthetic rows, whole-process timing, and
short end-to-end runs of the tag, cli and http tasks on the tiny tagger."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from bench_scripts import load_bench_script
from synthetic_fce import write_random_fce

VOCAB = ("the a cat dog house school every day he she they we go goes went see sees postman "
         "letters yesterday , . !").split()


@pytest.fixture(scope="module")
def bench():
    return load_bench_script("benchmark_serve")


def _write_fce(path: Path, n: int) -> Path:
    return write_random_fce(path, n, VOCAB, seed=3)


# ----------------------------------------------------------------------------- arguments


def test_arguments_take_device_defaults_and_refuse_bad_values(bench):
    cpu = bench.parse_args([])
    assert cpu.device == "cpu" and cpu.tasks == list(bench.TASKS)
    assert cpu.dtypes == ["float32"] and cpu.pipeline_dtypes == ["float32"]
    assert cpu.cli_hf_batch_sizes == cpu.pipeline_batch_sizes == [1, 8, 32, 64]
    gpu = bench.parse_args(["--device", "cuda:1", "--tasks", "http", "tag"])
    assert gpu.dtypes == ["float32", "bfloat16"] and gpu.score_dtypes == ["bfloat16", "float32"]
    assert gpu.tasks == ["tag", "http"]  # always in the fixed order
    assert gpu.http_procs == 4 and gpu.train_epochs == 2
    assert bench.parse_args(["--dtypes", "float16", "--budgets", "512"]).budgets == [512]
    assert cpu.max_batch == [256]
    assert bench.parse_args(["--max-batch", "8", "64"]).max_batch == [8, 64]
    for bad in (["--device", "tpu"], ["--tasks", "nope"], ["--limit", "0"],
                ["--budgets", "0"], ["--chunks", "-1"], ["--http-clients", "2",
                                                          "--http-procs", "3"],
                ["--http-duration", "0"], ["--repeats", "0"], ["--max-batch", "8", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_results_are_named_by_device(bench, tmp_path):
    import datetime

    day = datetime.date(2026, 11, 23)
    assert bench.resolve_out_path(str(tmp_path), "cpu", day).name == \
        "benchmark_serve_cpu_2026-11-23.json"
    assert bench.resolve_out_path(str(tmp_path), "cuda:0", day).name == \
        "benchmark_serve_cuda_2026-11-23.json"
    assert bench.resolve_out_path(str(tmp_path / "x.json"), "cpu") == tmp_path / "x.json"


# ------------------------------------------------------------------------------ statistics


def test_latency_summary_percentiles(bench):
    s = bench.latency_summary([i / 1000 for i in range(1, 101)])  # 1 ms .. 100 ms
    assert s["count"] == 100 and s["max_s"] == pytest.approx(0.1)
    assert s["mean_s"] == pytest.approx(0.0505)
    assert s["p50_s"] == pytest.approx(0.0505)  # linear interpolation between 50 and 51 ms
    assert s["p95_s"] == pytest.approx(0.09505)
    assert s["p99_s"] == pytest.approx(0.09901)
    assert bench.latency_summary([0.2])["p99_s"] == pytest.approx(0.2)
    empty = bench.latency_summary([])
    assert empty["count"] == 0 and empty["p99_s"] is None


def test_load_summary_merges_the_load_processes(bench):
    workers = [
        {"latencies": [0.01, 0.02], "statuses": {"200": 1, "503": 1}, "connection_errors": 0,
         "last_end": 102.0},
        {"latencies": [0.03, 0.04, 0.05], "statuses": {"200": 3}, "connection_errors": 2,
         "last_end": 104.0},
    ]
    s = bench.load_summary(workers, window_start=100.0)
    assert s["requests"] == 5 and s["ok"] == 4 and s["status_503"] == 1 and s["failed"] == 1
    assert s["connection_errors"] == 2 and s["statuses"] == {"200": 4, "503": 1}
    assert s["seconds"] == pytest.approx(4.0) and s["requests_per_s"] == pytest.approx(1.25)
    assert s["latency"]["p50_s"] == pytest.approx(0.03)
    none = bench.load_summary([{"latencies": [], "statuses": {}, "connection_errors": 1,
                                "last_end": None}], 0.0)
    assert none["requests_per_s"] is None and none["latency"]["count"] == 0


def test_request_bodies_group_and_wrap(bench):
    sents = [[str(i)] for i in range(5)]
    assert bench.request_bodies(sents, 1) == [[[str(i)]] for i in range(5)]
    assert bench.request_bodies(sents, 2) == [[["0"], ["1"]], [["2"], ["3"]]]
    assert bench.request_bodies(sents, 8) == [[[str(i % 5)] for i in range(8)]]  # one, wrapped
    assert len(bench.request_bodies(sents, 1, limit=3)) == 3


def test_train_epoch_summary_reads_the_last_epoch(bench):
    s = bench.train_epoch_summary([{"sentences_per_s": 100.0}, {"sentences_per_s": 5746.2}])
    assert s["sentences_per_s"] == 5746.2
    assert s["fce_epoch_s_estimate"] == pytest.approx(bench.FCE_TRAIN_SENTENCES / 5746.2)
    assert s["fce_epoch_steps_s_estimate"] is None  # a log from before the steps' own time
    s = bench.train_epoch_summary([{"sentences_per_s": 4000.0, "train_sentences_per_s": 6000.0}])
    assert s["fce_epoch_steps_s_estimate"] == pytest.approx(bench.FCE_TRAIN_SENTENCES / 6000.0)
    assert s["fce_epoch_s_estimate"] == pytest.approx(bench.FCE_TRAIN_SENTENCES / 4000.0)
    assert bench.train_epoch_summary([])["fce_epoch_s_estimate"] is None


# ------------------------------------------------------------------------------ targets


def _rows(engine32=60_000.0, engine16=70_000.0, pipe=5_000.0, cli=20.0, hf=8.0, agree=0.9995,
          rps=6_000.0, p99=0.05, n503=0, equal=True, epoch_sps=6_000.0, labels_ok=True):
    return [
        {"task": "tag", "path": "engine", "backend": "torch", "dtype": "float32",
         "setting": {"token_budget": 8192}, "sentences_per_s": engine32, "error": None,
         "vs_reference": {"labels_identical": True, "max_abs_prob_diff": 1e-6}},
        {"task": "tag", "path": "engine", "backend": "torch", "dtype": "bfloat16",
         "setting": {"token_budget": 8192}, "sentences_per_s": engine16,
         "vs_cpu_fp32": {"agreeing_share": agree}, "error": None},
        {"task": "tag", "path": "engine", "backend": "torch", "dtype": "bfloat16",
         "setting": {"token_budget": 65536}, "sentences_per_s": None,
         "error": "out of memory"},  # failed rows never count
        {"task": "tag", "path": "hf_pipeline", "dtype": "float16", "setting": {"batch_size": 256},
         "sentences_per_s": pipe, "error": None},
        {"task": "tag", "path": "hf_pipeline", "dtype": "float32", "setting": {"batch_size": 64},
         "sentences_per_s": pipe / 2, "error": None},
        {"task": "cli", "path": "mhmla-serve tag", "setting": {"backend": "default"},
         "sentences_per_s": cli, "first_line_s": 2.5,
         "check": {"labels_identical": labels_ok}, "error": None},
        {"task": "cli", "path": "mhmla-serve tag", "setting": {"backend": "onnx"},
         "sentences_per_s": cli * 10, "error": None},  # not the headline: defaults are
        {"task": "cli", "path": "hf_pipeline_process", "sentences_per_s": hf, "error": None},
        {"task": "cli", "path": "mhmla-serve score", "essays_per_s": 100.0, "first_line_s": 3.5,
         "error": None},
        {"task": "score", "path": "predict_scores", "essays_per_s": 2500.0, "error": None},
        {"task": "http", "setting": {"per_request": 8}, "requests_per_s": 1.0, "error": None},
        {"task": "http", "setting": {"per_request": 1}, "requests_per_s": rps,
         "latency": {"p99_s": p99}, "status_503": n503, "check": {"equal": equal},
         "error": None},
        {"task": "train", "sentences_per_s": epoch_sps,
         "fce_epoch_s_estimate": 28_731 / epoch_sps, "error": None},
    ]


def _verdicts(result):
    return {c["name"]: c["verdict"] for c in result["checks"]}


def test_targets_on_an_h100(bench):
    result = bench.evaluate_targets(_rows(), "cuda", "NVIDIA H100 80GB HBM3")
    v = _verdicts(result)
    assert result["on_target_device"] is True
    assert v["tag_in_process"] == "PASS"  # 70,000 >= 50,000
    assert v["tag_vs_pipeline_in_process"] == "PASS"  # 70,000 / 5,000 = 14
    assert v["tag_vs_pipeline_whole_process"] == "FAIL"  # 20 / 8 = 2.5
    assert v["tag_bf16_faster"] == v["tag_bf16_agrees_with_cpu"] == "PASS"
    assert v["score_in_process"] == "PASS" and v["tag_first_result"] == "PASS"
    assert v["score_first_result"] == "FAIL"  # 3.5 s
    assert v["http_throughput"] == v["http_p99"] == v["http_no_503"] == "PASS"
    assert v["http_equals_offline"] == "PASS" and v["train_epoch"] == "PASS"
    assert v["cpu_tag_vs_pipeline_whole_process"] == v["cpu_tag_labels_identical"] == "n/a"
    values = {c["name"]: c["value"] for c in result["checks"]}
    assert values["tag_vs_pipeline_whole_process"] == pytest.approx(2.5)
    assert values["tag_bf16_faster"] == pytest.approx(70 / 60)

    v = _verdicts(bench.evaluate_targets(
        _rows(engine16=50_000.0, agree=0.998, rps=4_000.0, p99=0.2, n503=3, equal=False,
              epoch_sps=1_000.0), "cuda", "NVIDIA H100 80GB HBM3"))
    assert v["tag_bf16_faster"] == v["tag_bf16_agrees_with_cpu"] == "FAIL"
    assert v["tag_in_process"] == "PASS"  # the fp32 row, 60,000, is the fastest now
    assert {v[k] for k in ("http_throughput", "http_p99", "http_no_503", "http_equals_offline",
                           "train_epoch")} == {"FAIL"}
    other = bench.evaluate_targets(_rows(), "cuda", "NVIDIA H200")
    assert other["on_target_device"] is False and _verdicts(other)["tag_in_process"] == "PASS"


def test_targets_on_the_cpu(bench):
    result = bench.evaluate_targets(_rows(cli=17.0, hf=8.0), "cpu")
    v = _verdicts(result)
    assert v["cpu_tag_vs_pipeline_whole_process"] == "PASS"  # 2.125x
    assert v["cpu_tag_labels_identical"] == "PASS"
    assert all(v[t.name] == "n/a" for t in bench.TARGETS if t.device == "cuda")
    v = _verdicts(bench.evaluate_targets(_rows(cli=15.0, hf=8.0, labels_ok=False), "cpu"))
    assert v["cpu_tag_vs_pipeline_whole_process"] == v["cpu_tag_labels_identical"] == "FAIL"
    v = _verdicts(bench.evaluate_targets([], "cpu"))
    assert set(v.values()) == {"n/a"}  # nothing measured


# ---------------------------------------------------------------------- whole processes


def test_time_process_sees_the_first_line_before_the_exit(bench, tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text("stale\n")  # a previous run's output is removed first
    code = ("import sys, time; f = open(sys.argv[1], 'w'); f.write('{}\\n'); f.flush(); "
            "time.sleep(0.5); f.write('{}\\n'); sys.stderr.write('bye'); sys.exit(3)")
    r = bench.time_process([sys.executable, "-c", code, str(out)], out)
    assert r["exit_status"] == 3 and r["stderr_tail"] == "bye"
    assert 0 < r["first_line_s"] < r["wall_s"] and r["wall_s"] - r["first_line_s"] >= 0.4
    assert out.read_text().count("\n") == 2
    r = bench.time_process([sys.executable, "-c", "pass"], None)
    assert r["first_line_s"] is None and r["exit_status"] == 0


# --------------------------------------------------------------------------- end to end


def _check_header(result, tasks):
    head = result["header"]
    assert head["commit"] == "test-commit" and head["device"]["cpu"]
    assert head["device"]["requested"] == "cpu" and head["tasks"] == tasks
    assert {"torch", "transformers", "onnxruntime", "fastapi", "uvicorn"} <= set(head["versions"])
    assert head["command"].startswith("python bench/benchmark_serve.py ")
    assert {c["name"] for c in result["targets"]["checks"]} == {t.name for t in
                                                                  load_bench_script(
                                                                      "benchmark_serve").TARGETS}


def test_tag_task_end_to_end(bench, tiny_tagger_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MHMLA_COMMIT", "test-commit")
    data = _write_fce(tmp_path / "fce.tsv", 12)
    out = tmp_path / "tag.json"
    rc = bench.main(["--tasks", "tag", "--model", str(tiny_tagger_dir), "--data", str(data),
                     "--repeat-to", "30", "--repeats", "1", "--warmup", "2", "--threads", "1",
                     "--pipeline-batch-sizes", "4", "--budgets", "256", "--chunks", "0", "5",
                     "--overlap", "on", "off", "--max-batch", "4", "256", "--no-onnx",
                     "--out", str(out)])
    assert rc == 0, capsys.readouterr()
    result = json.loads(out.read_text())
    _check_header(result, ["tag"])
    assert result["header"]["data"]["distinct_sentences"] == 12
    assert result["header"]["data"]["sentences"] == 30
    kinds = sorted((r["path"], r.get("dtype"), r["setting"].get("chunk"),
                    r["setting"].get("overlap", ""), r["setting"].get("max_batch", 0))
                   for r in result["rows"])
    assert kinds == [("engine", "float32", c, o, m) for c in (0, 5) for o in ("off", "on")
                     for m in (4, 256)] + [("hf_pipeline", "float32", None, "", 0),
                                           ("plain_torch", "float32", None, "", 0)]
    for r in result["rows"]:
        assert r["task"] == "tag" and r["error"] is None and r["sentences_per_s"] > 0
        assert r["vs_reference"]["labels_identical"] or r["path"] == "plain_torch"
    assert result["summary"]["tag"]["engine_check_passed"]
    assert result["summary"]["values"]["tag_engine_best_sentences_per_s"] > 0
    assert all(c["verdict"] == "n/a" for c in result["targets"]["checks"])  # no CLI rows
    assert "targets" in capsys.readouterr().out


def test_synchronous_runner_hides_submit_only(bench, tiny_tagger_dir):
    """--overlap off: the wrapped runner has no submit, so ``runners.submit`` calls it and waits;
    its other attributes and its results are the runner's."""
    import numpy as np

    from mhmla_fast.serve.runners import TorchRunner, submit

    runner = TorchRunner(tiny_tagger_dir, device="cpu", dtype="float32", threads=1)
    sync = bench.Synchronous(runner)
    assert not hasattr(sync, "submit") and sync.device == runner.device
    ids = np.array([[2, 5, 6, 3], [2, 7, 3, 0]], dtype=np.int64)
    mask = (ids != 0).astype(np.int64)
    np.testing.assert_array_equal(submit(sync, ids, mask).result(), runner(ids, mask))


def test_onnx_tag_rows_and_the_score_task_end_to_end(bench, tiny_tagger_dir, tiny_scorer_dir,
                                                     tmp_path, monkeypatch, capsys):
    """The ONNX engine rows (one per budget and chunk, whatever --host-workers lists) and the
    in-process score rows, bf16 beside fp32 with its agreement counted."""
    from test_bench_serve_score import _write_tsv

    monkeypatch.setenv("MHMLA_COMMIT", "test-commit")
    monkeypatch.setenv("MHMLA_CACHE_DIR", str(tmp_path / "cache"))
    data = _write_fce(tmp_path / "fce.tsv", 8)
    tsv = _write_tsv(tmp_path / "asap.tsv", per_prompt=2)
    out = tmp_path / "tag_score.json"
    rc = bench.main(["--tasks", "tag", "score", "--model", str(tiny_tagger_dir), "--data",
                     str(data), "--repeats", "1", "--warmup", "2", "--threads", "1",
                     "--tag-paths", "plain", "onnx", "--budgets", "256", "--chunks", "0",
                     "--host-workers", "0", "1", "--scorer", str(tiny_scorer_dir), "--tsv",
                     str(tsv), "--essays", "14", "--batch-essays", "4", "--token-budget", "256",
                     "--score-dtypes", "float32", "bfloat16", "--out", str(out)])
    assert rc == 0, capsys.readouterr()
    rows = json.loads(out.read_text())["rows"]
    assert all(r["error"] is None for r in rows), [r["error"] for r in rows if r["error"]]
    onnx = [(r["dtype"], r["setting"]["token_budget"]) for r in rows if r.get("backend") == "onnx"]
    assert onnx == [("float32", 256), ("int8", 256)]
    fp32 = next(r for r in rows if r.get("backend") == "onnx" and r["dtype"] == "float32")
    assert fp32["vs_reference"]["labels_identical"]
    score = [r for r in rows if r["task"] == "score"]
    assert [r["dtype"] for r in score] == ["float32", "bfloat16"]
    assert all(r["essays_per_s"] > 0 for r in score)
    assert score[1]["vs_float32"]["essays"] == score[0]["essays"] == 13  # no prompt 8 here


def test_cli_and_http_tasks_end_to_end(bench, tiny_tagger_dir, tmp_path, monkeypatch, capsys):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    monkeypatch.setenv("MHMLA_COMMIT", "test-commit")
    data = _write_fce(tmp_path / "fce.tsv", 10)
    out = tmp_path / "cli_http.json"
    rc = bench.main(["--tasks", "cli", "http", "--model", str(tiny_tagger_dir), "--data",
                     str(data), "--threads", "1", "--cli-commands", "tag", "--http-clients", "4",
                     "--http-requests", "24", "--http-warmup", "0", "--http-check", "6",
                     "--http-per-request", "1", "3", "--no-onnx", "--cli-tag-backends",
                     "default", "torch-bf16", "--out", str(out)])
    assert rc == 0, capsys.readouterr()
    result = json.loads(out.read_text())
    _check_header(result, ["cli", "http"])
    cli = [r for r in result["rows"] if r["task"] == "cli"]
    assert [(r["path"], r["setting"]["backend"]) for r in cli] == [
        ("mhmla-serve tag", "default"), ("mhmla-serve tag", "torch-bf16")]
    tag, bf16 = cli
    assert "--backend torch --dtype bfloat16" in bf16["command"]
    assert bf16["check"]["reference"].startswith("Engine torch bfloat16")
    assert bf16["check"]["labels_identical"], bf16["check"]
    assert tag["error"] is None and tag["sentences_per_s"] > 0
    assert [r["exit_status"] for r in tag["runs"]] == [0]
    assert 0 < tag["first_line_s"] <= tag["wall_s"]
    assert tag["check"]["labels_identical"] and tag["check"]["mismatched_records"] == 0
    assert " tag " in tag["command"] and "--output" in tag["command"]
    http = [r for r in result["rows"] if r["task"] == "http"]
    assert [r["setting"]["per_request"] for r in http] == [1, 3]
    for r in http:
        assert r["error"] is None and r["startup_s"] > 0
        assert r["requests"] == r["ok"] == 24 and r["status_503"] == 0
        assert r["requests_per_s"] > 0 and r["latency"]["count"] == 24
        assert 0 < r["latency"]["p50_s"] <= r["latency"]["p99_s"] <= r["latency"]["max_s"]
        assert r["check"]["equal"] and r["check"]["requests"] == (6 if r["setting"][
            "per_request"] == 1 else 3)  # 10 sentences make 3 bodies of 3
    assert http[1]["sentences_per_s"] == pytest.approx(3 * http[1]["requests_per_s"])
    values = result["summary"]["values"]
    assert values["http_equals_offline"] is True and values["cli_tag_labels_identical"] is True
    assert values["cli_tag_vs_best_pipeline_process"] is None  # no pipeline rows asked for
    assert np.isfinite(values["http_p99_s"])


def test_http_task_loads_the_score_endpoint(bench, tiny_tagger_dir, tiny_scorer_dir, tmp_path,
                                            monkeypatch, capsys):
    """``--http-endpoints score``: the server serves the ``--scorer``, the load POSTs the essay
    sample to /v1/score, and the kept scores are checked against torch fp32 offline; the tag
    target reads no score row."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from test_bench_serve_score import _write_tsv

    monkeypatch.setenv("MHMLA_COMMIT", "test-commit")
    data = _write_fce(tmp_path / "fce.tsv", 6)
    tsv = _write_tsv(tmp_path / "asap.tsv", per_prompt=2)
    out = tmp_path / "http_score.json"
    rc = bench.main(["--tasks", "http", "--model", str(tiny_tagger_dir), "--data", str(data),
                     "--threads", "1", "--scorer", str(tiny_scorer_dir), "--tsv", str(tsv),
                     "--essays", "14", "--http-endpoints", "score", "--http-clients", "3",
                     "--http-requests", "12", "--http-warmup", "0", "--http-check", "5",
                     "--http-per-request", "2", "--out", str(out)])
    assert rc == 0, capsys.readouterr()
    result = json.loads(out.read_text())
    [row] = result["rows"]
    assert "--no-scorer" not in row["command"] and f"--scorer {tiny_scorer_dir}" in row["command"]
    assert row["setting"]["endpoint"] == "score" and row["setting"]["per_request"] == 2
    assert row["requests"] == row["ok"] == 12 and row["status_503"] == 0
    assert row["essays_per_s"] == pytest.approx(2 * row["requests_per_s"])
    check = row["check"]
    assert check["equal"] and check["differing_scores"] == 0
    assert check["requests"] == 5 and check["essays"] == 10
    assert check["reference"].startswith("load_scorer torch float32")
    assert result["summary"]["values"]["http_requests_per_s"] is None  # a tag target


def test_http_score_check_catches_a_wrong_score(bench, tiny_scorer_dir, tmp_path):
    """The score check is not vacuous: one changed score in a kept answer is counted."""
    from test_bench_serve_score import _write_tsv

    tsv = _write_tsv(tmp_path / "asap.tsv", per_prompt=2)
    args = bench.parse_args(["--scorer", str(tiny_scorer_dir), "--tsv", str(tsv), "--essays",
                             "14", "--threads", "1"])
    run = bench.Run(args, tmp_path, tiny_scorer_dir, 1)
    groups, bodies = bench.endpoint_bodies(run, "score", 3)
    s = run.essays
    k = groups[0][0]
    assert json.loads(bodies[0])["essays"][0] == {"text": s["texts"][k], "prompt": s["prompts"][k]}
    reference = bench.scorebench.torch_scores(s["model"], s["texts"], s["prompts"],
                                              bench.score_args(run, "float32"))
    kept = {i: [reference[3 * i + j] for j in range(3)] for i in range(2)}
    assert bench.check_http_scores(run, groups, kept)["equal"] is True
    kept[1][2] += 1
    bad = bench.check_http_scores(run, groups, kept)
    assert bad["equal"] is False and bad["differing_scores"] == 1


def test_merge_joins_the_stages_of_one_device(bench, tmp_path, capsys):
    def part(rows, gpu="NVIDIA H100 80GB HBM3", command="c"):
        return {"header": {"device": {"requested": "cuda", "gpu": gpu, "cpu": "x"},
                           "command": command, "commit": "abc", "tasks": ["tag"]},
                "rows": rows}

    rows = _rows()
    tag = [r for r in rows if r["task"] == "tag"]
    rest = [r for r in rows if r["task"] != "tag"]
    merged = bench.merge_results([part(tag, command="a"), part(rest, command="b")])
    assert [r["source"] for r in merged["rows"]] == [0] * len(tag) + [1] * len(rest)
    assert [p["command"] for p in merged["header"]["parts"]] == ["a", "b"]
    assert _verdicts(merged["targets"])["tag_vs_pipeline_in_process"] == "PASS"
    assert _verdicts(merged["targets"])["http_throughput"] == "PASS"  # from the second part
    with pytest.raises(ValueError, match="different devices"):
        bench.merge_results([part(tag), part(rest, gpu="NVIDIA H200")])
    files = []
    for k, p in enumerate([part(tag), part(rest)]):
        files.append(tmp_path / f"p{k}.json")
        files[-1].write_text(json.dumps(p))
    out = tmp_path / "merged.json"
    assert bench.main(["--merge", *map(str, files), "--out", str(out)]) == 0
    assert len(json.loads(out.read_text())["rows"]) == len(rows)
    assert "PASS" in capsys.readouterr().out


def test_first_result_script_times_the_variants_on_a_warm_cache(tiny_tagger_dir, tmp_path,
                                                                monkeypatch, capsys):
    """bench/benchmark_first_result.py: a cold run that exports (its line recorded), then the
    default command (backend auto, warm cache) and --backend torch alternating, same labels."""
    first = load_bench_script("benchmark_first_result")
    monkeypatch.setenv("MHMLA_COMMIT", "test-commit")
    out = tmp_path / "first.json"
    rc = first.main(["--model", str(tiny_tagger_dir), "--variants", "default", "torch",
                     "--repeats", "1", "--threads", "1", "--out", str(out)])
    assert rc == 0, capsys.readouterr()
    result = json.loads(out.read_text())
    assert result["header"]["commit"] == "test-commit" and result["header"]["device"]["cpu"]
    assert {"torch", "onnx", "onnxruntime", "mhmla-fast"} <= set(result["header"]["versions"])
    assert "exporting tagger to ONNX once" in result["cold"]["stderr"]
    for v in ("default", "torch"):
        row = result["variants"][v]
        assert row["failed"] == [] and row["labels_equal_torch"] is True
        assert 0 < row["first_result_s_median"] <= row["wall_s_median"]
    assert "--backend torch" in result["variants"]["torch"]["command"]
    assert "--backend" not in result["variants"]["default"]["command"]
    assert len(result["labels"]) == 7  # He go to school every days .


def test_first_result_script_times_score_too(tiny_scorer_dir, tmp_path, monkeypatch, capsys):
    """``--command score``: one essay through ``mhmla-serve score``, default (auto, warm cache)
    and --backend torch, the same score; the scorer has no explicit onnx variant."""
    first = load_bench_script("benchmark_first_result")
    monkeypatch.setenv("MHMLA_COMMIT", "test-commit")
    out = tmp_path / "first.json"
    rc = first.main(["--command", "score", "--model", str(tiny_scorer_dir), "--repeats", "1",
                     "--cold", "0", "--threads", "1", "--profile", "--out", str(out)])
    assert rc == 0, capsys.readouterr()
    result = json.loads(out.read_text())
    assert set(result["variants"]) == {"default", "torch"}
    for row in result["variants"].values():
        assert row["failed"] == [] and row["score_equal_torch"] is True
        assert " score " in row["command"]
        assert row["import_profile"]["exit_status"] == 0 and row["import_profile"]["imports_s"] > 0
    assert result["variants"]["torch"]["import_profile"]["imported"]["torch"] is True
    assert result["variants"]["default"]["import_profile"]["imported"] == {
        "torch": False, "transformers": False, "onnxruntime": True, "tokenizers": True}
    assert isinstance(result["score"], int) and json.loads(result["header"]["input"])["prompt"] == 1
    with pytest.raises(SystemExit):
        first.parse_args(["--command", "score", "--variants", "onnx"])


def test_each_row_is_kept_in_a_partial_file_while_the_run_goes_on(bench, tmp_path):
    """A run cut by a time box keeps the rows it measured: Run.progress rewrites
    <out>.partial.json (the header and every row so far) after each row."""
    partial = tmp_path / "out.partial.json"
    run = bench.Run(argparse.Namespace(device="cpu"), tmp_path, tmp_path, 1, partial=partial,
                    header={"device": "x"})
    run.progress({"task": "tag", "path": "engine", "sentences_per_s": 10.0})
    run.progress({"task": "tag", "path": "plain_torch", "error": "boom"})
    kept = json.loads(partial.read_text())
    assert kept["partial"] is True and kept["header"] == {"device": "x"}
    assert [r["path"] for r in kept["rows"]] == ["engine", "plain_torch"]
