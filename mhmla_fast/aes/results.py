"""Results of the essay-scoring protocols: per (fold, prompt) cells aggregated into the
means the tables report, and the summary table printed at the end of a run."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["_aggregate", "summary_table"]


def _aggregate(cells: dict[int, dict[int, dict]], folds: Sequence[int], prompts: Sequence[int]) -> dict:
    """Per fold/prompt QWK and exact agreement; means over folds per prompt and over prompts.
    A prompt with a cell missing (None: e.g. no essay with both raters' scores) has no mean,
    nor then has the whole: a mean over fewer folds or prompts than the result names would
    not be the protocol's figure."""
    def grab(key: str) -> dict[str, dict[str, float | None]]:
        return {str(k): {str(p): cells[k][p].get(key) for p in prompts} for k in folds}

    out: dict = {"qwk": grab("qwk"), "exact": grab("exact")}
    if any("dev_qwk" in cells[k][p] for k in folds for p in prompts):
        out["dev_qwk"] = grab("dev_qwk")
        out["selected"] = grab("selected")
    for key in ("qwk", "exact"):
        per_prompt = {}
        for p in prompts:
            vals = [cells[k][p].get(key) for k in folds]
            per_prompt[str(p)] = (None if not vals or None in vals
                                  else float(np.mean(vals)))
        out[f"per_prompt_{key}"] = per_prompt
        vals = list(per_prompt.values())
        out[f"mean_{key}"] = None if not vals or None in vals else float(np.mean(vals))
    return out


def summary_table(result: dict) -> str:
    """QWK (%) per prompt (mean over folds) and their mean, one row per model."""
    prompts = [str(p) for p in result["prompts"]]
    rows = [("model", *prompts, "mean")]
    entries = {**result["models"], **result.get("ensembles", {}), "human (H1-H2)": result["human"]}
    for name, r in entries.items():
        pp = r["per_prompt_qwk"]
        rows.append((name, *(f"{100 * pp[p]:.2f}" if pp[p] is not None else "-" for p in prompts),
                     f"{100 * r['mean_qwk']:.2f}" if r["mean_qwk"] is not None else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in rows)
