"""One validation helper for every implementation: bad input fails early with a named error.

The packed-sequence layout (`check_varlen`) is checked here too, for `flashedu.varlen` and
`flashedu.kernels.varlen` alike.

Works on NumPy arrays and torch tensors alike (anything with `.shape`, `.ndim` and `.dtype`).
"""

from __future__ import annotations

import contextlib
import math
import numbers
import threading

import numpy as np
import torch

from .dtypes import acc_dtype, dtype_name

NUMPY_DTYPES = (np.float16, np.float32, np.float64)


def _shape(x) -> tuple:
    return tuple(x.shape)


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def _check_array(x, arg: str, name: str, kind: str | None, what: str = "an array or tensor"):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        got = "None" if x is None else type(x).__name__
        raise TypeError(f"{name}: {arg} must be {what}, got {got}")
    if kind == "numpy" and not isinstance(x, np.ndarray):
        raise TypeError(
            f"{name}: {arg} must be a numpy.ndarray, got {type(x).__module__}.{type(x).__name__} "
            "(a NumPy implementation takes arrays)"
        )
    if kind == "torch" and not _is_torch(x):
        raise TypeError(
            f"{name}: {arg} must be a torch.Tensor, got {type(x).__module__}.{type(x).__name__}"
        )


def check_qkv(
    q, k, v, *, name: str = "attention", kind: str | None = None, value_dim: bool = False
) -> tuple[int, int, int, int, int, int]:
    """Validate q (B, H, N_q, d), k and v (B, H_kv, N_k, d) with H % H_kv == 0.

    `kind` is "numpy" or "torch" when the implementation needs one array kind. With
    `value_dim=True` v may have its own head dim, (B, H_kv, N_k, d_v), as in PyTorch's SDPA (Ev).
    Returns (B, H, H_kv, N_q, N_k, d).
    """
    for arg, x in (("q", q), ("k", k), ("v", v)):
        _check_array(x, arg, name, kind)
        if x.ndim != 4:
            raise ValueError(
                f"{name}: {arg} must have shape (B, H, N, d) (4 dims), got shape {_shape(x)}"
            )
    if k.shape[:3] != v.shape[:3] or (k.shape != v.shape and not value_dim):
        raise ValueError(
            f"{name}: k and v must have the same shape"
            + (" up to the head dim" if value_dim else "")
            + f", got {_shape(k)} and {_shape(v)}"
        )
    B, H, N_q, d = q.shape
    B_k, H_kv, N_k, d_k = k.shape
    if B_k != B:
        raise ValueError(f"{name}: batch size differs: q has B={B}, k and v have B={B_k}")
    if d_k != d:
        raise ValueError(f"{name}: head dimension d differs: q has d={d}, k and v have d={d_k}")
    if H_kv == 0 or H % H_kv:
        raise ValueError(
            f"{name}: q has H={H} heads, which is not a multiple of k and v's H_kv={H_kv} heads"
        )
    if N_q == 0 or N_k == 0 or d == 0 or B == 0 or v.shape[3] == 0:
        raise ValueError(f"{name}: empty input: q has shape {_shape(q)}, k has shape {_shape(k)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"{name}: q, k and v must share one dtype, got {q.dtype}, {k.dtype} and {v.dtype}"
        )
    if isinstance(q, np.ndarray) and q.dtype not in NUMPY_DTYPES:
        raise TypeError(f"{name}: dtype must be float16, float32 or float64, got {q.dtype}")
    if _is_torch(q):
        import torch

        if q.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise TypeError(
                f"{name}: dtype must be float16, bfloat16, float32 or float64, got {q.dtype}"
            )
        if not (q.device == k.device == v.device):
            raise ValueError(
                f"{name}: q, k and v must be on one device, got {q.device}, {k.device} and "
                f"{v.device}"
            )
    return B, H, H_kv, N_q, N_k, d


def check_causal(causal, *, name: str = "attention") -> bool:
    """`causal` must be a bool (or NumPy's bool): a string such as "False" is truthy, so it is
    refused rather than read as True."""
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"{name}: causal must be a bool, got {type(causal).__name__} {causal!r}")
    return bool(causal)


def _is_real(x) -> bool:
    """A real number: int, float, NumPy scalar or 0-dim array/tensor of a real dtype; not a bool."""
    if isinstance(x, (bool, np.bool_)):
        return False
    if isinstance(x, numbers.Real):
        return True
    dtype = str(getattr(x, "dtype", ""))
    return getattr(x, "ndim", None) == 0 and ("float" in dtype or "int" in dtype)


