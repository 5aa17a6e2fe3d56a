"""bench/results/onnx_cpu_discrepancy.md, section 1: padding of the engine's packing of FCE dev+test for record chunks of N (the CLI's --batch-size)."""
import os
from mhmla_fast.ged.data import read_ged
from mhmla_fast.paths import shared_data_dir
from mhmla_fast.serve.engine import load_tokenizer
from mhmla_fast.packing import pack_by_token_budget

def main() -> None:
    sents = []
    for s in ("dev", "test"):
        sents += [list(x.tokens) for x in read_ged(shared_data_dir() / "fce" / f"fce-public.{s}.original.tsv") if x.tokens]
    tok = load_tokenizer(os.environ.get("ONNX_DIR", "/tmp/onnx-ged"))
    enc = tok(sents, is_split_into_words=True, add_special_tokens=False)["input_ids"]
    L = [len(x) + 2 for x in enc]
    import numpy as np
    print("pieces per sentence: mean %.1f median %.0f p95 %.0f max %d" % (np.mean(L), np.median(L), np.percentile(L, 95), max(L)))
    def cost(chunk, budget, max_batch, pack=pack_by_token_budget):
        padded = real = calls = sq = 0
        for k in range(0, len(L), chunk):
            ls = L[k:k + chunk]
            for b in pack(ls, budget, max_batch):
                T = max(ls[i] for i in b); padded += len(b) * T; real += sum(ls[i] for i in b); calls += 1
                sq += len(b) * T * T
        return padded / real, calls, sq / sum(l * l for l in L)
    for chunk in (512, 1024, 2048, 4096, len(L)):
        for budget in (4096, 8192):
            r, c, q = cost(chunk, budget, 256)
            print(f"chunk {chunk:5d} budget {budget}: padded/real {r:.2f}, {c} calls, attention T^2 {q:.2f}x")

    def pack_slack(lengths, budget, max_batch, slack=0.2, min_rows=8):
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        out, cur, longest, total = [], [], 0, 0
        for i in order:
            n = lengths[i]; T = max(longest, n)
            if cur and ((len(cur) + 1) * T > budget or len(cur) >= max_batch
                        or (len(cur) >= min_rows and (len(cur) + 1) * T > (1 + slack) * (total + n))):
                out.append(cur); cur, longest, total = [], 0, 0
            cur.append(i); longest = max(longest, n); total += n
        if cur: out.append(cur)
        return out
    for slack, mr in ((0.1, 8), (0.2, 8), (0.2, 16), (0.3, 16)):
        for chunk in (512, len(L)):
            for budget in (4096, 8192):
                r, c, q = cost(chunk, budget, 256, lambda ls, b, m: pack_slack(ls, b, m, slack, mr))
                print(f"slack {slack} min_rows {mr} chunk {chunk:5d} budget {budget}: padded/real {r:.2f}, {c} calls, T^2 {q:.2f}x")



if __name__ == "__main__":
    main()

# usage: ONNX_DIR=/tmp/onnx-ged python bench/onnx_cpu_padding.py  (no model run; the export
# directory only provides the tokenizer)
