"""truncate_at_stop: the C++ (and, on a GPU, CUDA) op against the PyTorch reference."""
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastppo.kernels.masking import extension_backend, truncate_at_stop, truncate_at_stop_reference

REPO = Path(__file__).resolve().parent.parent
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def assert_same(got, want):
    names = ("truncated", "lengths", "mask", "has_stop")
    for name, g, w in zip(names, got, want):
        assert g.dtype == w.dtype, name
        torch.testing.assert_close(g, w, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def random_responses(B, T, vocab, dtype, device, stop_rate=0.05, stop_ids=(2,)):
    """Random ids avoiding the stop ids, then stop ids sprinkled at ``stop_rate``."""
    x = torch.randint(len(stop_ids) + 3, vocab, (B, T), dtype=dtype)
    sprinkle = torch.rand(B, T) < stop_rate
    choice = torch.tensor(stop_ids, dtype=dtype)[torch.randint(len(stop_ids), (B, T))]
    return torch.where(sprinkle, choice, x).to(device)


def test_backend_is_compiled():
    # After `pip install --no-build-isolation .` the ahead-of-time binary is there.
    assert extension_backend() in ("aot", "jit")
    assert callable(torch.ops.fastppo.truncate_at_stop)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("B,T", [(0, 5), (1, 1), (1, 7), (3, 1), (7, 33), (64, 257)])
@pytest.mark.parametrize("stop_ids", [(2,), (2, 3), (4, 2, 3)])
def test_matches_reference(device, dtype, B, T, stop_ids):
    x = random_responses(B, T, 50, dtype, device, stop_rate=0.1, stop_ids=stop_ids)
    assert_same(truncate_at_stop(x, list(stop_ids), 0), truncate_at_stop_reference(x, list(stop_ids), 0))


@pytest.mark.parametrize("device", DEVICES)
def test_edge_rows(device):
    T, pad = 6, 1
    x = torch.tensor(
        [
            [9, 9, 9, 9, 9, 9],  # no stop token: everything kept
            [5, 9, 9, 5, 9, 9],  # stop at position 0
            [9, 9, 9, 9, 9, 5],  # stop at the last position
            [9, 7, 9, 5, 9, 9],  # second stop id comes first
        ],
        device=device,
    )
    truncated, lengths, mask, has_stop = truncate_at_stop(x, [5, 7], pad)
    assert lengths.tolist() == [T, 1, T, 2]
    assert has_stop.tolist() == [False, True, True, True]
    assert truncated[0].tolist() == [9] * T
    assert truncated[1].tolist() == [5] + [pad] * 5
    assert truncated[2].tolist() == x[2].tolist()
    assert truncated[3].tolist() == [9, 7] + [pad] * 4
    assert mask.sum(1).tolist() == lengths.tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_and_tensor_stop_ids(device):
    base = random_responses(16, 40, 30, torch.int64, device, stop_rate=0.1)
    x = base.t().contiguous().t()[:, ::2]  # strided view
    assert not x.is_contiguous()
    stops = torch.tensor([2], device=device)
    assert_same(truncate_at_stop(x, stops, 0), truncate_at_stop_reference(x.contiguous(), 2, 0))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_outputs_past_the_huge_page_threshold(dtype):
    # Outputs of 8 MiB and more take the huge-page allocation path of the CPU op.
    x = random_responses(1024, 2048, 1000, dtype, "cpu", stop_rate=0.001)
    got = truncate_at_stop(x, [2, 3], 1)
    assert_same(got, truncate_at_stop_reference(x, [2, 3], 1))
    got[0].add_(1)  # the outputs are ordinary writable tensors
    del got


def test_stop_ids_outside_int32_never_match():
    x = random_responses(4, 9, 20, torch.int32, "cpu", stop_rate=0.3)
    assert_same(truncate_at_stop(x, [2, 2**40], 0), truncate_at_stop_reference(x, [2, 2**40], 0))


def test_large_cpu_batch_uses_all_rows():
    # Many rows exercise the at::parallel_for split across threads.
    x = random_responses(1000, 64, 100, torch.int64, "cpu", stop_rate=0.02)
    assert_same(truncate_at_stop(x, 2, 0), truncate_at_stop_reference(x, 2, 0))


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=24), min_size=1, max_size=8),
    stop_ids=st.lists(st.integers(0, 6), min_size=1, max_size=3),
    pad_id=st.integers(0, 9),
    use_int32=st.booleans(),
)
def test_properties(rows, stop_ids, pad_id, use_int32):
    T = max(len(r) for r in rows)
    x = torch.tensor([r + [8] * (T - len(r)) for r in rows], dtype=torch.int32 if use_int32 else torch.int64)
    truncated, lengths, mask, has_stop = truncate_at_stop(x, stop_ids, pad_id)
    assert_same((truncated, lengths, mask, has_stop), truncate_at_stop_reference(x, stop_ids, pad_id))
    for b, row in enumerate(x.tolist()):
        hits = [t for t, tok in enumerate(row) if tok in stop_ids]
        n = hits[0] + 1 if hits else T
        assert lengths[b].item() == n and has_stop[b].item() == bool(hits)
        assert truncated[b, :n].tolist() == row[:n]  # kept prefix is untouched
        assert truncated[b, n:].tolist() == [pad_id] * (T - n)
        assert mask[b].tolist() == [True] * n + [False] * (T - n)


