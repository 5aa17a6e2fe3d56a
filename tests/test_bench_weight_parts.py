"""bench/weight_parts.py: a model's weights split into bounded fp16 parts and merged back give
the original rounded to fp16, exactly; a missing part is an error naming the count; and
gpu_issue11.sh puts such parts on the device one call at a time."""

from __future__ import annotations

import json
import os

import pytest
import torch

from bench_scripts import load_bench_script


def test_split_then_merge_gives_the_fp16_rounded_weights(tmp_path):
    wp = load_bench_script("weight_parts")
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    state = {"embeddings.word": torch.randn(1000, 48),  # 96 KB in fp16: cut into row blocks
             "layer.0.weight": torch.randn(48, 48), "layer.0.bias": torch.randn(48),
             "position_ids": torch.arange(64).unsqueeze(0), "scalar": torch.tensor(0.5)}
    src = tmp_path / "model"
    src.mkdir()
    save_file(state, str(src / "model.safetensors"))
    (src / "config.json").write_text('{"model_type": "bert"}')
    (src / "pytorch_model.bin").write_bytes(b"not copied")
    limit_mb = 40_000 / 2**20
    folders = wp.split(src, tmp_path / "parts", limit_mb)
    assert len(folders) > 2
    for f in folders:  # every part within the limit
        assert (f / f"part-{f.name}.safetensors").stat().st_size <= 40_000 + 2_000  # + header
    names = [n for f in folders for n in load_file(str(f / f"part-{f.name}.safetensors"))]
    assert sum(n.startswith("embeddings.word@") for n in names) > 1
    first = tmp_path / "parts" / "1"
    assert json.loads((first / "parts.json").read_text()) == {"parts": len(folders), "tensors": 5}
    assert sorted(p.name for p in (first / "model").iterdir()) == ["config.json"]

    root = tmp_path / "device"
    (root / "model").mkdir(parents=True)
    (root / "parts.json").write_text((first / "parts.json").read_text())
    for f in folders[:-1]:
        (root / f"part-{f.name}.safetensors").write_bytes((f / f"part-{f.name}.safetensors").read_bytes())
    with pytest.raises(ValueError, match=f"{len(folders) - 1} of {len(folders)} parts"):
        wp.merge(root)
    last = folders[-1]
    (root / f"part-{last.name}.safetensors").write_bytes((last / f"part-{last.name}.safetensors").read_bytes())
    merged = load_file(str(wp.merge(root)))
    assert merged.keys() == state.keys() and not list(root.glob("part-*"))
    for k, v in state.items():
        want = v.half().float() if v.is_floating_point() else v
        assert merged[k].dtype == want.dtype and torch.equal(merged[k], want), k


def test_merge_refuses_a_wrong_tensor_count():
    wp = load_bench_script("weight_parts")
    with pytest.raises(ValueError, match="1 tensors rebuilt, 2 expected"):
        wp.merge_state([{"a": torch.zeros(2)}], expected=2)


def test_gpu_issue11_puts_minilm_parts_one_call_at_a_time(tmp_path):
    """``gpu_issue11.sh real-put`` as the device runs it: each call's tree holds only the part it
    carries; part 1 starts the device folder afresh, later parts add to it, a later part on a
    cold machine (no part 1 there) stops with exit 3; the parts then merge to the model."""
    import shutil
    import subprocess

    from bench_scripts import BENCH

    wp = load_bench_script("weight_parts")
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    state = {"embeddings.word_embeddings.weight": torch.randn(600, 32),  # row blocks
             "pooler.weight": torch.randn(32, 32)}
    src = tmp_path / "minilm"
    src.mkdir()
    save_file(state, str(src / "model.safetensors"))
    (src / "config.json").write_text('{"model_type": "bert"}')
    folders = wp.split(src, tmp_path / "parts", 20_000 / 2**20)
    assert len(folders) >= 3
    tree = tmp_path / "tree"
    (tree / "bench").mkdir(parents=True)
    for name in ("gpu_issue11.sh", "travel.sh", "weight_parts.py"):
        shutil.copy(BENCH / name, tree / "bench" / name)

    def put(part, real):  # one device call carrying .gpu/real/<part>
        shutil.rmtree(tree / ".gpu", ignore_errors=True)
        shutil.copytree(part, tree / ".gpu" / "real" / part.name)
        return subprocess.run(["bash", "bench/gpu_issue11.sh", "real-put"], cwd=tree, text=True,
                              capture_output=True, env={**os.environ, "MHMLA_REAL_DIR": str(real)})

    real = tmp_path / "device"
    for k, part in enumerate(folders, 1):
        done = put(part, real)
        assert done.returncode == 0, done.stderr
        assert f"MiniLM: {k} of {len(folders)} parts here" in done.stdout
    assert (real / "model" / "config.json").is_file()
    merged = load_file(str(wp.merge(real)))
    assert all(torch.equal(merged[k], v.half().float()) for k, v in state.items())

    cold = put(folders[1], tmp_path / "cold")
    assert cold.returncode == 3 and "part 1 is not here" in cold.stderr


def test_row_blocks_fill_each_part():
    """A large tensor's row blocks fill the room each part has left, so the parts are as few
    as the bytes allow (half-part blocks would take 4 parts here, not 3); a row larger than a
    part is an error."""
    wp = load_bench_script("weight_parts")
    state = {"small": torch.zeros(10, 100), "big": torch.zeros(1000, 10)}  # 2,000 + 20,000 B in fp16
    parts = wp.split_state(state, 8000)
    sizes = [sum(t.numel() * t.element_size() for _, t in part) for part in parts]
    assert sizes == [8000, 8000, 6000]
    assert [n for n, _ in parts[0]] == ["small", "big@0"]
    with pytest.raises(ValueError, match="big: one row"):
        wp.split_state({"big": torch.zeros(4, 5000)}, 8000)
    # tensors under half a part are cut too where they do not fit: five of 3,000 B make two
    # parts, not three (whole tensors only: 6,000 + 6,000 + 3,000)
    state = {f"m{i}": torch.full((15, 100), float(i)) for i in range(5)}
    parts = wp.split_state(state, 8000)
    assert [sum(t.numel() * t.element_size() for _, t in part) for part in parts] == [8000, 7000]
    assert [n for n, _ in parts[0]] == ["m0", "m1", "m2@0"] and [n for n, _ in parts[1]][:2] == ["m2@10", "m3"]
    merged = wp.merge_state([dict(p) for p in parts], 5)
    assert all(torch.equal(merged[k], v) for k, v in state.items())
    # only a sliver of room left (under an eighth of a part): the next tensor starts a part
    parts = wp.split_state({"a": torch.zeros(3600), "b": torch.zeros(15, 100)}, 8000)
    assert [[n for n, _ in part] for part in parts] == [["a"], ["b"]]
    # a scalar is never cut
    parts = wp.split_state({"a": torch.zeros(4000), "s": torch.tensor(1.0)}, 8000)
    assert [[n for n, _ in part] for part in parts] == [["a"], ["s"]]
