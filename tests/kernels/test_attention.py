"""The Triton kernels against the float64 reference, forward and backward.

On a machine without CUDA these run under TRITON_INTERPRET=1 (set by flashedu._env) with 16x16
tiles, so every shape below crosses several tiles and ends on a ragged one. Tests marked `gpu` need
a CUDA device.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashedu import IMPLEMENTATIONS, autograd, kernels, masks, reference
from flashedu.kernels import launch
from flashedu.kernels import launch as triton_launch
from flashedu.testing import Tolerance, assert_close, max_error, random_qkv

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0:DeprecationWarning"
)
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (CPU runs the interpreter)"
)
DEVICE = (
    "cuda" if torch.cuda.is_available() else "cpu"
)  # the kernels take CUDA tensors on a GPU machine


@pytest.fixture
def make_qkv(rng):
    """conftest's fresh seeded draw, as torch tensors on the kernels' device."""

    def make(B, H, N_q, N_k, d, dtype="float32", *, H_kv=None, kind="torch", scale=1.0):
        return random_qkv(
            B, H, N_q, N_k, d, dtype, H_kv=H_kv, seed=rng, kind="torch", device=DEVICE, scale=scale
        )

    return make


def _grad_out(rng, o):
    return torch.from_numpy(rng.standard_normal(tuple(o.shape))).to(device=o.device, dtype=o.dtype)


def _check(make_qkv, rng, B, H, H_kv, N_q, N_k, d, dtype, *, scale=1.0, **opts):
    """Forward and backward against reference.forward / reference.backward; returns the outputs."""
    q, k, v = make_qkv(B, H, N_q, N_k, d, dtype, H_kv=H_kv, kind="torch", scale=scale)
    o, lse = kernels.forward(q, k, v, **opts)
    o_ref, lse_ref = reference.forward(q, k, v, **opts)
    assert (
        o.dtype == q.dtype
        and o.shape == q.shape
        and lse.dtype == torch.float32
        and lse.shape == (B, H, N_q)
    )
    assert_close(o, o_ref, dtype=dtype, name="o")
    assert_close(lse, lse_ref, dtype="float32", name="lse")
    do = _grad_out(rng, o)
    grads = kernels.backward(do, q, k, v, o, lse, **opts)
    for name, g, g_ref, x in zip(
        ("dq", "dk", "dv"), grads, reference.backward(do, q, k, v, **opts), (q, k, v)
    ):
        assert g.dtype == x.dtype and g.shape == x.shape, name
        assert_close(g, g_ref, dtype=dtype, grad=True, name=name)
    return o, lse, grads


# (B, H, H_kv, N_q, N_k, d, dtype, causal): ragged lengths, N_q != N_k both ways, every head dim the
# CPU can afford.
CASES = [
    (1, 2, 2, 1, 1, 16, "float32", False),
    (1, 1, 1, 1, 17, 16, "float32", True),
    (2, 3, 3, 17, 17, 16, "float32", True),
    (1, 2, 2, 33, 65, 32, "float32", True),
    (1, 2, 2, 65, 33, 32, "float32", True),  # N_q > N_k: the first 32 rows see nothing
    (1, 2, 2, 97, 97, 64, "float16", False),
    (1, 2, 2, 50, 97, 64, "float16", True),
    (1, 1, 1, 40, 70, 128, "float32", False),
    (1, 1, 1, 33, 33, 128, "float16", True),
    (1, 2, 2, 48, 31, 32, "bfloat16", False),
    (1, 2, 2, 33, 48, 64, "bfloat16", True),
    (1, 1, 1, 18, 20, 256, "float32", True),
]


@pytest.mark.parametrize("B,H,H_kv,N_q,N_k,d,dtype,causal", CASES)
def test_forward_and_backward_match_reference(
    B, H, H_kv, N_q, N_k, d, dtype, causal, make_qkv, rng
):
    _check(make_qkv, rng, B, H, H_kv, N_q, N_k, d, dtype, causal=causal)


@pytest.mark.parametrize(
    "H,H_kv,dtype,causal",
    [(4, 2, "float32", True), (4, 1, "float16", False), (6, 3, "float32", False)],
)
def test_gqa_and_mqa_sum_key_gradients_over_the_group(H, H_kv, dtype, causal, make_qkv, rng):
    _check(make_qkv, rng, 2, H, H_kv, 33, 47, 16, dtype, causal=causal)


@pytest.mark.parametrize(
    "N_q,N_k,window,causal",
    [
        (50, 50, (5, 3), False),
        (40, 64, (8, -1), True),  # causal plus a left window: the usual sliding-window attention
        (64, 40, (-1, 4), False),  # N_q > N_k: the first rows see only a few keys
        (33, 33, (0, 0), False),  # each query sees exactly its diagonal key
        (70, 30, (3, 0), False),  # rows more than 3 left of every key see nothing
    ],
)
def test_sliding_window_matches_reference(N_q, N_k, window, causal, make_qkv, rng):
    _check(make_qkv, rng, 1, 2, 2, N_q, N_k, 16, "float32", causal=causal, window_size=window)


@pytest.mark.parametrize("causal,window", [(False, None), (True, (20, -1))])
def test_alibi_matches_reference(causal, window, make_qkv, rng):
    _check(
        make_qkv,
        rng,
        1,
        4,
        2,
        37,
        45,
        16,
        "float32",
        causal=causal,
        window_size=window,
        alibi_slopes=masks.alibi_slopes(4),
    )


def test_alibi_slopes_per_batch_match_reference_batch_by_batch(make_qkv, rng):
    q, k, v = make_qkv(2, 2, 30, 40, 16, "float32", kind="torch")
    slopes = rng.uniform(0.05, 1.0, size=(2, 2))
    o, lse = kernels.forward(q, k, v, causal=True, alibi_slopes=slopes)
    do = _grad_out(rng, o)
    grads = kernels.backward(do, q, k, v, o, lse, causal=True, alibi_slopes=slopes)
    for b in range(2):
        sl = slice(b, b + 1)
        o_ref, lse_ref = reference.forward(q[sl], k[sl], v[sl], causal=True, alibi_slopes=slopes[b])
        assert_close(o[sl], o_ref, dtype="float32", name=f"o[{b}]")
        assert_close(lse[sl], lse_ref, dtype="float32", name=f"lse[{b}]")
        g_ref = reference.backward(do[sl], q[sl], k[sl], v[sl], causal=True, alibi_slopes=slopes[b])
        for name, g, r in zip(("dq", "dk", "dv"), grads, g_ref):
            assert_close(g[sl], r, dtype="float32", grad=True, name=f"{name}[{b}]")


def test_fully_masked_rows_are_zero_not_nan(make_qkv, rng):
    o, lse, (dq, dk, dv) = _check(make_qkv, rng, 1, 2, 2, 40, 21, 16, "float16", causal=True)
    empty = torch.from_numpy(~masks.visible(40, 21, causal=True).any(axis=1)).to(
        o.device
    )  # the first 19 rows
    assert empty.sum() == 19
    assert torch.all(o[:, :, empty] == 0) and torch.all(dq[:, :, empty] == 0)
    assert torch.all(torch.isneginf(lse[:, :, empty])) and torch.isfinite(lse[:, :, ~empty]).all()
    assert all(torch.isfinite(g).all() for g in (o, dq, dk, dv))


def test_huge_logits_stay_finite_and_as_exact_as_torch_fp32(make_qkv, rng):
    """Logits near +-1e4 in fp32: error no worse than twice PyTorch's own fp32 attention on the same
    inputs."""
    q, k, v = make_qkv(1, 2, 33, 40, 16, "float32", kind="torch")
    scale = 1e4 / 16  # |q.k| ~ 4, so logits ~ 1e4
    o, lse = kernels.forward(q, k, v, causal=True, softmax_scale=scale)
    o_ref, _ = reference.forward(q, k, v, causal=True, softmax_scale=scale)
    mask = torch.from_numpy(masks.visible(33, 40, causal=True)).to(DEVICE)
    o_torch = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    assert max_error(o, o_ref)[0] <= 2 * max_error(o_torch, o_ref)[0] + 1e-5


@pytest.mark.parametrize("softmax_scale", [0.01, 3.0, -0.3])
def test_softmax_scale_far_from_default_and_negative(softmax_scale, make_qkv, rng):
    _check(make_qkv, rng, 1, 1, 1, 20, 35, 16, "float32", causal=True, softmax_scale=softmax_scale)


def test_strided_views_give_the_same_answer(make_qkv, rng):
    """(B, N, H, d) memory seen as (B, H, N, d), and a tensor strided along d (copied once)."""
    q, k, v = make_qkv(1, 2, 20, 24, 16, "float32", kind="torch")
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # strides of a (B, N, H, d) buffer
    vt = v.transpose(-1, -2).contiguous().transpose(-1, -2)  # stride along d is not 1
    o, lse = kernels.forward(qt, k, vt, causal=True)
    o2, lse2 = kernels.forward(q, k, v, causal=True)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
    do = _grad_out(rng, o)
    for g, g2 in zip(
        kernels.backward(do, qt, k, vt, o, lse, causal=True),
        kernels.backward(do, q, k, v, o2, lse2, causal=True),
    ):
        assert torch.equal(g, g2)


def test_explicit_block_sizes_agree_with_the_default(make_qkv):
    q, k, v = make_qkv(1, 1, 45, 70, 32, "float32", kind="torch")
    o, lse = kernels.forward(q, k, v, causal=True)
    o32, lse32 = kernels.forward(q, k, v, causal=True, block_m=32, block_n=64)
    assert_close(o32, o, dtype="float32", name="o")
    assert_close(lse32, lse, dtype="float32", name="lse")


def test_attention_autograd_gradients_match_reference(make_qkv, rng):
    q, k, v = (
        x.requires_grad_() for x in make_qkv(1, 2, 21, 30, 16, "float32", H_kv=1, kind="torch")
    )
    o = autograd.flash_attention(q, k, v, causal=True, window_size=(6, -1), impl="triton")
    do = _grad_out(rng, o)
    o.backward(do)
    for name, x, g_ref in zip(
        "qkv", (q, k, v), reference.backward(do, q, k, v, causal=True, window_size=(6, -1))
    ):
        assert_close(x.grad, g_ref, dtype="float32", grad=True, name="d" + name)


def test_registry_entry_runs_the_kernels(make_qkv):
    impl = IMPLEMENTATIONS["triton"]
    assert impl.module is kernels and {"gqa", "window", "alibi"} <= impl.features
    q, k, v = make_qkv(1, 1, 17, 17, 16, "float32", kind="torch")
    o, lse = impl.forward(q, k, v, causal=True)
    assert_close(o, reference.forward(q, k, v, causal=True)[0], dtype="float32")


# ---- every error path names the argument and the value -------------------------------------------
def _qkv(d=16, dtype=torch.float32, N_q=8, N_k=8, H=2, H_kv=2, device=DEVICE):
    return tuple(
        torch.randn(1, h, n, d, dtype=dtype, device=device)
        for h, n in ((H, N_q), (H_kv, N_k), (H_kv, N_k))
    )


@pytest.mark.parametrize(
    "make,kw,err,match",
    [
        (
            lambda: _qkv(dtype=torch.float64),
            {},
            TypeError,
            "dtype must be float16, bfloat16 or float32, got torch.float64",
        ),
        (lambda: _qkv(d=257), {}, ValueError, r"head dimension d=257 .* expected 1 to 256"),
        (
            lambda: (*_qkv()[:2], torch.randn(1, 2, 8, 300, device=DEVICE)),
            {},
            ValueError,
            "head dimension d_v=300",
        ),
        (
            lambda: (*_qkv()[:2], torch.randn(1, 2, 9, 16, device=DEVICE)),
            {},
            ValueError,
            r"k and v must have the same shape up to the head dim",
        ),
        (
            lambda: _qkv(H=3, H_kv=2),
            {},
            ValueError,
            "H=3 heads, which is not a multiple of k and v's H_kv=2",
        ),
        (
            lambda: (torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 9, 16)),
            {},
            ValueError,
            "k and v must have the same shape",
        ),
        (
            lambda: (torch.randn(2, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)),
            {},
            ValueError,
            r"q must have shape \(B, H, N, d\)",
        ),
        (
            lambda: tuple(x.cpu().numpy() for x in _qkv()),
            {},
            TypeError,
            "q must be a torch.Tensor, got numpy.ndarray",
        ),
        (
            lambda: _qkv(),
            {"alibi_slopes": [0.5, 0.5, 0.5]},
            ValueError,
            r"alibi_slopes must have shape \(H,\) = \(2,\)",
        ),
        (
            lambda: _qkv(),
            {"alibi_slopes": [0.5, float("nan")]},
            ValueError,
            "alibi_slopes must be finite",
        ),
        (lambda: _qkv(), {"window_size": (2, -3)}, ValueError, "window_size entries must be >= 0"),
        (lambda: _qkv(), {"window_size": 4}, TypeError, "window_size must be a pair"),
        (
            lambda: _qkv(),
            {"softmax_scale": float("inf")},
            ValueError,
            "softmax_scale must be finite",
        ),
        (lambda: _qkv(), {"block_m": 8}, ValueError, "block_m must be a power of two >= 16, got 8"),
        (
            lambda: _qkv(),
            {"block_n": 48},
            ValueError,
            "block_n must be a power of two >= 16, got 48",
        ),
    ],
)
def test_forward_rejects_bad_input_by_name(make, kw, err, match):
    q, k, v = make()
    with pytest.raises(err, match=match):
        kernels.forward(q, k, v, **kw)


def test_cpu_tensors_are_refused_when_kernels_compile_for_a_gpu(monkeypatch):
    monkeypatch.setattr(triton_launch, "INTERPRETER", False)
    with pytest.raises(ValueError, match="must be CUDA tensors on a GPU machine, got device cpu"):
        kernels.forward(*_qkv(device="cpu"))


@pytest.mark.parametrize(
    "change,err,match",
    [
        (
            lambda t: dict(t, lse=t["lse"][:, :, :-1]),
            ValueError,
            r"lse must have shape \(B, H, N_q\)",
        ),
        (lambda t: dict(t, lse=t["lse"].double()), TypeError, "lse must be float32"),
        (lambda t: dict(t, do=t["do"].half()), TypeError, "do must have q's dtype"),
        (lambda t: dict(t, o=t["o"][:, :1]), ValueError, "o must have q's shape"),
    ],
)
def test_backward_rejects_bad_input_by_name(change, err, match):
    q, k, v = _qkv()
    o, lse = kernels.forward(q, k, v)
    t = change(dict(do=torch.randn_like(o), o=o, lse=lse))
    with pytest.raises(err, match=match):
        kernels.backward(t["do"], q, k, v, t["o"], t["lse"])


# ---- on a GPU: the compiled kernels, autotuned, on sizes the interpreter cannot afford -----------
@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_kernels_match_reference_at_1k(dtype, causal, rng):
    q, k, v = random_qkv(
        1, 4, 1000, 1100, 128, dtype, H_kv=2, seed=rng, kind="torch", device="cuda"
    )
    o, lse = kernels.forward(q, k, v, causal=causal)
    o_ref, lse_ref = reference.forward(q, k, v, causal=causal)
    assert_close(o, o_ref, dtype=dtype, name="o")
    assert_close(lse, lse_ref, dtype="float32", name="lse")
    do = torch.randn_like(o)
    for g, g_ref in zip(
        kernels.backward(do, q, k, v, o, lse, causal=causal),
        reference.backward(do, q, k, v, causal=causal),
    ):
        assert_close(g, g_ref, dtype=dtype, grad=True)


@gpu
@needs_cuda
def test_gpu_refuses_cpu_tensors():
    with pytest.raises(ValueError, match="got device cpu"):
        kernels.forward(*_qkv(device="cpu"))


# ---- the teaching kernels and the host twin of the kernels' block ranges -------------------------
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from flashedu import decoding  # noqa: E402
from flashedu.kernels import bwd as tb  # noqa: E402
from flashedu.kernels import common as triton_common  # noqa: E402
from flashedu.kernels import intro as ti  # noqa: E402


@triton.jit
def _ranges_kernel(
    OUT,
    N_q,
    N_k,
    LEFT,
    RIGHT,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    first = tl.program_id(0) * BLOCK_M
    last = tl.minimum(first + BLOCK_M, N_q) - 1
    lo, full_lo, full_hi, hi = triton_common.block_range(
        first, last, N_k, N_k - N_q, LEFT, RIGHT, HAS_LEFT, HAS_RIGHT, BLOCK_N
    )
    tl.store(
        OUT + tl.program_id(0) * 4 + tl.arange(0, 4),
        tl.where(
            tl.arange(0, 4) == 0,
            lo,
            tl.where(tl.arange(0, 4) == 1, full_lo, tl.where(tl.arange(0, 4) == 2, full_hi, hi)),
        ),
    )


@pytest.mark.parametrize(
    "N_q,N_k,causal,window",
    [
        (70, 70, True, None),
        (37, 90, True, None),
        (90, 37, True, None),
        (64, 64, False, None),
        (50, 81, False, (7, 20)),
        (81, 50, True, (10, -1)),
        (40, 40, False, (0, 0)),
        (30, 90, False, (-1, 3)),
    ],
)
def test_kernel_block_ranges_equal_the_host_twin_and_the_visibility_rule(N_q, N_k, causal, window):
    bm, bn = 16, 32
    bounds = launch.check_inputs(
        *_qkv(16, torch.float32, N_q, N_k, 1, 1), causal, None, window, None, "test"
    )[2]
    has_left, left, has_right, right = bounds
    out = torch.zeros(triton.cdiv(N_q, bm) * 4, dtype=torch.int32, device=DEVICE)
    _ranges_kernel[(triton.cdiv(N_q, bm),)](
        out, N_q, N_k, left, right, HAS_LEFT=has_left, HAS_RIGHT=has_right, BLOCK_M=bm, BLOCK_N=bn
    )
    kinds = decoding.block_map(N_q, N_k, bm, bn, causal=causal, window_size=window)
    for i, got in enumerate(out.view(-1, 4).tolist()):
        first, last = i * bm, min(i * bm + bm, N_q) - 1
        lo, full_lo, full_hi, hi = ti.kv_range(
            first, last, N_q, N_k, bn, causal=causal, window_size=window
        )
        assert got == [lo, full_lo, full_hi, hi], (i, got)
        for j, kind in enumerate(kinds[i]):
            c = j * bn
            if c < lo or c >= hi:
                assert kind == "skip", (i, j)
            elif full_lo <= c < full_hi:
                assert kind == "full", (i, j)
            else:
                # a mask edge, or the ragged last block
                # (visible, but its loads need the bounds mask)
                assert kind == "partial" or c + bn > N_k, (i, j, kind)


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (4, 9))])
def test_teaching_kernels_give_reference_scores_and_probabilities(causal, window, make_qkv):
    q, k, _ = make_qkv(1, 1, 37, 50, 32, "float32", kind="torch")
    p_ref, lse = reference.probabilities(q, k, causal=causal, window_size=window)
    keep = masks.visible(37, 50, causal=causal, window_size=window)
    s_ref = np.where(
        keep,
        q[0, 0].double().cpu().numpy() @ k[0, 0].double().cpu().numpy().T / np.sqrt(32),
        -np.inf,
    )
    assert_close(
        ti.scores(q[0, 0], k[0, 0], causal=causal, window_size=window), s_ref, dtype="float32"
    )
    p = ti.probabilities(
        q[0, 0], k[0, 0], torch.from_numpy(lse[0, 0]).to(DEVICE), causal=causal, window_size=window
    )
    assert_close(p, p_ref[0, 0], dtype="float32")


def test_probabilities_of_rows_that_see_nothing_are_zero_not_nan(make_qkv):
    q, k, _ = make_qkv(1, 1, 40, 21, 16, "float16", kind="torch")
    _, lse = reference.probabilities(q, k, causal=True)
    p = ti.probabilities(q[0, 0], k[0, 0], torch.from_numpy(lse[0, 0]).to(DEVICE), causal=True)
    assert not torch.isnan(p).any() and torch.all(p[:19] == 0)
    with pytest.raises(ValueError, match=r"lse must have shape \(N_q,\) = \(40,\)"):
        ti.probabilities(q[0, 0], k[0, 0], torch.zeros(39, device=DEVICE))
    with pytest.raises(ValueError, match="must be 2D"):
        ti.scores(q, k)


def test_preprocess_is_the_row_sum_of_do_times_o(make_qkv, rng):
    o, do, _ = make_qkv(2, 3, 70, 70, 64, "float16", kind="torch")
    delta = tb.preprocess(o, do)
    assert delta.dtype == torch.float32 and delta.shape == (2, 3, 70)
    assert_close(delta, (o.double() * do.double()).sum(-1), tol=Tolerance(1e-5, 1e-6))
    with pytest.raises(ValueError, match="must share a"):
        tb.preprocess(o, do[:, :, :5])


# ---- the GPU check's own pieces, on whatever device is here --------------------------------------
def test_gpu_check_oracle_matches_reference_and_grades_a_case():
    from flashedu.bench import gpu_check

    assert gpu_check.self_check() < 1e-12
    case = dict(
        dtype="float16",
        d=16,
        causal=True,
        N_q=40,
        N_k=21,
        B=1,
        H=2,
        H_kv=1,
        window=None,
        alibi=False,
    )
    fwd, bwd = gpu_check.check_case(case)
    assert (fwd["pass"], bwd["pass"]) == ("fwd", "bwd") and fwd["ok"] and bwd["ok"], (fwd, bwd)
    assert (
        fwd["within_tolerance"] and bwd["worst"] in ("dq", "dk", "dv") and fwd["extra"] == "gqa 2/1"
    )
    cases = gpu_check.matrix()
    assert {c["dtype"] for c in cases} == {"float16", "bfloat16", "float32"} and {
        16,
        32,
        64,
        128,
        256,
    } <= {c["d"] for c in cases}
    assert any(c["N_q"] > c["N_k"] and c["causal"] for c in cases) and any(
        c["window"] for c in cases
    )


def test_bench_table_reports_ratios_from_the_same_rows():
    from flashedu.bench import gpu as bench_gpu

    rows = [
        {
            "impl": i,
            "dtype": "bfloat16",
            "d": 128,
            "causal": True,
            "N": 8192,
            "pass": "fwd",
            "tflops": t,
        }
        for i, t in (("flashedu-triton", 450.0), ("sdpa-flash", 300.0), ("sdpa-cudnn", 600.0))
    ]
    line = bench_gpu.table(rows).splitlines()[1].split()
    assert line[-2:] == ["1.50", "0.75"]
