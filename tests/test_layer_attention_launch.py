"""The fused kernels' launch path on a GPU (``_launch``, ``_run``), run on any CPU: each test is a
subprocess in which ``bench/triton_launch_host_cpu.py``'s stand-in for the CUDA driver reports
an sm_90 target (kernels compile for real, the final C launcher is replaced), since the stand-in
replaces Triton's driver process-wide."""

from __future__ import annotations

import os
import subprocess
import sys

from bench_scripts import BENCH


def _run_script(script: str, **extra_env: str) -> list[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "MHMLA_TRITON_CONFIGS")}
    env.update(extra_env)
    res = subprocess.run([sys.executable, "-c", script, str(BENCH)], env=env, timeout=600,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout.split()


_CLASSES_DECIDE = r'''
import itertools, sys
sys.path.insert(0, sys.argv[1])
from triton_launch_host_cpu import _mock_driver
_mock_driver()
import torch
import mhmla_fast.kernels.layer_attention as K

kernel = K._layer_attention_bwd_softmax_kernel
binder = kernel.create_binder()[-1]
base = torch.zeros(64)
tensors = [base, base[1:], base[4:], base.half(), base.half()[8:], base.double()[2:]]
ints = [0, 1, 2, 15, 16, 17, 32, 48, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, 2**32,
        2**63 - 16, 2**63 - 1, 2**63, 2**64 - 16, -1, -16, -(2**31), -(2**31) - 16]
seen = {}
cases = 0
for ts in itertools.product(tensors, repeat=2):
    for n in ints:
        for args in ((*ts, ts[0], ts[1], n, 7, 12, 16), (*ts, ts[1], ts[0], 3, n, n, 1)):
            _, spec, _ = binder(*args, BLOCK_J=16, BLOCK_N=64)
            classes = K._arg_classes(args)
            assert seen.setdefault(classes, spec) == spec, (args, classes, spec, seen[classes])
            cases += 1
print("cases", cases, "classes", len(seen))
'''


def test_argument_classes_decide_the_jit_specialisation():
    """Equal ``_arg_classes``, equal specialisation by Triton's own binder (tensors of three
    dtypes at aligned and unaligned addresses; ints around 1, multiples of 16 and the 32- and
    64-bit limits, signed and not): the compiled kernel a launch reuses is the one the JIT
    would pick for its arguments."""
    out = _run_script(_CLASSES_DECIDE)
    assert out[0] == "cases" and int(out[1]) == 6 * 6 * 21 * 2
    assert int(out[3]) > 50  # the classes do tell the specialisations apart


_SAME_LAUNCHES = r'''
import os, sys
sys.path.insert(0, sys.argv[1])
from triton_launch_host_cpu import _mock_driver
_mock_driver()
import torch
from triton.compiler.compiler import CompiledKernel
from triton.runtime.jit import JITFunction
import mhmla_fast.kernels.layer_attention as K

launches = []


def record(kernel):
    def run(g0, g1, g2, stream, function, packed, metadata, enter, exit_, *args):
        given = passed.pop() if passed else None
        if not any(isinstance(a, torch.Tensor) for a in args):
            # a direct launch: each tensor as its address; recorded as the tensor it came from
            assert all(a == t.data_ptr() if isinstance(t, torch.Tensor) else a == t
                       for t, a in zip(given, args)), (given, args)
            args = (*given, *args[len(given):])
            addressed.append(kernel)
        launches.append((id(kernel), (g0, g1, g2), tuple(
            (tuple(a.shape), a.dtype, a.stride()) if isinstance(a, torch.Tensor) else a
            for a in args)))
    return run


passed = []  # the positional arguments of a direct launch, before their conversion
addressed = []  # launches whose tensors came as addresses
launch_args = K._launch_args


def converted(args):
    passed[:] = [args]
    return launch_args(args)


jit_runs = []
jit_run = JITFunction.run


def counted(self, *args, **kwargs):
    jit_runs.append(self)
    return jit_run(self, *args, **kwargs)


CompiledKernel.run = property(record)
JITFunction.run = counted
K._launch_args = converted
K._check_launchable = lambda t: None
L, N, H, Kd, J = 3, 40, 64, 48, 4
g = torch.Generator().manual_seed(0)
ts = [torch.randn(s, generator=g).half() for s in
      [(L, N, H), (L, H, H), (L, H), (L, H, Kd), (L, Kd), (L, Kd, J), (L, J)]]
dc = torch.randn(N, H, generator=g).half()
dropout = [(0.1, 0.1, 0.1), (0.0, 0.0, 0.0)][int(sys.argv[2])]
seed = [5]


def step():
    c, p = K.layer_attention_fwd(*ts, J, dropout, seed[0])
    K.layer_attention_bwd(dc, None, *ts, p, J, dropout, seed[0])
    K.layer_attention_dropout_masks((L, N, H), (L, N, Kd), (L, N, J), dropout, seed[0])
    out = list(launches)
    launches.clear()
    jit = len(jit_runs)
    jit_runs.clear()
    return out, jit


through_autotuner, _ = step()
with_picks, _ = step()
addressed.clear()
direct, jit = step()
assert len(addressed) == len(direct), (len(addressed), len(direct))
assert len(K._PICKS) == 4, K._PICKS
assert with_picks == through_autotuner, (with_picks, through_autotuner)
assert direct == through_autotuner, (direct, through_autotuner)
assert jit == 0, jit
seed[0] = 16 * 7  # another seed: the same compiled kernels (it is read from a tensor)
other, jit = step()
assert JIT_AGAIN == (jit > 0) and len(other) == len(direct), jit
print("same", len(direct))
'''


def test_picks_and_direct_launches_launch_what_the_autotuner_launched():
    """A fused forward + backward (fp16, dropout on) and the three dropout masks, three times:
    through the autotuner (first
    call of each key), with its picks through Triton's JIT, then with every kernel launched
    directly from the compiled kernel the JIT ran (no JIT call at all): the same compiled
    kernels, grids and arguments each time (tensors by shape, dtype and strides). Another
    seed launches the same compiled kernels directly: the kernels read it from a tensor."""
    script = _SAME_LAUNCHES.replace("sys.argv[2]", "0").replace("JIT_AGAIN", "False")
    assert _run_script(script) == ["same", "11"]


def test_direct_launches_without_dropout():
    """The same without dropout (no dropout kernels: 5 launches per forward + backward, and
    the 3 masks); a
    token count divisible by 16 goes through the JIT again."""
    out = _run_script(_SAME_LAUNCHES.replace("sys.argv[2]", "1").replace("JIT_AGAIN", "True")
                      .replace("seed[0] = 16 * 7",
                               "ts[0], dc = ts[0][:, :32].contiguous(), dc[:32]  # N = 32"))
    assert out == ["same", "8"]


_SWAPPED_FIXED = r'''
import os, sys
sys.path.insert(0, sys.argv[1])
os.environ["MHMLA_TRITON_CONFIGS"] = "fixed"
from triton_launch_host_cpu import _mock_driver
_mock_driver()
import torch
from triton.compiler.compiler import CompiledKernel
import mhmla_fast.kernels.layer_attention as K

launches = []
CompiledKernel.run = property(lambda self: (lambda g0, g1, g2, *rest: launches.append(
    (self.src.fn.__name__, self.hash, (g0, g1, g2)))))
K._check_launchable = lambda t: None
L, N, H, Kd, J = 3, 200, 64, 48, 4
ts = [torch.randn(s).half()
      for s in [(L, N, H), (L, H, H), (L, H), (L, H, Kd), (L, Kd), (L, Kd, J), (L, J)]]


def scores_launch():
    launches.clear()
    K.layer_attention_fwd(*ts, J, (0.0, 0.0, 0.0), 0)
    return [x for x in launches if "scores" in x[0]][0]


first, again = scores_launch(), scores_launch()
tiles, warps, stages = K._FIXED["fwd_scores"]
K._FIXED["fwd_scores"] = (dict(tiles, BLOCK_N=128, FLAT=True), warps, stages)
swapped = scores_launch()
assert first == again, (first, again)
assert swapped[1] != first[1] and swapped[2] == (2, L, 1), (first, swapped)
print("swapped")
'''


def test_a_swapped_fixed_config_launches_its_own_kernel():
    """With MHMLA_TRITON_CONFIGS=fixed, a fixed config swapped after launches (as tests do)
    launches the kernel compiled for the new config, with its grid, not the one kept for the
    old config."""
    assert _run_script(_SWAPPED_FIXED) == ["swapped"]


_TUNE_ONCE = r"""
import sys
sys.path.insert(0, sys.argv[1])
from triton_launch_host_cpu import _mock_driver
_mock_driver()
import torch
from triton.runtime.autotuner import Autotuner
import mhmla_fast.kernels.layer_attention as K

timed = []


def bench(self, *args, config, **kwargs):  # a made-up timing that depends on the config alone
    timed.append(config)
    t = float(sum(map(ord, str(config))) % 97)
    return [t, t, t]


Autotuner._bench = bench
K._check_launchable = lambda t: None
L, N, H, Kd, J = 3, 40, 64, 48, 4
ts = [torch.randn(s).half() for s in
      [(L, N, H), (L, H, H), (L, H), (L, H, Kd), (L, Kd), (L, Kd, J), (L, J)]]
K.layer_attention_fwd(*ts, J, (0.0, 0.0, 0.0), 0)
picks = sorted(f"{k[0]}:{sorted(v.items())}".replace(" ", "") for k, v in K._PICKS.items())
print(len(timed), *picks)
"""


def test_autotuning_is_kept_on_disk_for_the_next_process(tmp_path):
    """A forward's two kernels are autotuned (the candidates timed) in a machine's first
    process; a second process with the same Triton cache folder takes the same picks from
    disk and times nothing."""
    first = _run_script(_TUNE_ONCE, TRITON_CACHE_DIR=str(tmp_path))
    second = _run_script(_TUNE_ONCE, TRITON_CACHE_DIR=str(tmp_path))
    assert int(first[0]) > 2 and len(first) == 3, first  # several candidates, two kernels
    assert second == ["0", *first[1:]], (first, second)
    assert list(tmp_path.rglob("*.autotune.json")), "no autotuning record in the cache folder"


_PRECOMPILE = r"""
import sys, threading
sys.path.insert(0, sys.argv[1])
from triton_launch_host_cpu import _mock_driver
_mock_driver(launch_candidates=True)  # each candidate launched once by the autotuner, untimed
import torch
import triton.compiler
import mhmla_fast.kernels.layer_attention as K

compiled_in = []
tritons_compile = triton.compiler.compile


def counted(*args, **kwargs):  # what each JIT function's binder takes as its compiler
    compiled_in.append(threading.current_thread().name)
    return tritons_compile(*args, **kwargs)


triton.compiler.compile = counted
K._check_launchable = lambda t: None
L, N, H, Kd, J = 3, 40, 64, 48, 4
ts = [torch.randn(s).half() for s in
      [(L, N, H), (L, H, H), (L, H), (L, H, Kd), (L, Kd), (L, Kd, J), (L, J)]]
K.layer_attention_fwd(*ts, J, (0.0, 0.0, 0.0), 0)
pooled = sum(name.startswith("mhmla-compile") for name in compiled_in)
candidates = sum(len(K.layer_attention_configs(k, H, J)) for k in ("fwd_scores", "fwd_values"))
from mhmla_fast.devices import usable_cpus
print(usable_cpus(), candidates, pooled, len(compiled_in) - pooled)
"""


def test_a_tuning_compiles_its_candidates_in_a_thread_pool(tmp_path):
    """The first launch of a key, with nothing on disk, compiles every candidate the autotuner
    keeps in a pool of threads before the timings, which then compile nothing more; with one
    CPU there is no pool and the autotuner compiles them itself."""
    cpus, candidates, pooled, elsewhere = map(int, _run_script(_PRECOMPILE,
                                                               TRITON_CACHE_DIR=str(tmp_path)))
    assert candidates > 10
    if cpus >= 2:
        assert (pooled, elsewhere) == (candidates, 0)
    else:
        assert (pooled, elsewhere) == (0, candidates)
