"""Graders for chapter 00 (notebooks/00_memory_hierarchy.ipynb): arithmetic intensity and the
roofline.

Exercise 0.1 asks for the arithmetic intensity of a matmul, exercise 0.2 for the roofline time of
standard attention on a GPU preset. The solutions below are written with `flashedu.traffic`, so the
learner can compare their arithmetic with the functions the rest of the course uses. When an answer
is wrong, the grader recomputes the usual mistakes (a FLOP per multiply-add, a forgotten write, a
sum instead of a max, ...) and names the one that reproduces the learner's number.

Limits: both are counting models. They assume every operand crosses HBM exactly once per step and
ignore caches, launch overhead and the gap between peak and achievable bandwidth.
"""

from __future__ import annotations

from .. import traffic
from ._core import Case, Report, diagnose, grade, grader, number_or_none, rng_for

__all__ = ["check_matmul_intensity", "check_naive_attention_time"]


# ---------------------------------------------------------------------------------------- solutions


def matmul_intensity(M: int, N: int, K: int, itemsize: int = 2) -> float:
    """FLOP per HBM byte of C = A @ B with A (M, K), B (K, N): 2 M N K FLOPs (one multiply and one
    add per term) over reading A and B once and writing C once."""
    flops = 2.0 * M * N * K
    nbytes = (M * K + K * N + M * N) * itemsize  # HBM: read A, read B, write C
    return flops / nbytes


def naive_attention_time(N: int, d: int, gpu: traffic.GPU, itemsize: int = 2) -> tuple[float, str]:
    """Roofline time (seconds) and bound ("memory" or "compute") of standard attention forward, one
    head, N queries and N keys of width d, on `gpu`."""
    t = traffic.naive_forward(1, 1, N, N, d, itemsize=itemsize)
    r = traffic.roofline(traffic.attention_flops(1, 1, N, N, d), t.total_bytes, gpu)
    return r.time, r.bound


# ---------------------------------------------------------------------------------------- diagnosis


def _matmul_check(M: int, N: int, K: int, e: int):
    mistakes = {
        "FLOPs counted as M N K: a multiply-add is 2 FLOPs": M
        * N
        * K
        / ((M * K + K * N + M * N) * e),
        "the write of C was not counted": 2.0 * M * N * K / ((M * K + K * N) * e),
        "bytes counted as elements: multiply by itemsize": 2.0
        * M
        * N
        * K
        / (M * K + K * N + M * N),
        "bytes counted as M N K elements, as if each term fetched its operands": 2.0 / (2 * e),
    }

    def check(got, expected) -> tuple[bool, str]:
        g = number_or_none(got)
        if g is None:
            return False, f"expected a finite number, got {got!r}"
        return diagnose(g, expected, mistakes, 1e-9)

    return check


def _naive_time_mistakes(N: int, d: int, gpu: traffic.GPU, e: int) -> dict[str, float]:
    t = traffic.naive_forward(1, 1, N, N, d, itemsize=e)
    nn = N * N * e  # bytes of one N x N matrix (S or P)
    flops, bw, rate = 4.0 * N * N * d, gpu.hbm_bandwidth, gpu.dense_flops
    by = t.total_bytes

    def tm(nbytes, f=flops):
        return max(nbytes / bw, f / rate)

    return {
        "S and P were left out: they are N x N and each is written and read back": tm(by - 4 * nn),
        "S and P were counted once each: each is written to HBM and read back": tm(by - 2 * nn),
        "the lse write (N floats of 4 bytes) was left out": tm(by - 4 * N),
        "lse was counted in the input itemsize: it is always float32 (4 bytes)": tm(
            by - 4 * N + e * N
        ),
        "FLOPs counted as 2 N^2 d: there are two matmuls (Q K^T and P V)": tm(by, flops / 2),
        "memory and compute times were added: the roofline takes their max (they overlap)": by / bw
        + flops / rate,
    }


