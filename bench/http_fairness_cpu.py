"""Fairness probe of ``mhmla-serve http``: how long a one-sentence request waits while a long
text is being tagged, per set of server options, beside the long text's own time.

    python bench/http_fairness_cpu.py --sides "--max-batch-tokens 8192" "--max-batch-tokens 2048" \\
        --rounds 3 --out bench/results/http_fairness_cpu_<date>.json

For each side (server options added to ``mhmla-serve http --no-scorer``; the shipped tagger,
backend auto), in ``--rounds`` rounds that alternate the sides, a fresh server is started and:

idle    ``--idle`` one-sentence requests one after another: the latency of a short request
        alone;
long    one ``POST /v1/tag`` of one text of ``--long-chars`` characters (FCE training
        sentences joined, so English learner prose), and ``--delay`` seconds after it, a probe
        client that sends one short sentence, waits for its answer, sleeps ``--gap`` and sends
        the next until the long text is answered: every probe's latency, and the long text's
        seconds from sending to answer.

The summary per side is the median over rounds of the long text's seconds and of the probes'
p50, p95 and max latency (``benchmark_serve.latency_summary``). Short-request throughput under load (64 clients) is
``bench/benchmark_serve.py --tasks http --http-server-args ...``'s job, not this probe's.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmark_serve import (  # noqa: E402
    device_info, free_port, latency_summary, stop_server, versions, wait_healthy)

from mhmla_fast import provenance  # noqa: E402
from mhmla_fast.ged.data import read_fce_tsv  # noqa: E402
from mhmla_fast.paths import shared_data_file  # noqa: E402

SHORT = "He go to school every day and she have two dog ."


def long_text(chars: int) -> str:
    """FCE training sentences joined with spaces, cut to ``chars`` characters at a space."""
    sentences = read_fce_tsv(shared_data_file("fce/fce-public.train.original.tsv", "--data"))
    parts, n = [], 0
    for s in sentences:
        line = " ".join(s.tokens)
        parts.append(line)
        n += len(line) + 1
        if n >= chars:
            break
    return " ".join(parts)[:chars].rsplit(" ", 1)[0]


async def probe_side(url: str, text: str, args: argparse.Namespace) -> dict:
    import httpx

    short = {"texts": [SHORT]}
    async with httpx.AsyncClient(timeout=600) as c:
        for _ in range(3):  # warm the connection and the path
            (await c.post(url + "/v1/tag", json=short)).raise_for_status()
        idle = []
        for _ in range(args.idle):
            t0 = time.perf_counter()
            (await c.post(url + "/v1/tag", json=short)).raise_for_status()
            idle.append(time.perf_counter() - t0)

        async def long_request() -> tuple[float, int]:
            async with httpx.AsyncClient(timeout=600) as lc:
                t0 = time.perf_counter()
                r = await lc.post(url + "/v1/tag", json={"texts": [text]})
                return time.perf_counter() - t0, r.status_code

        task = asyncio.create_task(long_request())
        await asyncio.sleep(args.delay)
        probes, statuses = [], []
        while not task.done():
            t0 = time.perf_counter()
            r = await c.post(url + "/v1/tag", json=short)
            statuses.append(r.status_code)
            if r.status_code == 200:
                probes.append(time.perf_counter() - t0)
            await asyncio.sleep(args.gap)
        long_s, long_status = await task
    return {"idle_s": latency_summary(idle),
            "long_s": long_s if long_status == 200 else None, "long_status": long_status,
            "probes": len(probes),
            "probe_statuses": {str(s): statuses.count(s) for s in sorted(set(statuses))},
            "probe_s": latency_summary(probes),
            "probe_latencies": [round(x, 4) for x in probes]}


def run_side(side: str, text: str, args: argparse.Namespace) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "mhmla_fast.commands.serve", "http", "--host", "127.0.0.1",
           "--port", str(port), "--no-scorer", "--no-access-log", "--log-level", "warning",
           *shlex.split(side)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        startup = wait_healthy(f"http://127.0.0.1:{port}", proc, 300)
        row = asyncio.run(probe_side(f"http://127.0.0.1:{port}", text, args))
    finally:
        stop_server(proc)
    return {"side": side, "startup_s": startup, **row}


def summarise(rows: list[dict]) -> dict:
    out = {}
    for side in dict.fromkeys(r["side"] for r in rows):
        mine = [r for r in rows if r["side"] == side]

        def med(get):
            vals = [v for v in map(get, mine) if v is not None]
            return statistics.median(vals) if vals else None

        out[side] = {"rounds": len(mine), "long_s": med(lambda r: r["long_s"]),
                     "probe_p50_s": med(lambda r: r["probe_s"]["p50_s"]),
                     "probe_p95_s": med(lambda r: r["probe_s"]["p95_s"]),
                     "probe_max_s": med(lambda r: r["probe_s"]["max_s"]),
                     "idle_p50_s": med(lambda r: r["idle_s"]["p50_s"])}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sides", nargs="+", required=True,
                    help="server options of each side, one quoted string per side")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--long-chars", type=int, default=500_000)
    ap.add_argument("--idle", type=int, default=20)
    ap.add_argument("--delay", type=float, default=0.5,
                    help="seconds between the long text and the first probe")
    ap.add_argument("--gap", type=float, default=0.1, help="seconds between probes")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    text = long_text(args.long_chars)
    rows = []
    for r in range(args.rounds):
        for side in args.sides:
            row = run_side(side, text, args)
            row["round"] = r
            rows.append(row)
            print(f"round {r} [{side}] long {row['long_s']} s ({row['long_status']}), probes "
                  f"p50 {row['probe_s']['p50_s']} max {row['probe_s']['max_s']} "
                  f"({row['probes']})", flush=True)
    summary = summarise(rows)
    print(json.dumps(summary, indent=1))
    result = {"header": {"script": "bench/http_fairness_cpu.py", "argv": sys.argv[1:],
                         "date": datetime.date.today().isoformat(),
                         "commit": provenance.git_commit(), "versions": versions(),
                         "device": device_info("cpu"), "long_chars": len(text)},
              "summary": summary, "rows": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
