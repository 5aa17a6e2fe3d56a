"""The one serving contract (``mhmla_fast.serve.options``): every loader takes backend, device,
dtype and kernels, resolves the defaults by one rule ("cuda if available" written once), and an
option a backend cannot honour is a ValueError naming the option and the backend, never dropped.
Also: the command line turns those errors into exit 2, the head's kernels reach the model, and
the start-up path imports no torch where it does not need it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from mhmla_fast import devices
from mhmla_fast.serve import options
from mhmla_fast.serve.options import resolve_dtype, resolve_options

PACKAGE = Path(__file__).resolve().parents[1] / "mhmla_fast"


@pytest.fixture
def no_gpu(monkeypatch):
    """Neither torch nor ONNX Runtime sees a CUDA GPU."""
    monkeypatch.setattr(devices, "cuda_available", lambda backend="torch": False)


@pytest.fixture
def gpu(monkeypatch):
    """torch and ONNX Runtime both see a CUDA GPU."""
    monkeypatch.setattr(devices, "cuda_available", lambda backend="torch": True)


# ---------------------------------------------------------------------- defaults


def test_defaults_follow_one_rule(no_gpu, monkeypatch):
    monkeypatch.setattr(options, "onnx_importable", lambda: True)
    assert resolve_options() == options.ServeOptions("auto", "cpu", "float32", "auto")
    assert resolve_options("torch") == options.ServeOptions("torch", "cpu", "float32", "auto")
    assert resolve_options("onnx") == options.ServeOptions("onnx", "cpu", "float32", "auto")
    assert resolve_options("tensorrt").device == "cuda"  # TensorRT has no CPU
    assert resolve_options("tensorrt").dtype is None  # whatever the plan was built with


def test_defaults_on_a_gpu(gpu):
    assert resolve_options() == options.ServeOptions("torch", "cuda", "bfloat16", "auto")
    assert resolve_options("torch") == resolve_options()  # auto is torch on a GPU
    assert resolve_options("onnx") == options.ServeOptions("onnx", "cuda", "float32", "auto")
    assert resolve_options(device="cpu").dtype == "float32"
    assert resolve_options(device="cuda:1", dtype="fp16").dtype == "float16"  # aliases


def test_auto_leaves_the_choice_to_load_time_only_where_onnx_can_honour_everything(
        no_gpu, monkeypatch):
    """auto stays "auto" (cached ONNX export or torch, chosen at load) on the CPU in float32 with
    onnxruntime and onnx installed; any option only torch has makes it torch; int8 is refused."""
    monkeypatch.setattr(options, "onnx_importable", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    auto = options.ServeOptions("auto", "cpu", "float32", "auto")
    assert resolve_options("auto", "cpu", "fp32") == auto
    assert resolve_options("auto", kernels="torch").backend == "auto"  # the graph's own head
    for kw in (dict(kernels="triton"), dict(dtype="bfloat16"), dict(dtype="fp16"),
               dict(device="mps")):
        assert resolve_options("auto", **kw).backend == "torch", kw
    with pytest.raises(ValueError, match=r"^device: 'cuda:1', but torch has no usable CUDA"):
        resolve_options("auto", device="cuda:1")  # (no GPU: refused before the load)
    monkeypatch.setattr(devices, "cuda_available", lambda backend="torch": backend == "torch")
    assert resolve_options("auto", device="cuda:1") == options.ServeOptions(
        "torch", "cuda:1", "bfloat16", "auto")
    monkeypatch.setattr(devices, "cuda_available", lambda backend="torch": False)
    with pytest.raises(ValueError, match=r"^dtype: 'int8' is a graph of the onnx backend"):
        resolve_options("auto", dtype="int8")
    monkeypatch.setattr(options, "onnx_importable", lambda: False)
    assert resolve_options() == options.ServeOptions("torch", "cpu", "float32", "auto")


def test_onnx_importable_finds_without_importing(monkeypatch):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    assert options.onnx_importable()
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # "import onnxruntime" fails
    assert not options.onnx_importable()


def test_no_gpu_device_means_no_torch_import(monkeypatch):
    """Without any GPU driver's device node, "is there a CUDA GPU?" is answered without
    importing torch (1.3 s of the CPU path's start-up)."""
    monkeypatch.setattr(devices, "gpu_device_possible", lambda: False)
    monkeypatch.setitem(sys.modules, "torch", None)  # importing torch would fail
    assert devices.cuda_available("torch") is False
    assert devices.resolve_device(None, "torch") == "cpu"


def test_dtype_rule_and_aliases():
    assert resolve_dtype(None, "cuda:0") == "bfloat16"
    assert resolve_dtype(None, "cpu") == "float32"
    assert resolve_dtype(None, "cuda", "onnx") == "float32"
    assert resolve_dtype("bf16", "cpu") == "bfloat16" and resolve_dtype("fp32", "cuda") == "float32"


def test_cuda_available_asks_the_backends_own_runtime(monkeypatch):
    ort = pytest.importorskip("onnxruntime")
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    assert devices.cuda_available("onnx") is False
    monkeypatch.setattr(ort, "get_available_providers",
                        lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert devices.cuda_available("onnx") is True


def test_kernels_match_the_heads_backends():
    from mhmla_fast.functional import BACKENDS

    assert options.KERNELS == BACKENDS


# ------------------------------------------------------------------- refusals


@pytest.mark.parametrize("kw, pattern", [
    (dict(backend="jax"), r"^backend: .*'jax'"),
    (dict(kernels="cuda"), r"^kernels: .*'cuda'"),
    (dict(backend="torch", dtype="int8"), r"^dtype: the torch backend .*'int8'"),
    (dict(dtype="int8"), r"^dtype: 'int8' is a graph of the onnx backend"),
    (dict(backend="onnx", dtype="bfloat16"), r"^dtype: the onnx backend .*'bfloat16'"),
    (dict(backend="onnx", device="cuda"), r"^device: 'cuda' with the onnx backend needs "
                                          r"onnxruntime's CUDAExecutionProvider"),
    (dict(backend="onnx", device="mps"), r"^device: the onnx backend .*'mps'"),
    (dict(backend="torch", device="cuda"), r"^device: 'cuda', but torch has no usable CUDA"),
    (dict(device="cuda:0"), r"^device: 'cuda:0', but torch has no usable CUDA"),
    (dict(backend="onnx", device="cpu", kernels="triton"), r"^kernels: the onnx backend"),
    (dict(backend="tensorrt", device="cpu"), r"^device: the tensorrt backend runs on CUDA"),
    (dict(backend="tensorrt", dtype="int8"), r"^dtype: the tensorrt backend"),
    (dict(cuda_graphs=True), r"^cuda_graphs: .* the torch backend on a CUDA device"),
    (dict(backend="torch", device="cpu", cuda_graphs=True), r"^cuda_graphs: .*'torch' on 'cpu'"),
    (dict(backend="onnx", device="cpu", cuda_graphs=True), r"^cuda_graphs: .*'onnx'"),
])
def test_options_a_backend_cannot_honour_are_errors(no_gpu, kw, pattern):
    with pytest.raises(ValueError, match=pattern):
        resolve_options(**kw)


def test_cuda_graphs_are_honoured_by_torch_on_cuda(gpu):
    assert resolve_options(cuda_graphs=True) == resolve_options("torch", "cuda")
    assert resolve_options("torch", "cuda:1", "float16", cuda_graphs=True).device == "cuda:1"


def test_triton_kernels_on_the_cpu_need_the_interpreter(no_gpu, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"^kernels: 'triton' runs on a CUDA device"):
        resolve_options(device="cpu", kernels="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_options(device="cpu", kernels="triton").kernels == "triton"


def test_cuda_if_available_is_written_once():
    """No other module of the package picks a device with its own ``torch.cuda.is_available()``
    rule: they call ``mhmla_fast.devices.resolve_device``; and nothing under ``ged/`` or ``aes/``
    imports from ``serve/`` (the layering runs one way)."""
    rule = re.compile(r"""["']cuda["']\s+if\s+[\w.]*cuda\.is_available\(\)""")
    copies = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
              if rule.search(p.read_text(encoding="utf-8"))]
    assert copies == [], copies
    assert "torch.cuda.is_available()" in (PACKAGE / "devices.py").read_text()
    upward = re.compile(r"from\s+(\.\.serve|mhmla_fast\.serve)\b|import\s+mhmla_fast\.serve\b")
    layered = [str(p.relative_to(PACKAGE)) for sub in ("ged", "aes") for p in (PACKAGE / sub).rglob("*.py")
               if upward.search(p.read_text(encoding="utf-8"))]
    assert layered == [], layered


# ------------------------------------------------------------- the loaders


def test_the_torch_runner_honours_kernels_dtype_and_threads(tiny_tagger_dir, monkeypatch):
    import torch

    from mhmla_fast.serve.runners import make_runner

    threads = torch.get_num_threads()
    try:
        eager = make_runner(tiny_tagger_dir, device="cpu", kernels="torch", threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    assert eager.model.head.backend == "torch" and eager.kernels == "torch"
    assert eager.dtype is torch.float32 and eager.device.type == "cpu"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    fused = make_runner(tiny_tagger_dir, device="cpu", dtype="float16",
                        kernels="triton")
    assert fused.model.head.backend == "triton" and fused.dtype is torch.float16
    assert next(fused.model.parameters()).dtype is torch.float16
    with pytest.raises(ValueError, match="^dtype: the torch backend"):
        make_runner(tiny_tagger_dir, device="cpu", dtype="int8")


def test_engine_load_refuses_before_loading(tiny_tagger_dir, no_gpu):
    from mhmla_fast.serve.engine import Engine

    with pytest.raises(ValueError, match="^device: 'cuda' with the onnx backend"):
        Engine.load(tiny_tagger_dir, backend="onnx", device="cuda")
    with pytest.raises(ValueError, match="^kernels: the onnx backend"):
        Engine.load(tiny_tagger_dir, backend="onnx", kernels="triton")


def test_scorer_takes_the_same_contract(tiny_scorer_dir, no_gpu):
    import torch

    from mhmla_fast.serve.score import load_scorer, scorer_options

    scorer = load_scorer(tiny_scorer_dir, backend="torch", kernels="torch", device="cpu")
    assert scorer.head.layer_attention.backend == "torch"
    assert next(scorer.parameters()).dtype is torch.float32  # the rule's CPU default
    assert scorer_options("auto", device="cpu").backend == "auto"  # export or torch, at load
    assert scorer_options("auto", device="cpu", dtype="bfloat16") == scorer_options(
        "torch", device="cpu", dtype="bfloat16")  # what only torch honours: torch
    for backend in ("onnx", "tensorrt"):
        with pytest.raises(ValueError, match=rf"^backend: the essay scorer runs on 'auto' or "
                                             rf"'torch'.*'{backend}'"):
            load_scorer(tiny_scorer_dir, backend=backend)
    for backend in ("auto", "torch"):
        with pytest.raises(ValueError, match="^dtype: the essay scorer has"):
            load_scorer(tiny_scorer_dir, backend=backend, dtype="int8")


# ---------------------------------------------------------------- the CLI


def test_the_cli_refuses_what_a_backend_cannot_honour(tmp_path, tiny_tagger_dir, tiny_scorer_dir,
                                                      no_gpu, capsys):
    from mhmla_fast.commands.serve import main

    src = tmp_path / "in.txt"
    src.write_text("He go to school .\n")
    out = tmp_path / "out.jsonl"
    cases = [
        (["tag", str(src), "--backend", "onnx", "--device", "cuda"],
         "--device: 'cuda' with the onnx backend needs onnxruntime's CUDAExecutionProvider"),
        (["tag", str(src), "--backend", "onnx", "--kernels", "triton"], "--kernels: the onnx"),
        (["tag", str(src), "--backend", "tensorrt", "--device", "cpu"],
         "--device: the tensorrt backend runs on CUDA"),
        (["tag", str(src), "--backend", "torch", "--dtype", "int8"],
         "--dtype: the torch backend"),
        (["tag", str(src), "--dtype", "int8"], "--dtype: 'int8' is a graph of the onnx backend"),
        (["score", str(src), "--backend", "onnx", "--model", str(tiny_scorer_dir)],
         "argument --backend: invalid choice: 'onnx' (choose from 'auto', 'torch')"),
        (["http", "--backend", "onnx", "--device", "cuda"], "--device: 'cuda' with the onnx"),
        (["tag", str(src), "--cuda-graphs"], "--cuda-graphs: replaying passes from CUDA graphs"),
        (["tag", str(src), "--cuda-graphs", "--ray"], "--cuda-graphs is not available with --ray"),
        (["http", "--cuda-graphs", "--device", "cpu"], "--cuda-graphs: replaying passes"),
    ]
    for argv, message in cases:
        if argv[0] != "http":
            argv = [*argv, "--output", str(out)]
        assert main([*argv, "--model", str(tiny_tagger_dir)] if "--model" not in argv
                    else argv) == 2, argv
        assert message in capsys.readouterr().err, argv
        assert not out.exists(), "a refused option leaves no output file"


def test_the_cli_passes_kernels_to_the_tagger_and_the_scorer(tmp_path, tiny_tagger_dir,
                                                             tiny_scorer_dir, monkeypatch):
    from mhmla_fast.commands import serve as cli
    from mhmla_fast.serve import engine, score

    seen = {}
    real_engine, real_scorer = engine.Engine.load.__func__, score.load_scorer

    def spy_engine(cls, path, **kw):
        seen["engine"] = kw
        return real_engine(cls, path, **kw)

    def spy_scorer(path, **kw):
        seen["scorer"] = kw
        return real_scorer(path, **kw)

    monkeypatch.setattr(engine.Engine, "load", classmethod(spy_engine))
    monkeypatch.setattr(score, "load_scorer", spy_scorer)
    src = tmp_path / "in.txt"
    src.write_text("He go to school .\n")
    assert cli.main(["tag", str(src), "-o", str(tmp_path / "t.jsonl"), "--model",
                     str(tiny_tagger_dir), "--kernels", "torch", "--device", "cpu",
                     "--threads", "1", "--no-progress"]) == 0
    assert seen["engine"] == dict(backend="auto", device="cpu", dtype=None, kernels="torch",
                                  threads=1, threshold=None, token_budget=None, host_workers=0,
                                  cuda_graphs=False, cache=None, lanes=1,  # one per thread
                                  check_margin=None)
    essays = tmp_path / "essays.jsonl"
    essays.write_text('{"text": "a b c", "prompt": 1}\n')
    assert cli.main(["score", str(essays), "-o", str(tmp_path / "s.jsonl"), "--model",
                     str(tiny_scorer_dir), "--kernels", "torch", "--device", "cpu",
                     "--threads", "1", "--no-progress"]) == 0
    assert seen["scorer"] == dict(backend="auto", device="cpu", dtype=None, kernels="torch",
                                  threads=1, cache=None, check_margin=None)


# ------------------------------------------------------------------ start-up


def test_importing_the_cli_imports_no_torch():
    """``mhmla-serve --help`` and the ONNX path must not pay for torch at import time."""
    code = ("import sys, mhmla_fast.commands.serve as s; s.build_parser(); "
            "import mhmla_fast.serve.engine, mhmla_fast.serve.runners, mhmla_fast.serve.score; "
            "bad = [m for m in ('torch', 'transformers', 'onnxruntime') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


# ------------------------------------------------------------------ one packer


def test_lanes_are_a_cpu_option_checked_once(gpu):
    """``lanes``: a positive int, more than 1 only on the CPU, never more than the threads;
    a batch job's default is one lane per thread on the CPU and 1 on a GPU."""
    from mhmla_fast.serve.runners import Lanes

    assert resolve_options("torch", "cpu", lanes=4).device == "cpu"
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="^lanes: expected a positive integer"):
            resolve_options("torch", "cpu", lanes=bad)
    with pytest.raises(ValueError, match="^lanes: concurrent forward passes run on the CPU, "
                                         "got device 'cuda:1'"):
        resolve_options("torch", "cuda:1", lanes=2)
    resolve_options("torch", "cuda:1", lanes=1)
    assert Lanes.split(None, 1) is None and Lanes.split(3, 1) == 3
    assert Lanes.split(4, 2) == 2 and Lanes.split(5, 2) == 2 and Lanes.split(2, 2) == 1
    with pytest.raises(ValueError, match="^lanes: 3 passes at a time need at least as many "
                                         "threads, got threads 2"):
        Lanes.split(2, 3)
    assert options.throughput_lanes("cpu", 3) == 3 and options.throughput_lanes("cuda", 3) == 1
    assert options.throughput_lanes("cpu", None) == devices.default_threads()


def test_the_engine_keeps_every_lane_busy_and_results_in_order(tiny_engine):
    """With a runner of ``lanes`` passes at a time, the engine submits lanes + 1 passes before
    it waits for the first (so each lane has the next queued), and merges them in order."""
    from mhmla_fast.serve.engine import Engine
    from mhmla_fast.serve.runners import Pending

    class Recording:
        def __init__(self, runner, lanes):
            self.runner, self.lanes, self.log = runner, lanes, []

        def submit(self, ids, mask):
            k = sum(1 for e in self.log if e[0] == "submit")
            self.log.append(("submit", k))
            out = self.runner(ids, mask)
            log = self.log

            class Late(Pending):
                def result(self):
                    log.append(("result", k))
                    return out
            return Late(out)

    texts = ["He go to school .", "A cat .", "They goes home and she see the dog ."] * 20
    want = [r.to_dict() for r in tiny_engine.tag_texts(texts)]
    for lanes in (1, 3):
        runner = Recording(tiny_engine.runner, lanes)
        engine = Engine(runner, tiny_engine.tokenizer, token_budget=48)
        assert [r.to_dict() for r in engine.tag_texts(texts)] == want
        passes = sum(1 for e in runner.log if e[0] == "submit")
        assert passes > lanes + 2
        first_wait = runner.log.index(("result", 0))
        assert runner.log[:first_wait] == [("submit", k) for k in range(lanes + 1)]
        in_flight = 0
        for kind, _ in runner.log:
            in_flight += 1 if kind == "submit" else -1
            assert in_flight <= lanes + 1
        assert [k for kind, k in runner.log if kind == "result"] == list(range(passes))


def test_torch_lanes_tag_like_one_pass_at_a_time(tiny_tagger_dir):
    """The torch runner on two lanes (torch's threads split between them): the same labels,
    probabilities equal to rounding, and torch's thread count set per lane."""
    import torch

    from mhmla_fast.serve.engine import Engine

    threads = torch.get_num_threads()
    try:
        one = Engine.load(tiny_tagger_dir, backend="torch", device="cpu", threads=2)
        texts = ["He go to school every day .", "A cat .", "They goes to the house ."] * 30
        want = one.tag_texts(texts)
        two = Engine.load(tiny_tagger_dir, backend="torch", device="cpu", threads=2, lanes=2,
                          token_budget=64)
        assert torch.get_num_threads() == 1 and two.runner.lanes == 2
        got = two.tag_texts(texts)
        two.close()
    finally:
        torch.set_num_threads(threads)
    assert [r.labels for r in got] == [r.labels for r in want]
    for a, b in zip(got, want):
        assert a.probs == pytest.approx(b.probs, abs=1e-5)


def test_the_cli_takes_lanes_for_tag_only_on_the_cpu(tmp_path, tiny_tagger_dir, monkeypatch,
                                                     capsys, gpu):
    from mhmla_fast.commands import serve as cli
    from mhmla_fast.serve import engine

    seen = []
    real = engine.Engine.load.__func__

    def spy(cls, path, **kw):
        seen.append(kw["lanes"])
        return real(cls, path, **kw)

    monkeypatch.setattr(engine.Engine, "load", classmethod(spy))
    src = tmp_path / "in.txt"
    src.write_text("He go to school .\n")
    base = ["tag", str(src), "--model", str(tiny_tagger_dir), "--backend", "torch",
            "--device", "cpu", "--no-progress"]
    assert cli.main([*base, "-o", str(tmp_path / "a.jsonl"), "--threads", "2"]) == 0
    assert cli.main([*base, "-o", str(tmp_path / "b.jsonl"), "--threads", "2",
                     "--lanes", "1"]) == 0
    assert seen == [2, 1]  # default: one lane per thread
    assert (tmp_path / "a.jsonl").read_text() == (tmp_path / "b.jsonl").read_text()
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["tag", "-", "--lanes", "0"])
    for extra, message in (
            (["--threads", "2", "--lanes", "3"], "--lanes: 3 passes at a time need at least "
                                                  "as many threads, got threads 2"),
            (["--device", "cuda", "--lanes", "2"], "--lanes: concurrent forward passes run on "
                                                   "the CPU")):
        with pytest.raises(cli.UsageError, match=re.escape(message)):
            cli.load_engine(cli.build_parser().parse_args([*base, *extra]))
    assert cli.main([*base, "-o", str(tmp_path / "c.jsonl"), "--lanes", "2", "--ray"]) != 0
    assert "--lanes applies to one process" in capsys.readouterr().err


def test_one_packer_cuts_by_token_budget():
    from mhmla_fast.packing import pack_by_token_budget

    lengths = [5, 40, 3, 40, 12, 7, 100, 1, 12]
    for longest_first in (False, True):
        for budget, max_batch in [(85, None), (100, 3), (24, 2), (1, None), (10_000, 4)]:
            batches = pack_by_token_budget(lengths, budget, max_batch, longest_first=longest_first)
            assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
            flat = [lengths[i] for b in batches for i in b]
            assert flat == sorted(flat, reverse=longest_first)
            for b in batches:
                assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= budget
                assert max_batch is None or len(b) <= max_batch
    assert pack_by_token_budget([], 10) == []
    assert pack_by_token_budget([2, 2, 2, 2], 6) == [[0, 1, 2], [3]]  # greedy, stable
    with pytest.raises(ValueError, match="^token_budget"):
        pack_by_token_budget([1], 0)


def _greedy_packer(lengths, token_budget, max_batch=None, *, longest_first=False,
                   max_padding=None, min_rows=8):
    """The packer's rule written as the plain greedy loop it is (the vectorised packer must
    cut exactly these batches)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i] if longest_first else lengths[i])
    batches, cur, longest, real = [], [], 0, 0
    for i in order:
        n = lengths[i]
        padded = (len(cur) + 1) * max(longest, n)
        if cur and (padded > token_budget or (max_batch is not None and len(cur) >= max_batch)
                    or (max_padding is not None and len(cur) >= min_rows
                        and padded > (1 + max_padding) * (real + n))):
            batches.append(cur)
            cur, longest, real = [], 0, 0
        cur.append(i)
        longest, real = max(longest, n), real + n
    return batches + [cur] if cur else batches


def test_packer_cuts_what_the_greedy_loop_cuts():
    """Random lengths (zeros, ties, rows longer than the budget), budgets, row caps, padding
    limits and both orders: the same batches, in the same order, as the greedy loop."""
    import random

    from mhmla_fast.packing import pack_by_token_budget

    rng = random.Random(0)
    for _ in range(1500):
        lengths = [rng.randint(0, rng.choice([3, 20, 80, 600])) for _ in range(rng.randint(0, 200))]
        budget, max_batch = rng.choice([1, 5, 50, 1024, 65536]), rng.choice([None, 1, 3, 256])
        kw = dict(longest_first=rng.random() < 0.5, min_rows=rng.choice([1, 8, 30]),
                  max_padding=rng.choice([None, 0.0, 0.05, 0.2, 1.0]))
        got = pack_by_token_budget(lengths, budget, max_batch, **kw)
        assert got == _greedy_packer(lengths, budget, max_batch, **kw), (lengths, budget, kw)
        assert all(type(i) is int for b in got for i in b)


def test_tagging_and_scoring_share_the_packer(tiny_engine, tiny_scorer, monkeypatch):
    from mhmla_fast.serve import engine as engine_module
    from mhmla_fast import packing

    calls = []
    real = packing.pack_by_token_budget

    def spy(lengths, token_budget, max_batch=None, **kw):
        calls.append((len(lengths), token_budget, kw.get("longest_first", False)))
        return real(lengths, token_budget, max_batch, **kw)

    monkeypatch.setattr(packing, "pack_by_token_budget", spy)
    monkeypatch.setattr(engine_module, "pack_by_token_budget", spy)
    tiny_engine.tag_texts(["He go to school .", "A cat ."])
    tiny_scorer.predict_scores(["An essay .", "Another one ."], [1, 2], token_budget=512)
    assert calls == [(2, tiny_engine.token_budget, False), (2, 512, True)]


def test_score_takes_the_dtype_spellings_of_tag():
    """`mhmla-serve score --dtype bf16` as `tag --dtype bf16`: the short names normalised, an
    unknown one refused by argparse naming the choices."""
    import mhmla_fast.commands.serve as cli

    parser = cli.build_parser()
    for text, want in (("bf16", "bfloat16"), ("fp32", "float32"), ("float16", "float16")):
        assert parser.parse_args(["score", "-", "--dtype", text]).dtype == want
    with pytest.raises(SystemExit):
        parser.parse_args(["score", "-", "--dtype", "int8"])
