"""Graders for chapter 00 (notebooks/00_memory_hierarchy.ipynb): arithmetic intensity and the
roofline.

Exercise 0.1 asks for the arithmetic intensity of a matmul, exercise 0.2 for the roofline time of
standard attention on a GPU preset. The solutions below are written with `flashedu.traffic`, so the
learner can compare their arithmetic with the functions the rest of the course uses. When an answer
is wrong, the grader recomputes the usual mistakes (a FLOP per multiply-add, a forgotten write, a
sum instead of a max, ...) and names the one that reproduces the learner's number; the formulas
come only with `checks.hint(grader)`. flashedu's own functions (`traffic` included) are off limits
while the learner's answer runs.

Limits: both are counting models. They assume every operand crosses HBM exactly once per step and
ignore caches, launch overhead and the gap between peak and achievable bandwidth.
"""

from __future__ import annotations

from .. import traffic
from ._core import Case, Report, grade, grader, number_or_none, rng_for

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


def _number(got, expected, rel: float = 1e-9):
    g = number_or_none(got)
    if g is None:
        return False, f"expected a finite number, got {got!r}"
    err = abs(g - expected) / abs(expected)
    return err <= rel, f"got {g:.6g}, expected {expected:.6g} (rel. error {err:.1e})"


def _matmul_mistakes(M: int, N: int, K: int, e: int) -> dict[str, float]:
    flops, elems = 2.0 * M * N * K, M * K + K * N + M * N
    return {
        "FLOPs counted as M N K: a multiply-add is 2 FLOPs": flops / 2 / (elems * e),
        "the write of C was not counted": flops / ((M * K + K * N) * e),
        "bytes counted as elements: multiply by itemsize": flops / elems,
        "bytes counted as M N K elements, as if each term fetched its operands": 2.0 / (2 * e),
    }


def _naive_time_mistakes(N: int, d: int, gpu: traffic.GPU, e: int) -> dict[str, tuple]:
    """Each usual mistake as the (seconds, bound) it returns, the bound from its own numbers."""
    nbytes = traffic.naive_forward(1, 1, N, N, d, itemsize=e).total_bytes
    nn, flops = N * N * e, 4.0 * N * N * d  # bytes of one N x N matrix (S or P); matmul FLOPs

    def roof(b, f=flops):
        t_mem, t_flop = b / gpu.hbm_bandwidth, f / gpu.dense_flops
        return max(t_mem, t_flop), "memory" if t_mem >= t_flop else "compute"

    t, bound = roof(nbytes)
    return {
        "S and P were left out: they are N x N and each is written and read back": roof(
            nbytes - 4 * nn
        ),
        "S and P were counted once each: each is written to HBM and read back": roof(
            nbytes - 2 * nn
        ),
        "the lse write (N floats of 4 bytes) was left out": roof(nbytes - 4 * N),
        "lse was counted in the input itemsize: it is always float32 (4 bytes)": roof(
            nbytes - 4 * N + e * N
        ),
        "FLOPs counted as 2 N^2 d: there are two matmuls (Q K^T and P V)": roof(nbytes, flops / 2),
        "memory and compute times were added: the roofline takes their max (they overlap)": (
            nbytes / gpu.hbm_bandwidth + flops / gpu.dense_flops,
            bound,
        ),
        f"bound 'memory' where {gpu.name} is compute-bound: compare bytes / bandwidth with "
        "FLOPs / rate": (t, "memory"),
        f"bound 'compute' where {gpu.name} is memory-bound: compare bytes / bandwidth with "
        "FLOPs / rate": (t, "compute"),
    }


def _in_ns(args: tuple):
    """Run fn(*args) and give its (seconds, bound) in nanoseconds, so that the mistakes are told
    apart by relative error even for a tiny N."""

    def call(fn):
        got = fn(*args)
        if isinstance(got, tuple) and len(got) == 2 and number_or_none(got[0]) is not None:
            return (float(got[0]) * 1e9, got[1])
        return got

    return call


def _ns(pair: tuple) -> tuple:
    return (pair[0] * 1e9, pair[1])


