"""``encoder.host_checked_mask``: the attention mask an encoder gets when the caller saw its
padding on the host, so that the encoder does not read the device to find out."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from mhmla_fast.encoder import host_checked_mask


def _encoder(kind: str, attention: str):
    from transformers import BertConfig, BertModel, MPNetConfig, MPNetModel

    config, model = (BertConfig, BertModel) if kind == "bert" else (MPNetConfig, MPNetModel)
    torch.manual_seed(0)
    return model(config(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64,
                        attn_implementation=attention)).eval()


class DeviceReads(TorchFunctionMode):
    """Counts calls that read a tensor's value into Python (``bool``, ``item``, ...): on CUDA
    each waits for the work queued before it."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in ("__bool__", "item", "tolist", "__int__", "__float__", "__index__"):
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind, attention", [("bert", "sdpa"), ("bert", "eager"),
                                             ("mpnet", "eager")])
def test_the_encoder_gives_the_same_states_bit_for_bit_without_reading_the_mask(kind, attention):
    encoder = _encoder(kind, attention)
    ids = torch.randint(3, 100, (5, 9))
    padded = torch.ones_like(ids)
    padded[1, 6:] = 0
    padded[3, 2:] = 0
    for mask in (padded, torch.ones_like(ids)):
        dense = bool(mask.numpy().all())  # what the caller sees on the host
        with torch.inference_mode():
            want = encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True)
            with DeviceReads() as spy:
                got = encoder(input_ids=ids, output_hidden_states=True,
                              attention_mask=host_checked_mask(encoder, mask, dense))
        assert all(torch.equal(a, b) for a, b in zip(want.hidden_states, got.hidden_states))
        assert spy.reads == [], spy.reads
        if not dense:  # and the plain [B, T] mask does read it (BERT's SDPA all-ones check)
            with torch.inference_mode(), DeviceReads() as spy:
                encoder(input_ids=ids, attention_mask=mask)
            assert spy.reads or attention == "eager"


def test_a_runner_pass_reads_nothing_back_but_its_output():
    """The torch runner's pass over a padded and a dense batch reads no tensor value into
    Python before its output (the shipped tagger on the CPU; labels as before)."""
    from mhmla_fast.serve.engine import default_tagger_path
    from mhmla_fast.serve.runners import TorchRunner

    runner = TorchRunner(default_tagger_path(), device="cpu", dtype="float32", kernels="torch")
    rng = np.random.default_rng(0)
    ids = rng.integers(1000, 20000, (4, 12)).astype(np.int64)
    for mask in (np.ones_like(ids), (np.arange(12) < np.array([[12], [7], [3], [12]])).astype(np.int64)):
        with torch.inference_mode():
            want = runner._probs(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
        with DeviceReads() as spy:
            got = runner(ids, mask)
        assert spy.reads == [] and np.array_equal(got, want)
