"""The benchmark: it checks before it times, refuses what fails, and writes JSON the notebook can
read.

No test asserts a time: only that times were measured and that every figure derived from one is
consistent.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import types

import numpy as np
import pytest

from flashedu import IMPLEMENTATIONS, bench, naive
from flashedu.bench import __main__ as cli
from flashedu.registry import Implementation
from flashedu.traffic import attention_flops


def _quiet(*_):
    pass


def _buggy(name, fn):
    """A Backend whose forward is `fn(o)` of naive's output: a planted bug."""

    def fwd(q, k, v, causal):
        o, lse = naive.forward(q, k, v, causal=causal)
        return fn(o), lse

    return bench.Backend(name, "numpy", fwd, bench.backends(["naive"])[0][0].fwd_bwd)


def test_quick_sweep_checks_times_and_writes_json(tmp_path):
    out = tmp_path / "r.json"
    rc = cli.main(
        ["--quick", "--cpu", "--bwd", "--out", str(out), "--impls", ",".join(bench.CPU_IMPLS)]
    )
    assert rc == 0
    data = json.loads(out.read_text())
    meta = data["meta"]
    assert meta["date"] and meta["machine"]["cpu_count"] >= 1 and meta["machine"]["platform"]
    assert meta["versions"]["numpy"] == np.__version__ and meta["versions"]["torch"]
    assert meta["gpu"] is None and meta["command"].startswith("python -m flashedu.bench --quick")
    assert data["refused"] == [] and data["unavailable"] == {}
    assert {r["impl"] for r in data["correctness"]} == set(bench.CPU_IMPLS)
    assert all(r["ok"] for r in data["correctness"])
    assert {(r["impl"], r["N"], r["pass"]) for r in data["timing"]} == {
        (i, n, p) for i in bench.CPU_IMPLS for n in bench.QUICK["N"] for p in ("fwd", "fwd_bwd")
    }
    for r in data["timing"]:
        assert r["ms"] >= r["ms_min"] > 0
        flops = attention_flops(
            r["B"], r["H"], r["N"], r["N"], r["d"], causal=r["causal"], pass_=r["pass"]
        )
        assert r["tflops"] == pytest.approx(flops / (r["ms"] / 1e3) / 1e12)
        assert (r["peak_bytes"] is not None) == (
            IMPLEMENTATIONS.get(r["impl"], bench.SDPA).kind == "numpy"
        )
        assert r["ratio"] == pytest.approx(1.0) if r["impl"] == "naive" else r["ratio"] > 0


def test_naive_memory_grows_as_n_squared_and_tiled_does_not(tmp_path):
    res = bench.run_cpu(
        impls=["naive", "tiled"], N=[256, 1024], B=1, H=1, d=64, repeats=1, log=_quiet
    )
    peak = {(r["impl"], r["N"]): r["peak_bytes"] for r in res["timing"]}
    assert peak["naive", 1024] > 10 * peak["naive", 256]  # x16 in N^2, less the O(N d) part
    assert peak["naive", 1024] >= 2 * 1024 * 1024 * 4  # at least S and P in float32
    assert peak["tiled", 1024] < peak["naive", 1024] / 4


@pytest.mark.parametrize(
    "bug, fn", [("scaled output", lambda o: o * 1.01), ("NaN", lambda o: o * np.nan)]
)
def test_a_wrong_implementation_is_refused_not_timed(bug, fn):
    lines = []
    res = bench.run_cpu(
        impls=["naive", _buggy("buggy", fn)], N=[64], B=1, H=1, d=16, repeats=1, log=lines.append
    )
    assert res["refused"] == ["buggy"]
    assert {r["impl"] for r in res["timing"]} == {"naive"}
    assert any("buggy" in line and "refused, not timed" in line for line in lines)
    assert not any(r["ok"] for r in res["correctness"] if r["impl"] == "buggy")


def test_a_crash_is_a_failed_check_with_its_message():
    def boom(q, k, v, causal):
        raise RuntimeError("kernel exploded")

    rows = bench.check(
        bench.Backend("boom", "numpy", boom, boom),
        d=16,
        dtype="float32",
        passes=["fwd"],
        rng=np.random.default_rng(0),
    )
    assert rows and all(
        not r["ok"] and "RuntimeError: kernel exploded" in r["detail"] for r in rows
    )