def resolve_scale(
    softmax_scale, d: int, *, name: str = "attention", arg: str = "softmax_scale"
) -> float:
    """`softmax_scale` as a float, or the default 1/sqrt(d) for None.

    Anything but a real number (a string, a bool, a complex number, an array) is a TypeError and a
    non-finite value a ValueError; zero and negative scales are valid math and are accepted.
    """
    if softmax_scale is None:
        return 1.0 / math.sqrt(d)
    if not _is_real(softmax_scale):
        raise TypeError(
            f"{name}: {arg} must be a real number or None, got "
            f"{type(softmax_scale).__name__} {softmax_scale!r}"
        )
    scale = float(softmax_scale)
    if not math.isfinite(scale):
        raise ValueError(f"{name}: {arg} must be finite, got {softmax_scale!r}")
    return scale


def _out_shape(q, v) -> tuple:
    """The shape of o and do: q's, or (B, H, N_q, d_v) when v has its own head dim."""
    return _shape(q) if v is None else _shape(q)[:3] + _shape(v)[3:]


def _whose(q, out) -> str:
    return "q's shape" if out == _shape(q) else "shape (B, H, N_q, d_v)"


def check_do(do, q, *, name: str = "attention backward", kind: str | None = None, v=None) -> None:
    """do, the gradient of the output, must be an array of q's kind, shape (d_v as its last dim
    when v is given) and dtype."""
    _check_array(do, "do", name, kind, "an array or tensor (the gradient of o)")
    out = _out_shape(q, v)
    if _shape(do) != out:
        raise ValueError(f"{name}: do must have {_whose(q, out)} {out}, got {_shape(do)}")
    if do.dtype != q.dtype:
        raise TypeError(f"{name}: do must have q's dtype {q.dtype}, got {do.dtype}")


def check_backward(
    do,
    o,
    lse,
    q,
    *,
    name: str = "attention backward",
    kind: str | None = None,
    strict_lse_dtype: bool = True,
    v=None,
) -> None:
    """The backward's extra inputs, against the validated q (B, H, N_q, d).

    do and o: q's array kind and shape, (B, H, N_q, d_v) when v is given (do also q's dtype).
    lse: the forward's log-sum-exp, shape (B, H, N_q), float32 (float64 for float64 q; any float
    dtype with strict_lse_dtype=False), on q's device, with no NaN and no +inf (-inf marks a fully
    masked row). The value check reads lse once; under torch.compile it is left out, since a graph
    cannot branch on tensor values, and so it is for a CUDA lse inside `lse_from_forward`.
    """
    check_do(do, q, name=name, kind=kind, v=v)
    _check_array(o, "o", name, kind, "an array or tensor (the forward's output)")
    _check_array(lse, "lse", name, kind, "an array or tensor (the forward's log-sum-exp)")
    out = _out_shape(q, v)
    if _shape(o) != out:
        raise ValueError(f"{name}: o must have {_whose(q, out)} {out}, got {_shape(o)}")
    if _shape(lse) != _shape(q)[:3]:
        raise ValueError(
            f"{name}: lse must have shape (B, H, N_q) = {_shape(q)[:3]}, got {_shape(lse)}"
        )
    want = dtype_name(acc_dtype(q.dtype))
    if dtype_name(lse.dtype) != want and (strict_lse_dtype or "float" not in dtype_name(lse.dtype)):
        raise TypeError(
            f"{name}: lse must be {want} for {dtype_name(q.dtype)} inputs (as forward returns it), "
            f"got {dtype_name(lse.dtype)}"
        )
    if _is_torch(q) and not (do.device == o.device == lse.device == q.device):
        raise ValueError(
            f"{name}: do, o and lse must be on q's device {q.device}, got {do.device}, "
            f"{o.device} and {lse.device}"
        )
    _check_lse_values(lse, name)


_trust = threading.local()


@contextlib.contextmanager
def lse_from_forward():
    """Inside this block, `check_backward` skips its NaN / +inf scan of a CUDA lse: autograd
    (`autograd.FlashAttentionBackward`) hands the backward the lse its own forward returned, and
    on a GPU the scan is a host sync in the middle of the backward (the GPU then waits while the
    host launches the kernels after it). Shapes, dtypes and devices are still checked."""
    before = getattr(_trust, "lse", False)
    _trust.lse = True
    try:
        yield
    finally:
        _trust.lse = before


