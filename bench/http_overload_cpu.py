"""Overload probe of ``mhmla-serve http``: N concurrent ``POST /v1/tag`` requests of 4 texts
of 400 words each, sent at once, then again on the now warm server; per burst the statuses,
when the answers came, and the texts tagged (``mhmla_texts_tagged_total``) against those
delivered. Start the server first, e.g.::

    mhmla-serve http --port 18431 --threads 1 --request-timeout 20 &
    python bench/http_overload_cpu.py --url http://127.0.0.1:18431 --out bench/results/...json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import re
import time

BASE = ("He go to school every day . She have a cat and two dog . I am agree with you . "
        "They was happy").split()


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


async def burst(url: str, n: int, seed: int) -> dict:
    import httpx

    rng = random.Random(seed)
    bodies = [{"texts": [" ".join(rng.choice(BASE) for _ in range(400)) for _ in range(4)]}
              for _ in range(n)]
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=n + 8)) as c:
        before = (await c.get(url + "/metrics")).text
        t0, done = time.perf_counter(), []

        async def one(body):
            r = await c.post(url + "/v1/tag", json=body)
            done.append((r.status_code, time.perf_counter() - t0))

        await asyncio.gather(*(one(b) for b in bodies))
        after = (await c.get(url + "/metrics")).text
    statuses = collections.Counter(s for s, _ in done)
    ok = [t for s, t in done if s == 200]
    return {"statuses": {str(k): v for k, v in sorted(statuses.items())},
            "seconds": time.perf_counter() - t0,
            "first_200_s": min(ok, default=None), "last_200_s": max(ok, default=None),
            "texts_tagged": _metric(after, "mhmla_texts_tagged_total")
            - _metric(before, "mhmla_texts_tagged_total"),
            "texts_delivered": 4 * statuses[200]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:18431")
    ap.add_argument("--requests", type=int, default=80)
    ap.add_argument("--bursts", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    rows = [asyncio.run(burst(a.url, a.requests, seed=7)) for _ in range(a.bursts)]
    for k, row in enumerate(rows, 1):
        print(f"burst {k}: {json.dumps(row)}")
    if a.out:
        from mhmla_fast.provenance import provenance

        with open(a.out, "w") as f:
            json.dump({"what": __doc__.split("\n\n")[0], "requests": a.requests,
                       "bursts": rows, "provenance": provenance()}, f, indent=1)


if __name__ == "__main__":
    main()