def test_fully_masked_rows_are_part_of_the_check():
    assert any(causal and N_q > N_k for _, _, N_q, N_k, causal in bench.CHECK_CASES)

    def nan_rows(o):  # what a kernel without the masked-row rule returns there
        o = o.copy()
        o[np.all(o == 0, axis=-1)] = np.nan
        return o

    rows = bench.check(
        _buggy("nan_rows", nan_rows),
        d=16,
        dtype="float32",
        passes=["fwd"],
        rng=np.random.default_rng(1),
    )
    assert [r["ok"] for r in rows] == [not (c and nq > nk) for _, _, nq, nk, c in bench.CHECK_CASES]


def test_unknown_and_unimportable_implementations_are_reported(monkeypatch):
    def load():
        import flashedu.no_such_module as missing

        return missing

    ghost = Implementation("ghost", load, "numpy", ("float32",), frozenset(), "99", "")
    monkeypatch.setitem(IMPLEMENTATIONS, "ghost", ghost)
    found, unavailable = bench.backends(["naive", "ghost", "nonsense"])
    assert [b.name for b in found] == ["naive"]
    assert "does not import" in unavailable["ghost"] and "unknown" in unavailable["nonsense"]


def test_memory_budget_skips_and_says_why():
    naive_b = bench.backends(["naive"])[0]
    timing, skipped = bench.sweep(
        naive_b, N=[512], B=1, H=1, d=16, causal=False, passes=["fwd"], max_bytes=1000
    )
    assert timing == [] and skipped[0]["impl"] == "naive" and "budget" in skipped[0]["reason"]


def test_tflops_and_memory_model_closed_forms():
    assert bench.tflops(1, 1, 1000, 100, 1.0) == pytest.approx(4 * 1000**2 * 100 / 1e-3 / 1e12)
    visible = 1000 * 1001 // 2  # causal: the (query, key) pairs the mask shows
    assert bench.tflops(2, 3, 1000, 64, 2.0, causal=True, pass_="fwd_bwd") == pytest.approx(
        3.5 * 4 * 6 * visible * 64 / 2e-3 / 1e12
    )
    B, H, N, d = 1, 16, 131072, 128
    assert bench.memory_model("naive", B, H, N, d) == 2 * (4 * B * H * N * d + 2 * B * H * N * N)
    assert bench.memory_model("flash", B, H, N, d) == 2 * 4 * B * H * N * d + 4 * B * H * N
    with pytest.raises(ValueError, match="impl must be 'naive' or 'flash', got 'tiled'"):
        bench.memory_model("tiled", B, H, N, d)


def test_ratios_compare_rows_of_the_same_case_only():
    rows = [
        {
            "impl": i,
            "N": n,
            "d": 64,
            "causal": False,
            "pass": "fwd",
            "dtype": "float32",
            "ms": ms,
            "tflops": 1.0,
        }
        for i, n, ms in [("a", 1, 2.0), ("b", 1, 1.0), ("a", 2, 8.0), ("b", 2, 2.0), ("b", 3, 5.0)]
    ]
    bench.add_ratios(rows, "a")
    assert [r["ratio"] for r in rows] == [1.0, 0.5, 1.0, 0.25, None]
    text = bench.table(rows, "a")
    assert text.splitlines()[0].split() == [
        "impl",
        "N",
        "causal",
        "pass",
        "ms",
        "TFLOP/s",
        "peak",
        "MiB",
        "time",
        "/",
        "a",
    ]
    assert text.splitlines()[-1].split()[-1] == "-"


def test_progress_bar_counts_to_the_total():
    buf = io.StringIO()
    p = bench.Progress(4, stream=buf, width=8)
    for i in range(4):
        p.step(f"step {i}")
    text = buf.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")
    frames = text.split("\r")[1:]
    assert frames[0].startswith("[##------] 1/4 step 0") and frames[-1].startswith(
        "[########] 4/4 step 3"
    )


