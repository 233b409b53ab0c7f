"""flashedu.profiling: the devices, the harness's arguments, the per-operator profile and the peak
memory it reads from the profiler's allocation events."""

from __future__ import annotations

import math

import pytest
import torch

from flashedu import profiling, torch_tiled

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _naive(q, k, v):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, N, N)
    return torch.softmax(s, dim=-1) @ v


def _qkv(N=256, d=32, H=2):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, H, N, d, generator=g) for _ in range(3)]


def test_cpu_device_reads_a_clock_that_advances_and_has_nothing_to_wait_for():
    dev = profiling.device("cpu")
    assert isinstance(dev, profiling.CPUDevice) and not dev.is_gpu
    t0 = dev.clock()
    dev.synchronize()
    dev.flush_l2()
    assert dev.clock() >= t0


def test_auto_device_matches_what_torch_sees():
    assert profiling.device("auto").is_gpu == torch.cuda.is_available()


def test_device_names_a_bad_kind():
    with pytest.raises(ValueError, match="kind must be 'auto', 'cpu' or 'cuda', got 'tpu'"):
        profiling.device("tpu")


@pytest.mark.parametrize(
    "kwargs,words",
    [
        ({"warmup": -1}, "warmup must be an int >= 0, got -1"),
        ({"repeats": 0}, "repeats must be an int >= 1, got 0"),
        ({"repeats": 2.5}, "repeats must be an int >= 1, got 2.5"),
        ({"warmup": True}, "warmup must be an int >= 0, got True"),
    ],
)
def test_time_ms_names_bad_counts(kwargs, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        profiling.time_ms(lambda: None, profiling.CPUDevice(), **kwargs)


def test_time_ms_calls_warmup_plus_repeats_times_on_the_cpu():
    calls = []
    ms = profiling.time_ms(lambda: calls.append(1), profiling.CPUDevice(), warmup=2, repeats=5)
    assert len(calls) == 7 and ms >= 0


def test_op_rows_count_the_operators_and_their_memory():
    q, k, v = _qkv()
    rows = {r.name: r for r in profiling.op_rows(profiling.profile_ops(lambda: _naive(q, k, v)))}
    assert rows["aten::bmm"].calls == 2  # Q K^T and P V
    assert rows["aten::_softmax"].self_bytes == 2 * 256 * 256 * 4  # P: (1, 2, N, N) float32
    table = profiling.op_table(list(rows.values()), by="memory", times=False)
    assert table.splitlines()[0].split() == ["operator", "calls", "allocated", "per", "call"]
    bmm = next(line for line in table.splitlines() if line.startswith("aten::bmm"))
    assert bmm.split()[1:] == ["2", "576.00", "KiB", "288.00", "KiB"]  # S 512 KiB, then O 64 KiB
    assert "ms" not in table


def test_op_table_names_a_bad_order():
    with pytest.raises(ValueError, match="by must be 'time' or 'memory'"):
        profiling.op_table([], by="calls")


def test_peak_memory_of_naive_holds_s_and_p_and_tiled_holds_tiles():
    q, k, v = _qkv(N=512)
    nn = 2 * 512 * 512 * 4  # one (1, 2, N, N) float32 matrix
    naive_peak = profiling.peak_bytes(lambda: _naive(q, k, v))
    assert 2 * nn <= naive_peak < 3 * nn  # S and P live together, plus O
    assert profiling.largest_allocation(lambda: _naive(q, k, v)) == nn
    tiled = profiling.largest_allocation(lambda: torch_tiled.forward(q, k, v, block_m=64))
    assert tiled < nn / 4  # blocks of 64 query rows, never a whole N x N matrix


def test_profiling_keeps_the_profilers_native_lines_off_stderr(capfd):
    profiling.profile_ops(lambda: torch.ones(3) + 1)
    assert "profiler_start" not in capfd.readouterr().err


def test_snapshot_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(RuntimeError, match="no CUDA device"):
        profiling.cuda_memory_snapshot(lambda: None, "unused.pickle")


@pytest.mark.gpu
@cuda
def test_cuda_device_times_a_kernel_and_the_snapshot_is_written(tmp_path):
    dev = profiling.device("cuda")
    x = torch.randn(4096, 4096, device="cuda")
    ms = profiling.time_ms(lambda: x @ x, dev, warmup=3, repeats=5)
    assert ms > 0.01  # a 4096^3 matmul is not a launch
    path = tmp_path / "snapshot.pickle"
    peak = profiling.cuda_memory_snapshot(lambda: x @ x, str(path))
    assert path.stat().st_size > 0 and peak >= 4096 * 4096 * 4
