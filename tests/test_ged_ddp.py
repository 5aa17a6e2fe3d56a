"""GED training under torchrun's environment with 2 gloo processes on the CPU: each rank's
share of a global batch, gradients equal to one process's on the same global batch (the fused
head, under the Triton interpreter), and a whole run (rank 0 writes; resume is exact)."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from mhmla_fast.distributed import shard
from mhmla_fast.ged.model import GedTagger, TaggerConfig, load_tokenizer
from mhmla_fast.ged.train import TrainConfig, train

from test_ged_train import tiny_encoder, write_fce  # noqa: E402,F401 - the same encoder and data

HAS_TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
WORLD = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)


def _leave() -> None:
    """Leave the process group together: a rank that tears its group down while another is
    still working (writing its files) can abort in gloo ("terminate called without an active
    exception", seen in a full test run)."""
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def test_shard_deals_each_global_batch_out_by_length():
    lengths = [5, 9, 3, 7, 7, 1, 12]
    batch = [0, 1, 2, 3, 4, 5, 6]
    parts = [shard(batch, lengths, r, 3) for r in range(3)]
    assert sorted(i for p in parts for i in p) == batch  # every sentence once
    assert [len(p) for p in parts] == [3, 2, 2]  # equal work, one more at most
    assert parts[0] == [5, 3, 6]  # by length (1, 3, 5, 7, 7, 9, 12): every third from the first
    assert shard([4], lengths, 1, 2) == []  # fewer sentences than ranks


# ------------------------------------------------------------- gradients of one global batch


def _model(encoder: str, backend: str) -> GedTagger:
    """The same tagger in every process; eval mode: no dropout anywhere (encoder included), so
    the two computations of the gradients can be compared."""
    torch.manual_seed(0)
    model = GedTagger(TaggerConfig(encoder=encoder, num_heads=4, dropout=0.0), backend=backend)
    return model.eval()


def _batch_data(encoder: str):
    from mhmla_fast.ged.model import encode_sentences

    tok = load_tokenizer(encoder)
    words = "the a cat dog house school every day he she they we go goes went".split()
    sents = [[words[(7 * i + j) % len(words)] for j in range(3 + i % 5)] for i in range(7)]
    labels = [[(i + j) % 3 == 0 for j in range(len(s))] for i, s in enumerate(sents)]
    encoded = encode_sentences(tok, sents, 32)
    return encoded, [[int(x) for x in lab] for lab in labels], [len(ids) for ids, _ in encoded], tok


def _ddp_grads_worker(rank: int, port: int, encoder: str, out: str) -> None:
    from torch.nn.parallel import DistributedDataParallel

    from mhmla_fast.distributed import init_distributed
    from mhmla_fast.ged.model import PackedSentences
    from mhmla_fast.ged.train import _distributed_step

    _env(rank, port)
    ctx = init_distributed("cpu")
    model = _model(encoder, "triton")
    net = DistributedDataParallel(model)
    encoded, labels, lengths, tok = _batch_data(encoder)
    loss = _distributed_step(net, ctx, list(range(7)), PackedSentences(encoded, tok.pad_token_id,
                                                                       labels),
                             lengths, torch.device("cpu"), torch.autocast("cpu", enabled=False))
    if rank == 0:
        grads = {n: p.grad.contiguous() for n, p in model.named_parameters() if p.grad is not None}
        save_file({**grads, "_loss": torch.tensor([loss])}, out)
    _leave()


@pytest.mark.skipif(not HAS_TRITON, reason="the fused head needs CUDA or TRITON_INTERPRET=1")
def test_ddp_gradients_equal_one_process_on_the_global_batch(tmp_path, tiny_encoder):
    import torch.nn.functional as F

    from mhmla_fast.ged.model import IGNORE, collate

    out = str(tmp_path / "ddp_grads.safetensors")
    mp.spawn(_ddp_grads_worker, args=(free_port(), tiny_encoder, out), nprocs=WORLD, join=True)
    ddp = load_file(out)

    model = _model(tiny_encoder, "triton")
    encoded, labels, _, tok = _batch_data(tiny_encoder)
    batch = collate(encoded, tok.pad_token_id, labels)  # the whole global batch in one process
    logits = model(batch["input_ids"], batch["attention_mask"])
    loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE)
    loss.backward()
    assert ddp["_loss"].item() == pytest.approx(loss.item(), rel=1e-5)
    named = dict(model.named_parameters())
    assert {n for n, p in named.items() if p.grad is not None} == set(ddp) - {"_loss"}
    for name, grad in ddp.items():
        if name != "_loss":
            torch.testing.assert_close(grad, named[name].grad, rtol=1e-4, atol=1e-6,
                                       msg=lambda m, n=name: f"{n}: {m}")
    assert named["head.w_k"].grad.abs().sum() > 0  # the fused head's backward took part


# ---------------------------------------------------------------------------- a whole run


def _train_worker(rank: int, port: int, cfg_json: str, stop: int | None) -> None:
    _env(rank, port)
    cfg = TrainConfig(**json.loads(cfg_json))
    train(cfg, stop_after_steps=stop)
    if torch.distributed.is_initialized():  # (stop_after_steps returns without a barrier)
        _leave()


def _run(cfg: dict, stop: int | None = None) -> None:
    mp.spawn(_train_worker, args=(free_port(), json.dumps(cfg), stop), nprocs=WORLD, join=True)


def test_ddp_run_writes_once_and_resumes_exactly(tmp_path, tiny_encoder):
    base = dict(train=str(write_fce(tmp_path / "train.tsv", 48, 0)),
                dev=str(write_fce(tmp_path / "dev.tsv", 16, 1)), encoder=tiny_encoder,
                num_heads=4, epochs=2, batch_size=8, lr=2e-3, max_length=32, seed=3,
                checkpoint_every=1000, progress=False, backend="torch")
    full = {**base, "out": str(tmp_path / "full")}
    _run(full)
    log = json.loads((tmp_path / "full" / "log.json").read_text())
    assert [r["epoch"] for r in log] == [1, 2]
    assert json.loads((tmp_path / "full" / "best" / "config.json").read_text())["threshold"] is not None

    resumed = {**base, "out": str(tmp_path / "resumed")}
    _run(resumed, stop=4)  # 6 steps per epoch: stops in epoch 1, right after a checkpoint
    assert not (tmp_path / "resumed" / "log.json").exists()
    _run(resumed)
    a = load_file(tmp_path / "full" / "best" / "model.safetensors")
    b = load_file(tmp_path / "resumed" / "best" / "model.safetensors")
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs after resume under DDP"
    # one process may not take over a checkpoint written by two
    with pytest.raises(ValueError, match=r"written by 2 process\(es\), this run has 1"):
        train(TrainConfig(**{**resumed, "epochs": 3}))