@pytest.mark.parametrize("refused, rc", [([], 0), (["sdpa-cudnn"], 0), (["flashedu-triton"], 1)])
def test_gpu_path_calls_bench_gpu(refused, rc, tmp_path, monkeypatch, capsys):
    calls = []

    def run(quick=False, out=None):
        calls.append((quick, out))
        return {
            "meta": {},
            "timing": [{"impl": "sdpa-flash"}],
            "refused": [
                {
                    "impl": i,
                    "dtype": "bfloat16",
                    "d": 64,
                    "causal": False,
                    "detail": "unavailable: no kernel",
                }
                for i in refused
            ],
        }

    fake = types.SimpleNamespace(run=run)
    monkeypatch.setitem(sys.modules, "flashedu.bench.gpu", fake)
    monkeypatch.setattr(bench, "gpu", fake, raising=False)
    monkeypatch.setattr(cli, "_gpu_name", lambda: "NVIDIA H200")
    assert cli.main(["--quick", "--out", str(tmp_path)]) == rc
    assert calls == [(True, tmp_path / "h200_attention.json")]
    printed = capsys.readouterr().out
    assert all(f"refused {i} bfloat16 d=64" in printed for i in refused)
    assert f"wrote {tmp_path / 'h200_attention.json'}" in printed
    assert (
        cli.gpu_out(None, "NVIDIA H100 80GB HBM3")
        == bench.RESULTS / "h100_80gb_hbm3_attention.json"
    )


def test_load_results_reads_every_json(tmp_path):
    assert bench.load_results(tmp_path) == {}
    (tmp_path / "cpu_x.json").write_text('{"meta": {"date": "d"}}')
    assert bench.load_results(tmp_path) == {"cpu_x.json": {"meta": {"date": "d"}}}


def test_command_line_entry_points(tmp_path):
    out = tmp_path / "cli.json"
    cmd = [
        sys.executable,
        "-m",
        "flashedu.bench",
        "--cpu",
        "--impls",
        "naive",
        "--N",
        "64",
        "--d",
        "16",
        "--repeats",
        "1",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["timing"][0]["N"] == 64
    usage = subprocess.run(
        [sys.executable, "-m", "flashedu", "nope"], capture_output=True, text=True, timeout=60
    )
    assert usage.returncode == 2 and "bench" in usage.stderr


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--impls", "nosuch"], "choose from naive, tiled, torch_tiled, sdpa"),
        (["--impls", ","], "got nothing"),
        (["--repeats", "-3"], "--repeats: must be > 0, got -3"),
        (["--repeats", "two"], "expected an int, got 'two'"),
        (["--N", "64", "-5"], "--N: must be > 0, got -5"),
        (["--d", "0"], "--d: must be > 0"),
        (["--max-mem-gib", "-1"], "--max-mem-gib: must be > 0"),
        (["--seed", "-1"], "--seed: must be >= 0"),
    ],
)
def test_bad_flags_are_refused_before_anything_runs(flags, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--cpu", *flags])
    assert exit_.value.code == 2
    assert words in capsys.readouterr().err


def test_nothing_timed_is_a_failure(tmp_path, monkeypatch, capsys):
    """A sweep whose every case is skipped (here: over a tiny memory budget) exits 1."""
    rc = cli.main(
        [
            "--cpu",
            "--impls",
            "naive",
            "--N",
            "512",
            "--max-mem-gib",
            "1e-9",
            "--repeats",
            "1",
            "--out",
            str(tmp_path / "r.json"),
        ]
    )
    assert rc == 1 and "nothing was timed" in capsys.readouterr().err
    monkeypatch.setattr(cli, "_gpu_name", lambda: "NVIDIA H200")
    fake = types.SimpleNamespace(run=lambda quick=False, out=None: {"timing": [], "refused": []})
    monkeypatch.setitem(sys.modules, "flashedu.bench.gpu", fake)
    monkeypatch.setattr(bench, "gpu", fake, raising=False)
    assert cli.main(["--out", str(tmp_path)]) == 1


def test_portable_command_cuts_out_paths_to_file_names():
    from pathlib import Path

    from flashedu.bench.results import portable_command

    assert (
        portable_command("python -m m --out /root/out/x.json --n 3")
        == "python -m m --out x.json --n 3"
    )
    assert portable_command("python3 r.py --out=$OUT/r4.json") == "python3 r.py --out=r4.json"
    assert portable_command("python -m m --out x.json") == "python -m m --out x.json"
    moved = "python3 notebooks/results/h200_hopper_runs/round4.py --out $OUT/round4.json"
    assert portable_command(moved) == "python3 scripts/hopper/round4.py --out round4.json"
    assert (Path(__file__).parents[2] / "scripts/hopper/round4.py").is_file()
