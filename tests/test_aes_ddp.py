"""AES fine-tuning under torchrun's environment with 2 gloo processes on the CPU: the windows
of each batch dealt out by length, the ranks' gradients equal to one process's on the whole
batch, and a whole run where rank 0 alone writes and every rank returns the best scorer."""

from __future__ import annotations

import json
import random

import numpy as np
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from mhmla_fast.aes.data import Essay
from test_ged_ddp import WORLD, _env, _leave, free_port  # noqa: E402 - the same torchrun environment
from test_ged_train import tiny_encoder  # noqa: E402,F401 - the same tiny BERT

WORDS = "the a student school book write read essay good bad long short day".split()


def essays(n: int, seed: int) -> list[Essay]:
    rng = random.Random(seed)
    return [Essay(seed * 1000 + i, 3, " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40))),
                  i % 4, i % 4, i % 4, i + 1) for i in range(n)]


def _cfg(encoder: str, out: str, **kw):
    from mhmla_fast.aes.finetune import FinetuneConfig

    base = dict(out=out, prompts=(3,), encoder=encoder, num_heads=4, dropout=0.0, batch_size=6,
                lr=1e-3, head_lr=3e-3, backend="torch", epochs=1, pooling="attention")
    return FinetuneConfig(**{**base, **kw})


def _scorer_and_windows(encoder: str):
    from mhmla_fast.aes.model import EssayScorer, ScorerConfig, encode_essay_windows, load_tokenizer

    torch.manual_seed(0)
    cfg = _cfg(encoder, "unused")
    scorer = EssayScorer(ScorerConfig(encoder_spec=cfg.encoder_spec, layer_attention=cfg.layer_attention,
                                      pooling=cfg.pooling, prompts=(3,)), backend="torch").eval()
    tok = load_tokenizer(cfg.encoder_spec)
    es = essays(7, 1)
    windows, index = encode_essay_windows(tok, [e.text for e in es], scorer.config.window or 510)
    scores = np.array([es[i].score for i in index], dtype=np.int64)
    return cfg, scorer, tok, windows, scores


def _grads_worker(rank: int, port: int, encoder: str, out: str) -> None:
    from torch.nn.parallel import DistributedDataParallel

    from mhmla_fast.aes.finetune import _window_loss
    from mhmla_fast.distributed import init_distributed, shard

    _env(rank, port)
    ctx = init_distributed("cpu")
    cfg, scorer, tok, windows, scores = _scorer_and_windows(encoder)
    net = DistributedDataParallel(scorer, find_unused_parameters=True)
    rows = list(range(len(windows)))
    mine = shard(rows, [len(w) for w in windows], ctx.rank, ctx.world_size)
    loss = _window_loss(net, cfg, mine, 3, windows, scores, tok.pad_token_id, torch.device("cpu"),
                        torch.autocast("cpu", enabled=False), reduction="sum")
    (loss * ctx.world_size / len(rows)).backward()
    if rank == 0:
        save_file({n: p.grad.contiguous() for n, p in scorer.named_parameters() if p.grad is not None},
                  out)
    _leave()