def _check_lse_values(lse, name: str) -> None:
    if _is_torch(lse):
        import torch

        if torch.compiler.is_compiling() or (lse.is_cuda and getattr(_trust, "lse", False)):
            return
        bad = int((torch.isnan(lse) | torch.isposinf(lse)).sum())
    else:
        bad = int((np.isnan(lse) | np.isposinf(lse)).sum())
    if bad:
        raise ValueError(
            f"{name}: lse has {bad} NaN or +inf entries; it must be the log-sum-exp that forward "
            "returned (finite, or -inf on a fully masked row)"
        )


def _is_int(x) -> bool:
    return isinstance(x, (numbers.Integral, np.integer)) and not isinstance(x, (bool, np.bool_))


def check_window(window_size, *, name: str = "attention") -> tuple[int, int] | None:
    """(left, right) keys visible around the diagonal; -1 means unbounded on that side; None means
    no window.

    Only a pair of ints (a tuple or a list) is taken: a string such as "12" would unpack into
    ("1", "2"), a float would be truncated and a bool read as 0 or 1, so each is refused.
    """
    if window_size is None:
        return None
    if isinstance(window_size, (str, bytes)) or not isinstance(window_size, (tuple, list)):
        raise TypeError(
            f"{name}: window_size must be a pair (left, right) of ints or None, got "
            f"{type(window_size).__name__} {window_size!r}"
        )
    if len(window_size) != 2 or not all(_is_int(w) for w in window_size):
        raise TypeError(
            f"{name}: window_size must be a pair (left, right) of ints or None, got {window_size!r}"
        )
    left, right = (int(w) for w in window_size)
    if left < -1 or right < -1:
        raise ValueError(
            f"{name}: window_size entries must be >= 0, or -1 for unbounded, got {window_size!r}"
        )
    return left, right


def check_int(value, arg: str, *, name: str, low: int = 1, high: int | None = None) -> int:
    """An int (not a bool, a float or a string) in [low, high]; a TypeError or ValueError naming
    the function, the argument, the value and the range."""
    want = f"an int >= {low}" if high is None else f"an int in [{low}, {high:,}]"
    if not _is_int(value):
        raise TypeError(f"{name}: {arg} must be {want}, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        raise ValueError(f"{name}: {arg} must be {want}, got {value!r}")
    return int(value)


def check_real(value, arg: str, *, name: str, low: float, high: float) -> float:
    """A finite real number (not a bool or a string) in [low, high]."""
    if not _is_real(value):
        raise TypeError(
            f"{name}: {arg} must be a number in [{low:g}, {high:g}], got "
            f"{type(value).__name__} {value!r}"
        )
    x = float(value)
    if not (math.isfinite(x) and low <= x <= high):
        raise ValueError(f"{name}: {arg} must be a number in [{low:g}, {high:g}], got {value!r}")
    return x


def check_impl(impl, names, *, name: str, extra: str = "") -> str:
    """`impl` must be a str among `names`; checked before anything runs, even when nothing would."""
    names = list(names)
    if not isinstance(impl, str):
        raise TypeError(
            f"{name}: impl must be a str, one of {names}, got {type(impl).__name__} {impl!r}"
        )
    if impl not in names:
        raise ValueError(f"{name}: impl must be one of {names}, got {impl!r}{extra}")
    return impl


def check_slopes(alibi_slopes, H: int, *, B: int | None = None, name: str = "attention"):
    """None, or ALiBi slopes: finite numbers of shape (H,), one per query head, or with `B` given
    also (B, H), one row per batch element. Accepts a sequence, a NumPy array or a torch tensor and
    returns it unchanged."""
    if alibi_slopes is None:
        return None
    shape = tuple(alibi_slopes.shape) if hasattr(alibi_slopes, "shape") else np.shape(alibi_slopes)
    allowed = [(H,)] if B is None else [(H,), (B, H)]
    if shape not in allowed:
        expected = f"(H,) = ({H},)" + ("" if B is None else f" or (B, H) = ({B}, {H})")
        raise ValueError(f"{name}: alibi_slopes must have shape {expected}, got {shape}")
    if _is_torch(alibi_slopes):
        import torch

        finite = bool(torch.isfinite(alibi_slopes).all())
    else:
        try:
            finite = bool(np.isfinite(np.asarray(alibi_slopes, dtype=np.float64)).all())
        except (TypeError, ValueError):
            raise TypeError(
                f"{name}: alibi_slopes must be real numbers, got {alibi_slopes!r}"
            ) from None
    if not finite:
        raise ValueError(f"{name}: alibi_slopes must be finite, got {alibi_slopes!r}")
    return alibi_slopes


def check_order(order, *, name: str = "attention") -> str:
    """The tiled forward's loop order: "fa2" (outer loop over query blocks) or "fa1" (over K/V
    blocks)."""
    if order not in ("fa1", "fa2"):
        raise ValueError(
            f"{name}: order must be 'fa2' (outer loop over query blocks) or 'fa1' (outer loop over "
            f"K/V blocks), got {order!r}"
        )
    return order


def check_block(block: int, arg: str, *, name: str = "attention") -> int:
    if not isinstance(block, (int, np.integer)) or isinstance(block, bool) or block < 1:
        raise ValueError(f"{name}: {arg} must be a positive int, got {block!r}")
    return int(block)


# ---------------------------------------------- packed sequences (flashedu.varlen, kernels.varlen)
def _check_tensors(q, k, v) -> None:
    for arg, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"attention_varlen: {arg} must be a torch.Tensor, got {type(x).__name__}"
            )
        if x.ndim != 3:
            raise ValueError(
                f"attention_varlen: {arg} must have shape (total, heads, d) (3 dims), "
                f"got shape {tuple(x.shape)}"
            )
    if k.shape != v.shape:
        raise ValueError(
            f"attention_varlen: k and v must have the same shape (total_k, H_kv, d), "
            f"got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if q.shape[2] != k.shape[2]:
        raise ValueError(
            f"attention_varlen: head dimension d differs: q has d={q.shape[2]}, k has "
            f"d={k.shape[2]}"
        )
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"attention_varlen: q has H={q.shape[1]} heads, which is not a multiple of "
            f"k and v's H_kv={k.shape[1]}"
        )
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise TypeError(
            f"attention_varlen: q, k and v must share one floating dtype, got {q.dtype}, "
            f"{k.dtype} and {v.dtype}"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"attention_varlen: q, k and v must be on one device, got {q.device}, "
            f"{k.device} and {v.device}"
        )


