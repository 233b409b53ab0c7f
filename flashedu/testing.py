"""Shared by tests/, the exercise graders and the benchmarks: random inputs, one tolerance table,
and a comparison that says what went wrong.

Tolerances (absolute, relative) per dtype, used as |actual - expected| <= atol + rtol * |expected|
against the float64 reference. Worst errors measured for `naive` on unit-scale random inputs,
N <= 512, d <= 64, causal and not (forward / gradients), and the tolerance set from them:

    float64   ~1e-15                        -> 1e-12 / 1e-12
    float32   7.7e-7 / 2.7e-6               -> 2e-5 / 2e-5 (gradients 5e-5: they sum N terms)
    float16   1.7e-3 / 2.1e-3 (S, P stored  -> 5e-3 / 5e-3 (gradients 1e-2)
              in fp16, as a GPU would)
    bfloat16  (8-bit mantissa, about 8x fp16's rounding) -> 3e-2 / 3e-2 (gradients 5e-2)

On a GPU, fp16/bf16 kernels are also held to flash-attn's rule: error at most twice that of
PyTorch's own same-precision computation on the same inputs (`flashedu/bench/gpu_check.py`).

Introduced in notebooks/01_naive_attention.ipynb.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .dtypes import dtype_name


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float


TOLERANCES: dict[str, Tolerance] = {
    "float64": Tolerance(1e-12, 1e-12),
    "float32": Tolerance(2e-5, 2e-5),
    "float16": Tolerance(5e-3, 5e-3),
    "bfloat16": Tolerance(3e-2, 3e-2),
}
GRAD_TOLERANCES: dict[str, Tolerance] = {
    "float64": Tolerance(1e-11, 1e-11),
    "float32": Tolerance(5e-5, 5e-5),
    "float16": Tolerance(1e-2, 1e-2),
    "bfloat16": Tolerance(5e-2, 5e-2),
}


def tolerance(dtype, *, grad: bool = False) -> Tolerance:
    return (GRAD_TOLERANCES if grad else TOLERANCES)[dtype_name(dtype)]


def to_numpy(x) -> np.ndarray:
    """Any array or tensor -> float64 NumPy (bf16 and fp16 tensors included)."""
    if hasattr(x, "detach"):
        return x.detach().to("cpu").double().numpy()
    return np.asarray(x, dtype=np.float64)


def random_qkv(
    B: int,
    H: int,
    N_q: int,
    N_k: int,
    d: int,
    dtype="float32",
    *,
    H_kv: int | None = None,
    seed: int | np.random.Generator = 0,
    kind: str = "numpy",
    device: str = "cpu",
    scale: float = 1.0,
):
    """Fresh standard-normal q (B, H, N_q, d), k and v (B, H_kv, N_k, d), times `scale`.

    Drawn in float64 by NumPy from `seed` (so every array kind gets the same values), then cast.
    kind: "numpy" or "torch" (torch tensors on `device`).
    """
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    H_kv = H if H_kv is None else H_kv
    arrays = [
        rng.standard_normal(shape) * scale
        for shape in ((B, H, N_q, d), (B, H_kv, N_k, d), (B, H_kv, N_k, d))
    ]
    return tuple(convert(a, dtype, kind=kind, device=device) for a in arrays)


def convert(a: np.ndarray, dtype="float32", *, kind: str = "numpy", device: str = "cpu"):
    """Cast a float64 NumPy array to `dtype` as a NumPy array or a torch tensor."""
    name = dtype_name(dtype)
    if kind == "numpy":
        if name == "bfloat16":
            raise TypeError("NumPy has no bfloat16: use kind='torch'")
        return np.ascontiguousarray(a.astype(name))
    import torch

    return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=getattr(torch, name))


def max_error(actual, expected) -> tuple[float, float]:
    """(max absolute error, max relative error) over finite expected entries; inf where NaN
    appears."""
    a, e = to_numpy(actual), to_numpy(expected)
    if a.shape != e.shape:
        raise AssertionError(f"shape mismatch: got {a.shape}, expected {e.shape}")
    both_inf = np.isinf(a) & np.isinf(e) & (np.sign(a) == np.sign(e))
    with np.errstate(invalid="ignore"):
        diff = np.where(both_inf, 0.0, np.abs(a - e))
    if np.isnan(diff).any():
        return float("inf"), float("inf")
    return float(diff.max(initial=0.0)), float(
        (diff / np.maximum(np.abs(e), 1e-30)).max(initial=0.0)
    )


def assert_close(
    actual,
    expected,
    dtype=None,
    *,
    grad: bool = False,
    name: str = "output",
    tol: Tolerance | None = None,
):
    """Assert |actual - expected| <= atol + rtol |expected| elementwise (tolerance per dtype), with
    infinities required to match exactly (lse = -inf on fully masked rows) and NaN never allowed."""
    a, e = to_numpy(actual), to_numpy(expected)
    if a.shape != e.shape:
        raise AssertionError(f"{name}: shape {a.shape}, expected {e.shape}")
    if np.isnan(a).any():
        raise AssertionError(f"{name}: {int(np.isnan(a).sum())} NaN entries (expected none)")
    tol = tol or tolerance(
        dtype if dtype is not None else getattr(actual, "dtype", "float64"), grad=grad
    )
    inf_mismatch = np.isinf(a) != np.isinf(e)
    if inf_mismatch.any():
        idx = tuple(int(i) for i in np.argwhere(inf_mismatch)[0])
        raise AssertionError(f"{name}: infinity mismatch at {idx}: got {a[idx]}, expected {e[idx]}")
    finite = np.isfinite(e)
    if (np.isinf(e) & (a != e)).any():
        raise AssertionError(f"{name}: infinities of opposite sign")
    with np.errstate(invalid="ignore"):
        diff = np.where(finite, np.abs(a - e), 0.0)
    bound = tol.atol + tol.rtol * np.where(finite, np.abs(e), 0.0)
    bad = diff > bound
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {a.size} entries outside atol={tol.atol:g}, "
            f"rtol={tol.rtol:g}; max |diff| = {diff.max():.3e}; first at {idx}: "
            f"got {a[idx]!r}, expected {e[idx]!r}"
        )


def run_grader(grader, fn, seed=0):
    """Run an exercise grader quietly: (its Report, the lines it would have printed, joined)."""
    lines: list[str] = []
    report = grader(fn, seed=seed, out=lines.append)
    return report, "\n".join(lines)