def test_opcheck():
    x = random_responses(5, 11, 20, torch.int64, "cpu", stop_rate=0.2)
    torch.library.opcheck(torch.ops.fastppo.truncate_at_stop.default, (x, torch.tensor([2, 3]), 0))


def test_torch_compile_fullgraph():
    x = random_responses(6, 13, 20, torch.int64, "cpu", stop_rate=0.2)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(r):
        truncated, lengths, mask, has_stop = truncate_at_stop(r, [2, 3], 0)
        return truncated * mask, lengths + 1

    truncated, lengths, mask, _ = truncate_at_stop_reference(x, [2, 3], 0)
    got = f(x)
    torch.testing.assert_close(got[0], truncated * mask)
    torch.testing.assert_close(got[1], lengths + 1)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(responses=torch.zeros(4, dtype=torch.long) + 3), ValueError, "responses must be 2-D"),
        (dict(responses=torch.rand(2, 4)), TypeError, "responses must hold integer"),
        (dict(responses=torch.ones(2, 4, dtype=torch.int16)), TypeError, "responses must have dtype"),
        (dict(responses=[[1, 2]]), TypeError, "responses must be a torch.Tensor"),
        (dict(stop_ids=[]), ValueError, "stop_ids must name at least one"),
        (dict(stop_ids=torch.tensor([], dtype=torch.long)), ValueError, "stop_ids must name at least one"),
        (dict(stop_ids=2.0), TypeError, "stop_ids must be"),
        (dict(stop_ids=torch.tensor([2.0])), TypeError, "stop_ids must hold integer"),
        (dict(stop_ids=torch.tensor([2], device="meta")), ValueError, "stop_ids is on meta"),
        (dict(pad_id=-1), ValueError, "pad_id must be a token id in \\[0, 2\\*\\*63\\)"),
        (dict(pad_id=1.5), TypeError, "pad_id must be an int"),
        (dict(responses=torch.ones(2, 4, dtype=torch.int32), pad_id=2**31), ValueError, "does not fit in int32"),
    ],
)
@pytest.mark.parametrize("fn", [truncate_at_stop, truncate_at_stop_reference])
def test_bad_input(fn, kwargs, error, match):
    args = dict(responses=torch.randint(3, 9, (2, 4)), stop_ids=[2], pad_id=0) | kwargs
    with pytest.raises(error, match=match):
        fn(**args)


def test_op_itself_checks_arguments():
    # Called directly, bypassing the Python wrapper, the C++ op still refuses bad input. The op is registered on
    # first use: load it here, so the test does not depend on an earlier test (in its process) having done so.
    extension_backend()
    with pytest.raises(RuntimeError, match="pad_id must be >= 0"):
        torch.ops.fastppo.truncate_at_stop(torch.ones(2, 3, dtype=torch.long), torch.tensor([1]), -2)
    with pytest.raises(RuntimeError, match="responses must be 2-D"):
        torch.ops.fastppo.truncate_at_stop(torch.ones(3, dtype=torch.long), torch.tensor([1]), 0)