def _check_cu(cu, arg: str, total: int, device) -> list[int]:
    """cu_seqlens as a list of ints, after checking dtype, shape, device, start, order and end."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"attention_varlen: {arg} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"attention_varlen: {arg} must have dtype int32 (or int64), got {cu.dtype}")
    if cu.ndim != 1 or cu.numel() < 2:
        raise ValueError(
            f"attention_varlen: {arg} must be 1-D with n + 1 >= 2 entries (n sequences), "
            f"got shape {tuple(cu.shape)}"
        )
    if cu.device != device:
        raise ValueError(
            f"attention_varlen: {arg} must be on the device of q, {device}, got {cu.device}"
        )
    bounds = cu.tolist()
    if bounds[0] != 0:
        raise ValueError(
            f"attention_varlen: {arg} must start at 0, got {bounds[0]} ({arg}={bounds})"
        )
    if any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(
            f"attention_varlen: {arg} must be non-decreasing (lengths >= 0), got {bounds}"
        )
    if bounds[-1] != total:
        raise ValueError(
            f"attention_varlen: {arg} ends at {bounds[-1]}, but the packed tensor holds "
            f"{total} tokens (its first dimension)"
        )
    return bounds


def _check_max(max_seqlen, arg: str, bounds: list[int]) -> None:
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
        raise TypeError(f"attention_varlen: {arg} must be an int, got {max_seqlen!r}")
    if max_seqlen < longest:
        raise ValueError(
            f"attention_varlen: {arg}={max_seqlen} is shorter than the longest sequence, "
            f"{longest} tokens"
        )


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """Validate packed inputs; return the boundaries (cu_q, cu_k) as lists of ints."""
    _check_tensors(q, k, v)
    cu_q = _check_cu(cu_seqlens_q, "cu_seqlens_q", q.shape[0], q.device)
    cu_k = _check_cu(cu_seqlens_k, "cu_seqlens_k", k.shape[0], q.device)
    if len(cu_q) != len(cu_k):
        raise ValueError(
            f"attention_varlen: cu_seqlens_q describes {len(cu_q) - 1} sequences and "
            f"cu_seqlens_k {len(cu_k) - 1}; they must describe the same sequences"
        )
    _check_max(max_seqlen_q, "max_seqlen_q", cu_q)
    _check_max(max_seqlen_k, "max_seqlen_k", cu_k)
    return cu_q, cu_k


# ------------------------------------------------ paged KV caches and attention sinks (serving)
def _as_ints(x, arg: str, ndim: int, name: str) -> np.ndarray:
    """An integer array or tensor of `ndim` dims, as a NumPy int64 array (read on the host)."""
    if _is_torch(x):
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise TypeError(f"{name}: {arg} must hold integers (torch.int32), got {x.dtype}")
        values = x.detach().cpu().numpy()
    elif isinstance(x, np.ndarray):
        if not np.issubdtype(x.dtype, np.integer):
            raise TypeError(f"{name}: {arg} must hold integers (int32), got {x.dtype}")
        values = x
    else:
        got = "None" if x is None else type(x).__name__
        raise TypeError(f"{name}: {arg} must be an integer array or tensor, got {got}")
    if values.ndim != ndim:
        raise ValueError(f"{name}: {arg} must have {ndim} dims, got shape {tuple(values.shape)}")
    return values.astype(np.int64)


def check_block_table(
    block_table,
    cache_seqlens,
    *,
    num_pages: int,
    page_size: int,
    B: int | None = None,
    name: str = "paged attention",
) -> list[int]:
    """A paged KV cache's block table, checked against the page pool it points into; returns the
    lengths as a list of ints.

    block_table: integers of shape (B, max_pages): row b lists, in order, the physical pages that
    hold sequence b's keys 0..page_size-1, page_size..2*page_size-1, ... Only the first
    ceil(len_b / page_size) entries of a row are read; the rest may hold anything (-1, say).
    cache_seqlens: integers of shape (B,), each in [0, max_pages * page_size].
    Pages read must lie in [0, num_pages) and appear once per row; rows may share pages (a shared
    prompt prefix). NumPy arrays or torch tensors (read on the host: the check costs a copy of the
    table, which is small).
    """
    page_size = check_int(page_size, "page_size", name=name)
    num_pages = check_int(num_pages, "num_pages", name=name)
    table = _as_ints(block_table, "block_table", 2, name)
    lens = _as_ints(cache_seqlens, "cache_seqlens", 1, name)
    rows, width = table.shape
    if B is not None and rows != B:
        raise ValueError(
            f"{name}: block_table must have B = {B} rows one per sequence:, got {rows}"
        )
    if lens.shape != (rows,):
        raise ValueError(
            f"{name}: cache_seqlens must have shape (B,) = ({rows},), got {tuple(lens.shape)}"
        )
    for b, n in enumerate(lens.tolist()):
        if n < 0 or n > width * page_size:
            raise ValueError(
                f"{name}: cache_seqlens[{b}] = {n} must lie in [0, {width * page_size}]: "
                f"block_table holds {width} pages of {page_size} keys per sequence"
            )
        used = table[b, : -(-n // page_size)]
        bad = used[(used < 0) | (used >= num_pages)]
        if bad.size:
            raise ValueError(
                f"{name}: block_table[{b}] names page {int(bad[0])}, outside the pool's "
                f"{num_pages} pages [0, {num_pages}) (it holds {n} keys)"
            )
        seen, counts = np.unique(used, return_counts=True)
        if (counts > 1).any():
            raise ValueError(
                f"{name}: block_table[{b}] names page {int(seen[counts > 1][0])} twice: each "
                "page holds different keys of a sequence"
            )
    return [int(n) for n in lens.tolist()]


def check_sinks(sinks, H: int, *, name: str = "attention"):
    """None, or attention sinks: one logit per query head, shape (H,), floating point, finite or
    -inf (a head without a sink); the sink joins every softmax row of its head as one extra column
    with no value. Returned unchanged."""
    if sinks is None:
        return None
    _check_array(sinks, "sinks", name, None)
    if _shape(sinks) != (H,):
        raise ValueError(
            f"{name}: sinks must have shape (H,) = ({H},), one logit per query head, "
            f"got {_shape(sinks)}"
        )
    floating = (
        sinks.dtype.is_floating_point
        if _is_torch(sinks)
        else np.issubdtype(np.asarray(sinks).dtype, np.floating)
    )
    if not floating:
        raise TypeError(f"{name}: sinks must be floating point (float32), got {sinks.dtype}")
    values = (
        sinks.detach().double().cpu().numpy() if _is_torch(sinks) else np.asarray(sinks, np.float64)
    )
    if np.isnan(values).any() or (values == np.inf).any():
        raise ValueError(f"{name}: sinks must be finite or -inf (no sink), got {values.tolist()}")
    return sinks
