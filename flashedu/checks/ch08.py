"""Graders for chapter 08 (notebooks/08_benchmarks.ipynb): reading benchmark numbers.

Exercise 8.1 turns a measured time into TFLOP/s, exercise 8.2 predicts how much memory standard
attention needs at long context. The solutions are `flashedu.bench.tflops` and
`flashedu.bench.memory_model`, the functions the benchmark and the notebook's plots use. A wrong
answer is matched against the usual mistakes (milliseconds taken as seconds, causal not halved, one
N x N matrix instead of two, ...) and the grader names the one that reproduces it.

Limits: both are counting models. TFLOP/s counts matmul FLOPs only, as the FlashAttention papers do;
the memory model counts the tensors standard attention keeps, not the allocator's rounding or
workspace.
"""

from __future__ import annotations

from .. import bench
from ._core import Case, Report, diagnose, grade, grader, number_or_none, rng_for

__all__ = ["check_tflops", "check_naive_memory"]


def _checker(mistakes: dict[str, float], rel: float = 1e-9):
    def check(got, expected) -> tuple[bool, str]:
        g = number_or_none(got)
        if g is None:
            return False, f"expected a finite number, got {got!r}"
        return diagnose(g, expected, mistakes, rel)

    return check


def _tflops_mistakes(B, H, N, d, ms, causal, pass_) -> dict[str, float]:
    right = bench.tflops(B, H, N, d, ms, causal=causal, pass_=pass_)
    wrong = {
        "ms was used as seconds: divide the time by 1e3 first": right / 1e3,
        "that is GFLOP/s: divide FLOP/s by 1e12 for TFLOP/s": right * 1e3,
        (
            "FLOPs counted as 2 B H N^2 d: there are two matmuls (Q K^T and P V), "
            "2 FLOPs per multiply-add"
        ): right / 2,
        f"B H = {B * H} left out: every (batch, head) pair does the work": right / (B * H),
    }
    if causal:
        wrong["causal was not halved: a causal mask skips half the scores"] = right * 2
    if pass_ == "fwd_bwd":
        wrong["the backward was counted as 1x the forward: it is 2.5x, so fwd_bwd is 3.5x"] = (
            right * 2 / 3.5
        )
        wrong["fwd_bwd counted as 2.5x: 2.5x is the backward alone; add the forward's 1x"] = (
            right * 2.5 / 3.5
        )
    return wrong


@grader("flashedu.bench.tflops")
def check_tflops(fn, *, seed=None, out=print) -> Report:
    """Exercise 8.1: `fn(B, H, N, d, ms, causal=False, pass_="fwd")` -> TFLOP/s of one attention
    call."""
    rng = rng_for(seed)
    specs = [
        (4, 16, 4096, 64, 1.25, False, "fwd"),
        (4, 16, 4096, 64, 0.7, True, "fwd"),
        (2, 16, 16384, 128, 9.5, False, "fwd_bwd"),
        (3, 8, 8192, 128, 4.1, True, "fwd_bwd"),
    ]
    specs += [
        (
            int(rng.integers(2, 9)),
            int(rng.integers(3, 33)),
            int(rng.integers(512, 65537)),
            int(rng.choice([64, 128, 256])),
            float(rng.uniform(0.05, 50.0)),
            bool(rng.integers(2)),
            p,
        )
        for p in ("fwd", "fwd_bwd")
    ]
    cases = [
        Case(
            f"B={B} H={H} N={N} d={d} {ms:.3g} ms causal={c} {p}",
            (B, H, N, d, ms),
            bench.tflops(B, H, N, d, ms, causal=c, pass_=p),
            kwargs={"causal": c, "pass_": p},
            hint=(
                "FLOPs = 4 B H N^2 d, x0.5 causal, x3.5 fwd_bwd; "
                "TFLOP/s = FLOPs / (ms / 1e3) / 1e12"
            ),
            check=_checker(_tflops_mistakes(B, H, N, d, ms, c, p)),
        )
        for B, H, N, d, ms, c, p in specs
    ]
    return grade("check_tflops", fn, cases, solution_name=check_tflops.solution_name, out=out)


def _memory_mistakes(B, H, N, d, e) -> dict[str, float]:
    right = bench.memory_model("naive", B, H, N, d, itemsize=e)
    nn, qkvo = B * H * N * N * e, 4 * B * H * N * d * e  # one N x N matrix; Q, K, V, O together
    return {
        "only one N x N matrix: standard attention keeps both S and P": qkvo + nn,
        "S and P were left out: they are the N^2 term": qkvo,
        "Q, K, V and O were left out: small next to N^2, but they are there": 2 * nn,
        f"B H = {B * H} left out: every (batch, head) pair has its own S and P": right / (B * H),
        f"elements, not bytes: multiply by itemsize={e}": right / e,
        "that is GiB: return bytes": right / 2**30,
        "that is GB: return bytes": right / 1e9,
    }


@grader("flashedu.bench.memory_model")
def check_naive_memory(fn, *, seed=None, out=print) -> Report:
    """Exercise 8.2: `fn(B, H, N, d, itemsize)` -> bytes standard attention's forward keeps: Q, K,
    V, O, S, P."""
    rng = rng_for(seed)
    specs = [(1, 32, 131072, 128, 2), (1, 1, 8192, 64, 2), (2, 8, 32768, 128, 4), (1, 3, 1, 16, 2)]
    specs += [
        (
            int(rng.integers(1, 9)),
            int(rng.integers(5, 65)),
            int(rng.integers(2, 262145)),
            int(rng.choice([64, 96, 128, 256])),
            int(rng.choice([2, 4])),
        )
        for _ in range(2)
    ]
    cases = [
        Case(
            f"B={B} H={H} N={N} d={d} itemsize={e}",
            (B, H, N, d, e),
            bench.memory_model("naive", B, H, N, d, itemsize=e),
            hint="bytes = (4 N d + 2 N^2) * B * H * itemsize",
            check=_checker(_memory_mistakes(B, H, N, d, e)),
        )
        for B, H, N, d, e in specs
    ]
    return grade(
        "check_naive_memory", fn, cases, solution_name=check_naive_memory.solution_name, out=out
    )