def _time_check(got, expected):
    if not isinstance(got, tuple) or len(got) != 2:
        return False, f"expected a pair (seconds, bound), got {got!r}"
    ok, detail = _number(got[0], expected[0], 1e-6)
    detail = detail.replace(",", " ns,", 1).replace(" (rel.", " ns (rel.", 1)
    if got[1] not in ("memory", "compute"):
        return False, f"{detail}; bound {got[1]!r}: expected 'memory' or 'compute'"
    if got[1] != expected[1]:
        return False, f"{detail}; bound {got[1]!r}, expected {expected[1]!r}"
    return ok, f"{detail}; {got[1]}-bound"


# ------------------------------------------------------------------------------------------ graders

_MATMUL_FORMULA = """
FLOPs = 2 M N K                      (one multiply and one add per term)
bytes = (M K + K N + M N) * itemsize (read A and B once, write C once)
intensity = FLOPs / bytes
"""

_TIME_FORMULA = """
bytes = (4 N d + 4 N^2) * itemsize + 4 N
        (Q, K, V read and O written; S and P each written and read back; lse written, float32)
FLOPs = 4 N^2 d                      (Q K^T and P V, 2 FLOPs per multiply-add)
time  = max(bytes / gpu.hbm_bandwidth, FLOPs / gpu.dense_flops)
bound = "memory" if the bytes take longer, else "compute"
"""


@grader("flashedu.checks.ch00.matmul_intensity", formula=_MATMUL_FORMULA)
def check_matmul_intensity(fn, *, seed=None, out=print) -> Report:
    """Exercise 0.1: `fn(M, N, K, itemsize)` -> FLOP per byte of a matmul (M, K) @ (K, N)."""
    rng = rng_for(seed)
    shapes = [(1, 1, 1, 2), (4096, 4096, 4096, 2), (8, 4096, 4096, 2), (4096, 1, 4096, 4)]
    shapes += [
        (int(a), int(b), int(c), int(rng.choice([2, 4])))
        for a, b, c in rng.integers(1, 3000, size=(2, 3))
    ]
    cases = [
        Case(
            f"(M, N, K)=({M}, {N}, {K}) itemsize={e}",
            (M, N, K, e),
            matmul_intensity(M, N, K, e),
            hint="the intensity matches none of the usual slips: count the FLOPs and the bytes "
            "again",
            check=_number,
            mistakes=_matmul_mistakes(M, N, K, e),
        )
        for M, N, K, e in shapes
    ]
    return grade("check_matmul_intensity", fn, cases, out=out, forbid=True)


def _gpus() -> dict[str, tuple[traffic.GPU, str]]:
    """The presets and a made-up GPU with slow arithmetic, each with how to write it in a call."""
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
    named = {k: (g, f"traffic.GPUS[{k!r}]") for k, g in traffic.GPUS.items()}
    made_up = "dataclasses.replace(traffic.GPUS['H200'], dense_flops=1e12)"
    return {**named, "1-TFLOP/s GPU": (slow, made_up)}


@grader("flashedu.checks.ch00.naive_attention_time", formula=_TIME_FORMULA)
def check_naive_attention_time(fn, *, seed=None, out=print) -> Report:
    """Exercise 0.2: `fn(N, d, gpu, itemsize)` -> (seconds, "memory" | "compute") for standard
    attention."""
    rng = rng_for(seed)
    gpus = _gpus()
    sizes = [
        (1, 16, "A100-40GB", 2),
        (4096, 64, "H200", 2),
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
            (N, d, gpus[g][0], e),
            _ns(naive_attention_time(N, d, gpus[g][0], e)),
            hint="the time matches none of the usual slips: count the bytes of the three steps "
            "and the FLOPs of the two matmuls again",
            check=_time_check,
            mistakes={why: _ns(v) for why, v in _naive_time_mistakes(N, d, gpus[g][0], e).items()},
            call=_in_ns((N, d, gpus[g][0], e)),
            inputs=f"N={N}, d={d}, gpu={gpus[g][1]}, itemsize={e}",
        )
        for N, d, g, e in sizes
    ]
    return grade("check_naive_attention_time", fn, cases, out=out, forbid=True)