def _time_check(N: int, d: int, gpu: traffic.GPU, e: int):
    mistakes = _naive_time_mistakes(N, d, gpu, e)

    def check(got, expected) -> tuple[bool, str]:
        if not isinstance(got, tuple) or len(got) != 2:
            return False, f"expected a pair (seconds, bound), got {got!r}"
        g = number_or_none(got[0])
        if g is None:
            return False, f"expected a finite number of seconds, got {got[0]!r}"
        ok, detail = diagnose(g, expected[0], mistakes, 1e-6)
        if got[1] != expected[1]:
            return (
                False,
                f"{detail}; bound {got[1]!r}, expected {expected[1]!r}: compare bytes / bandwidth "
                f"with FLOPs / rate",
            )
        return ok, f"{detail}; {got[1]}-bound"

    return check


# ------------------------------------------------------------------------------------------ graders


@grader("flashedu.checks.ch00.matmul_intensity")
def check_matmul_intensity(fn, *, seed=None, out=print) -> Report:
    """Exercise 0.1: `fn(M, N, K, itemsize)` -> FLOP per byte of a matmul (M, K) @ (K, N)."""
    rng = rng_for(seed)
    shapes = [(4096, 4096, 4096, 2), (1, 1, 1, 2), (8, 4096, 4096, 2), (4096, 1, 4096, 4)]
    shapes += [
        (int(a), int(b), int(c), int(rng.choice([2, 4])))
        for a, b, c in rng.integers(1, 3000, size=(2, 3))
    ]
    cases = [
        Case(
            f"(M, N, K)=({M}, {N}, {K}) itemsize={e}",
            (M, N, K, e),
            matmul_intensity(M, N, K, e),
            hint="FLOPs = 2 M N K; bytes = (M K + K N + M N) * itemsize",
            check=_matmul_check(M, N, K, e),
        )
        for M, N, K, e in shapes
    ]
    return grade(
        "check_matmul_intensity",
        fn,
        cases,
        solution_name=check_matmul_intensity.solution_name,
        out=out,
    )


@grader("flashedu.checks.ch00.naive_attention_time")
def check_naive_attention_time(fn, *, seed=None, out=print) -> Report:
    """Exercise 0.2: `fn(N, d, gpu, itemsize)` -> (seconds, "memory" | "compute") for standard
    attention."""
    rng = rng_for(seed)
    h = traffic.GPUS["H200"]
    # Arithmetic so slow that FLOPs, not bytes, decide: the one compute-bound case.
    slow = traffic.GPU(
        "made-up GPU with 1 TFLOP/s",
        h.hbm_bytes,
        h.hbm_bandwidth,
        h.sram_per_sm,
        h.smem_per_block,
        h.sms,
        1e12,
        "made up, to make standard attention compute-bound",
    )
    gpus = {**traffic.GPUS, "1-TFLOP/s GPU": slow}
    sizes = [
        (4096, 64, "H200", 2),
        (1, 16, "A100-40GB", 2),
        (1024, 128, "H100-SXM", 4),
        (2048, 128, "1-TFLOP/s GPU", 2),
    ]
    sizes += [
        (
            int(rng.integers(2, 20000)),
            int(rng.choice([32, 64, 128, 256])),
            str(rng.choice(list(traffic.GPUS))),
            int(rng.choice([2, 4])),
        )
        for _ in range(2)
    ]
    cases = [
        Case(
            f"N={N} d={d} {g} itemsize={e}",
            (N, d, gpus[g], e),
            naive_attention_time(N, d, gpus[g], e),
            hint="FLOPs = 4 N^2 d; time = max(bytes / bandwidth, FLOPs / rate)",
            check=_time_check(N, d, gpus[g], e),
        )
        for N, d, g, e in sizes
    ]
    return grade(
        "check_naive_attention_time",
        fn,
        cases,
        solution_name=check_naive_attention_time.solution_name,
        out=out,
    )