_STATIC_PROBE = """
import sys, torch
from torch.utils.cpp_extension import load
load(name="fastppo_static_libstdcxx", sources=[sys.argv[1]], extra_cflags=["-O1", "-std=c++17"],
     extra_ldflags=["-static-libstdc++"], build_directory=sys.argv[2], is_python_module=False)
op = torch.ops.fastppo.truncate_at_stop
for args in [(torch.ones(2, 3, dtype=torch.long), torch.tensor([1]), -2),
             (torch.ones(2, 3, dtype=torch.int32), torch.tensor([1]), 2**31),
             (torch.ones(3, 2, 2, dtype=torch.long), torch.tensor([1]), 0),
             (torch.ones(2, 3), torch.tensor([1]), 0)]:
    try:
        op(*args)
    except RuntimeError as e:
        print(str(e).splitlines()[0])
"""


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler")
def test_op_messages_survive_a_statically_linked_libstdcxx(tmp_path):
    # The GPU image's toolchain links libstdc++ into the extension statically. That copy's locale is never set up,
    # so numbers streamed into a message came out empty here and crashed the process on an H200 (issue 37). The
    # op is built that way in a fresh process (its TORCH_LIBRARY must not meet the one already loaded here).
    source = os.path.join(os.path.dirname(__file__), os.pardir, "csrc", "truncate_at_stop.cpp")
    proc = subprocess.run([sys.executable, "-c", _STATIC_PROBE, source, str(tmp_path)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [
        "pad_id must be >= 0, got -2",
        "pad_id 2147483648 does not fit in int32 responses",
        "responses must be 2-D [B, T], got 3-D",
        "responses must be int32 or int64, got Float",
    ]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_cuda_source_compiles(tmp_path):
    # No GPU in CI, but a CUDA syntax or type error must still fail the build.
    from torch.utils.cpp_extension import include_paths

    # CPU wheels of torch ship c10/cuda headers but not this CMake-generated one; its
    # whole content in a CUDA build is the one define below.
    macros = tmp_path / "include" / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    macros.parent.mkdir(parents=True)
    macros.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    includes = [f"-I{p}" for p in include_paths()] + [f"-I{REPO / 'csrc'}", f"-I{tmp_path / 'include'}"]
    py_include = subprocess.check_output([sys.executable, "-c", "import sysconfig; print(sysconfig.get_paths()['include'])"], text=True).strip()
    cmd = ["nvcc", "-c", str(REPO / "csrc" / "truncate_at_stop_cuda.cu"), "-o", str(tmp_path / "k.o"), "-std=c++17",
           "-O2", "--expt-relaxed-constexpr", f"-I{py_include}", "-D_GLIBCXX_USE_CXX11_ABI=1", *includes]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "k.o").stat().st_size > 0


def _run_isolated(tmp_path, env_extra):
    """Run a fresh interpreter on a copy of the package that has no prebuilt binary."""
    pkg = tmp_path / "src"
    shutil.copytree(REPO / "fastppo", pkg / "fastppo", ignore=shutil.ignore_patterns("_C*.so", "__pycache__"))
    shutil.copytree(REPO / "csrc", pkg / "csrc")
    script = textwrap.dedent(
        """
        import sys
        # An editable install's import hook would find the source tree's binary first.
        sys.meta_path = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")]
        import warnings, torch
        warnings.simplefilter("always")
        from fastppo.kernels import extension_backend, truncate_at_stop, truncate_at_stop_reference
        x = torch.randint(0, 9, (4, 10))
        got = truncate_at_stop(x, [3, 4], 0)
        want = truncate_at_stop_reference(x, [3, 4], 0)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        print("BACKEND", extension_backend(), torch.ops.fastppo.truncate_at_stop(x, torch.tensor([3]), 0)[1].tolist())
        """
    )
    env = {**os.environ, "PYTHONPATH": str(pkg), "XDG_CACHE_HOME": str(tmp_path / "cache"), "TRITON_INTERPRET": "0", **env_extra}
    return subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_jit_path_when_binary_missing(tmp_path):
    done = _run_isolated(tmp_path, {})
    assert done.returncode == 0, done.stderr[-4000:]
    assert "BACKEND jit" in done.stdout
    assert "compiling the C++ op" in done.stderr
    assert any((tmp_path / "cache" / "fastppo").iterdir())


def test_reference_path_when_no_compiler(tmp_path):
    done = _run_isolated(tmp_path, {"CXX": str(tmp_path / "no-such-compiler"), "PATH": os.path.dirname(sys.executable)})
    assert done.returncode == 0, done.stderr[-4000:]
    assert "BACKEND reference" in done.stdout
    assert "extension is unavailable" in done.stderr