def test_ddp_gradients_equal_one_process_on_the_whole_batch(tmp_path, tiny_encoder):
    from mhmla_fast.aes.finetune import _window_loss

    out = str(tmp_path / "grads.safetensors")
    mp.spawn(_grads_worker, args=(free_port(), tiny_encoder, out), nprocs=WORLD, join=True)
    ddp = load_file(out)
    cfg, scorer, tok, windows, scores = _scorer_and_windows(tiny_encoder)
    off = torch.autocast("cpu", enabled=False)
    loss = _window_loss(scorer, cfg, list(range(len(windows))), 3, windows, scores, tok.pad_token_id,
                        torch.device("cpu"), off, reduction="mean")
    loss.backward()
    named = dict(scorer.named_parameters())
    assert set(ddp) == {n for n, p in named.items() if p.grad is not None}
    for name, grad in ddp.items():
        torch.testing.assert_close(grad, named[name].grad, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")


def _finetune_worker(rank: int, port: int, encoder: str, out: str) -> None:
    from mhmla_fast.aes.finetune import finetune

    _env(rank, port)
    best, state = finetune(_cfg(encoder, out, epochs=2, dropout=0.3), essays(24, 2), essays(8, 3),
                           log=None)
    assert best.config.training["protocol"] == "finetune"
    if rank == 0:
        with open(f"{out}/rank0_log.json", "w") as f:
            json.dump(state["log"], f)
    _leave()


def test_ddp_finetune_writes_once_and_every_rank_returns_the_best(tmp_path, tiny_encoder):
    out = tmp_path / "ft"
    mp.spawn(_finetune_worker, args=(free_port(), tiny_encoder, str(out)), nprocs=WORLD, join=True)
    log = json.loads((out / "rank0_log.json").read_text())
    assert [r["epoch"] for r in log] == [1, 2] and all(np.isfinite(r["loss"]) for r in log)
    assert (out / "best" / "config.json").is_file()
    assert json.loads((out / "checkpoint.json").read_text())["epoch"] == 2


def _killed_worker(rank: int, port: int, encoder: str, out: str, kill_at: int | None) -> None:
    """Two epochs of 4 steps, a checkpoint every 3; with ``kill_at``, every rank is stopped in
    that step (as a kill of the job) and the job started again in the same processes."""
    from mhmla_fast.aes import finetune as ft

    _env(rank, port)
    cfg = _cfg(encoder, out, epochs=2, dropout=0.3, checkpoint_every=3)
    train, dev = essays(24, 2), essays(8, 3)
    if kill_at is not None:
        real, calls = ft._window_loss, []

        def counted(*args, **kwargs):
            calls.append(1)
            if len(calls) == kill_at:
                raise KeyboardInterrupt
            return real(*args, **kwargs)

        ft._window_loss = counted
        try:
            ft.finetune(cfg, train, dev, log=None)
        except KeyboardInterrupt:
            pass
        ft._window_loss = real
        # a restarted job starts when every old process is gone: rank 0's interrupted run has
        # joined its checkpoint writer by then. Without this, rank 1 could resume from the
        # checkpoint before the one rank 0's writer was still putting in place, and the two
        # ranks resumed at different steps and waited on each other for ever (seen once in CI)
        torch.distributed.barrier()
        if rank == 0:
            meta = json.loads(open(f"{out}/checkpoint.json").read())
            with open(f"{out}/killed.json", "w") as f:
                json.dump([meta["epoch"], meta["step_in_epoch"]], f)
    _, state = ft.finetune(cfg, train, dev, log=None)
    if rank == 0:
        with open(f"{out}/rank0_log.json", "w") as f:
            json.dump(state["log"], f)
    _leave()


def test_ddp_finetune_killed_mid_epoch_resumes_with_the_epoch_loss_counted_once(tmp_path,
                                                                                tiny_encoder):
    """Stopped in epoch 2's third step, the job resumes from rank 0's checkpoint after its
    second step (the steps before it, summed over both ranks, counted once in the epoch loss)
    and ends with the log and weights of an uninterrupted job."""
    runs = {}
    for name, kill_at in (("whole", None), ("cut", 7)):
        out = tmp_path / name
        mp.spawn(_killed_worker, args=(free_port(), tiny_encoder, str(out), kill_at),
                 nprocs=WORLD, join=True)
        runs[name] = json.loads((out / "rank0_log.json").read_text())
    assert json.loads((tmp_path / "cut" / "killed.json").read_text()) == [1, 2]
    whole, cut = runs["whole"], runs["cut"]
    assert [r["epoch"] for r in cut] == [1, 2]
    for a, b in zip(whole, cut):
        assert abs(a["loss"] - b["loss"]) <= 1e-9 * a["loss"], (a["loss"], b["loss"])
        assert a["dev_qwk"] == b["dev_qwk"]
    names = [json.loads((tmp_path / n / "checkpoint.json").read_text())["tensors"] for n in runs]
    a, b = (load_file(tmp_path / n / f) for n, f in zip(runs, names))
    assert names[0] == names[1] == "checkpoint-8.safetensors"
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-7, msg=k)


def _command_worker(rank: int, port: int, encoder: str, data: str, out: str) -> None:
    """``mhmla-train aes --finetune`` as torchrun starts it on each rank; what the rank
    printed and its exit status go to ``rank<k>.json``."""
    import contextlib
    import io

    from mhmla_fast.commands import aes_finetune
    from mhmla_fast.commands.train import main as mhmla_train

    _env(rank, port)
    scored = []
    real = aes_finetune._cell_predictions
    aes_finetune._cell_predictions = lambda *a, **kw: scored.append(1) or real(*a, **kw)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = mhmla_train(["aes", "--prompt", "3", "--fold", "0", "--data-dir", data, "--encoder",
                          encoder, "--out", out, "--finetune", "--epochs", "1", "--backend",
                          "torch", "--quiet", "--batch-size", "4", "--num-heads", "4"])
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump({"rc": rc, "stdout": printed.getvalue(), "scored": len(scored)}, f)
    _leave()


def test_ddp_finetune_command_scores_and_writes_on_the_first_rank_only(tmp_path, tiny_encoder):
    """Every rank trains the cell (data-parallel); the test and dev predictions, test.json and
    the results file are the first rank's alone (before, each rank scored the cell again and
    wrote both files, its 'wrote' line printed once per rank)."""
    from test_aes_train import write_asap

    data = write_asap(tmp_path / "data", n_per_prompt=20)
    out = tmp_path / "ft"
    out.mkdir()
    mp.spawn(_command_worker, args=(free_port(), tiny_encoder, str(data), str(out)),
             nprocs=WORLD, join=True)
    ranks = [json.loads((out / f"rank{k}.json").read_text()) for k in range(WORLD)]
    assert [r["rc"] for r in ranks] == [0] * WORLD
    assert ranks[0]["scored"] == 1 and "wrote" in ranks[0]["stdout"]
    assert all(r["scored"] == 0 and "wrote" not in r["stdout"] for r in ranks[1:])
    (entry,) = json.loads((out / "results-finetune.json").read_text())["models"].values()
    assert set(entry["qwk"]["0"]) == {"3"}
