"""bench/results/onnx_cpu_discrepancy.md, section 2. Probe: the engine on ONNX Runtime over FCE dev+test, in the ways the CLI and the benchmark call it.

    ONNX_DIR=/tmp/onnx-ged python bench/onnx_cpu_probe.py MODE THREADS [BUDGET [SPLIT [PASSES]]]

MODE: whole (one Engine.tag_tokens call) | chunks512 (calls of 512 sentences, as mhmla-serve tag
makes them); SPLIT: devtest | dev | test. BACKEND=torch runs the shipped torch tagger instead;
NOSLACK=1 packs without the padding cap (the packer before it). Prints per pass: wall, time in
the runner, calls, padding, CPU seconds and cores busy.
"""
import os, resource, sys, time
from mhmla_fast.ged.data import read_ged
from mhmla_fast.paths import shared_data_dir
from mhmla_fast.ged.predict import default_model_path
from mhmla_fast.serve.engine import Engine


def main() -> None:
    mode = sys.argv[1]           # whole | chunks512
    threads = int(sys.argv[2])
    budget = int(sys.argv[3]) if len(sys.argv) > 3 else 8192
    split = sys.argv[4] if len(sys.argv) > 4 else "devtest"
    sents = []
    for s in (("dev", "test") if split == "devtest" else (split,)):
        sents += [list(x.tokens) for x in read_ged(shared_data_dir() / "fce" / f"fce-public.{s}.original.tsv") if x.tokens]
    t0 = time.perf_counter()
    backend = os.environ.get("BACKEND", "onnx")
    model = os.environ.get("ONNX_DIR", "/tmp/onnx-ged") if backend == "onnx" else str(default_model_path())
    eng = Engine.load(model, backend=backend, device="cpu", threads=threads, token_budget=budget)
    load_s = time.perf_counter() - t0
    real = eng.runner
    if os.environ.get("NOSLACK"): eng.max_padding = None
    stats = {"run_s": 0.0, "calls": 0, "padded": 0, "real": 0}
    def timed(ids, mask):
        t = time.perf_counter(); out = real(ids, mask); stats["run_s"] += time.perf_counter() - t
        stats["calls"] += 1; stats["padded"] += ids.size; stats["real"] += int(mask.sum()); return out
    eng.runner = timed
    def one_pass():
        if mode == "whole":
            eng.tag_tokens(sents)
        else:
            for k in range(0, len(sents), 512):
                eng.tag_tokens(sents[k:k + 512])
    for rep in range(int(sys.argv[5]) if len(sys.argv) > 5 else 2):
        for k in stats: stats[k] = 0 if k != "run_s" else 0.0
        r0 = resource.getrusage(resource.RUSAGE_SELF); t = time.perf_counter(); one_pass(); wall = time.perf_counter() - t
        r1 = resource.getrusage(resource.RUSAGE_SELF); cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        la = os.getloadavg()[0]
        print(f"{backend} {mode} threads={threads} budget={budget} {split} pass{rep}: {len(sents)} sents {wall:.2f} s "
              f"= {len(sents)/wall:.0f} sent/s; ORT run {stats['run_s']:.2f} s ({len(sents)/stats['run_s']:.0f} sent/s), "
              f"{stats['calls']} calls, padding {stats['padded']/stats['real']:.2f}x; load {load_s:.2f} s; cpu {cpu:.1f} s ({cpu/wall:.2f} cores busy); loadavg {la:.1f}", flush=True)


if __name__ == "__main__":
    main()
