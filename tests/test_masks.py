"""Sliding windows, ALiBi and GQA in every registered implementation that declares them, against the
float64 reference fed the explicit mask, bias or repeated K/V heads; forward and backward.

An implementation whose module does not exist yet is skipped with the reason. Block skipping is
checked too: the tiles `tiled` skips are exactly those `decoding.block_kind` finds fully masked.
"""

import numpy as np
import pytest
import torch

from flashedu import IMPLEMENTATIONS, decoding, masks, reference, softmax, traffic
from flashedu.testing import assert_close, convert, random_qkv, to_numpy

# triton 3.6's interpreter converts 1-element arrays to int in a way NumPy 2 deprecates; not our
# code
pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0:DeprecationWarning"
)


def _with(feature):
    return [name for name, impl in IMPLEMENTATIONS.items() if feature in impl.features]


def _impl(name):
    impl = IMPLEMENTATIONS[name]
    try:
        impl.module
    except ModuleNotFoundError as e:
        pytest.skip(f"impl {name!r} cannot be loaded here: {e}")
    return impl


def _inputs(impl, B, H, N_q, N_k, d, rng, H_kv=None):
    """Fresh inputs as float64 NumPy (for the reference) and in the implementation's kind and best
    dtype."""
    dtype = "float64" if "float64" in impl.dtypes else "float32"
    q, k, v, do = (
        convert(x, dtype)
        for x in random_qkv(B, H, N_q, N_k, d, "float64", H_kv=H_kv, seed=rng)
        + (rng.standard_normal((B, H, N_q, d)),)
    )
    device = (
        "cuda" if torch.cuda.is_available() else "cpu"
    )  # CPU tensors run Triton under the interpreter
    cast = (
        (lambda x: x)
        if impl.kind == "numpy"
        else (lambda x: convert(x, dtype, kind="torch", device=device))
    )
    return dtype, (q, k, v, do), tuple(cast(x) for x in (q, k, v, do))


def _explicit(q, k, v, keep, bias=0.0):
    """Attention with the mask and bias spelled out as (N_q, N_k) arrays, in float64."""
    q, k, v = (to_numpy(x) for x in (q, k, v))
    s = np.einsum("bhid,bhjd->bhij", q, k) / np.sqrt(q.shape[-1]) + bias
    s = np.where(keep, s, -np.inf)
    return np.einsum("bhij,bhjd->bhid", softmax.safe_softmax(s), v)


def _check(impl, dtype, args, extras, o_ref, lse_ref, grads_ref):
    q, k, v, do = args
    o, lse = impl.forward(q, k, v, **extras)
    assert_close(o, o_ref, dtype, name=f"{impl.name} o")
    assert_close(lse, lse_ref, dtype if dtype == "float64" else "float32", name=f"{impl.name} lse")
    grads = impl.backward(do, q, k, v, o, lse, **extras)
    for g_name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert_close(g, g_ref, dtype, grad=True, name=f"{impl.name} {g_name}")


WINDOWS = [  # (N_q, N_k, window_size, causal)
    (17, 33, (4, 0), False),
    (33, 17, (2, 0), False),  # rows 0..15 see nothing
    (20, 20, (0, 3), False),
    (9, 40, (5, -1), True),
    (24, 24, (-1, 2), False),
    (1, 29, (6, 6), True),
]


@pytest.mark.parametrize("N_q,N_k,window_size,causal", WINDOWS)
@pytest.mark.parametrize("name", _with("window"))
def test_window_matches_reference_with_an_explicit_mask(name, N_q, N_k, window_size, causal, rng):
    impl = _impl(name)
    dtype, (q, k, v, do), args = _inputs(impl, 1, 2, N_q, N_k, 16, rng)
    keep = masks.visible(N_q, N_k, causal=causal, window_size=window_size)
    o_ref, lse_ref = reference.forward(q, k, v, attn_mask=keep)
    np.testing.assert_allclose(
        np.nan_to_num(o_ref), _explicit(q, k, v, keep), rtol=1e-12, atol=1e-13
    )
    _check(
        impl,
        dtype,
        args,
        dict(causal=causal, window_size=window_size),
        o_ref,
        lse_ref,
        reference.backward(do, q, k, v, attn_mask=keep),
    )


@pytest.mark.parametrize(
    "N_q,N_k,causal,window_size",
    [(17, 33, False, None), (33, 17, True, None), (12, 12, True, (5, 0))],
)
@pytest.mark.parametrize("name", _with("alibi"))
def test_alibi_matches_reference_with_an_explicit_bias(name, N_q, N_k, causal, window_size, rng):
    impl = _impl(name)
    H = 4
    dtype, (q, k, v, do), args = _inputs(impl, 2, H, N_q, N_k, 16, rng)
    slopes = masks.alibi_slopes(H)
    keep = masks.visible(N_q, N_k, causal=causal, window_size=window_size)
    o_ref, lse_ref = reference.forward(q, k, v, alibi_slopes=slopes, attn_mask=keep)
    explicit = _explicit(q, k, v, keep, masks.alibi_bias(slopes, N_q, N_k)[None])
    np.testing.assert_allclose(np.nan_to_num(o_ref), explicit, rtol=1e-12, atol=1e-13)
    _check(
        impl,
        dtype,
        args,
        dict(causal=causal, window_size=window_size, alibi_slopes=slopes),
        o_ref,
        lse_ref,
        reference.backward(do, q, k, v, alibi_slopes=slopes, attn_mask=keep),
    )


@pytest.mark.parametrize(
    "H,H_kv,N_q,N_k,causal", [(4, 2, 17, 33, False), (6, 1, 33, 17, True), (4, 4, 5, 5, True)]
)
@pytest.mark.parametrize("name", _with("gqa"))
def test_gqa_matches_reference_on_repeated_heads(name, H, H_kv, N_q, N_k, causal, rng):
    impl = _impl(name)
    dtype, (q, k, v, do), args = _inputs(impl, 2, H, N_q, N_k, 16, rng, H_kv=H_kv)
    k_rep, v_rep = (
        np.repeat(k, H // H_kv, axis=1),
        np.repeat(v, H // H_kv, axis=1),
    )  # every head its own K/V
    o_ref, lse_ref = reference.forward(q, k_rep, v_rep, causal=causal)
    dq, dk, dv = reference.backward(do, q, k_rep, v_rep, causal=causal)
    fold = lambda g: g.reshape(2, H_kv, H // H_kv, N_k, 16).sum(axis=2)
    _check(impl, dtype, args, dict(causal=causal), o_ref, lse_ref, (dq, fold(dk), fold(dv)))


@pytest.mark.parametrize(
    "N_q,N_k,block_m,block_n,causal,window_size",
    [
        (33, 33, 8, 8, True, None),
        (17, 45, 4, 8, False, (6, 2)),
        (40, 12, 8, 4, True, (3, -1)),
        (29, 29, 16, 4, False, (0, 0)),
    ],
)
def test_tiled_skips_exactly_the_blocks_block_kind_finds_hidden(
    N_q, N_k, block_m, block_n, causal, window_size
):
    tiled = _impl("tiled").module
    q, k, v = random_qkv(1, 1, N_q, N_k, 8, "float32", seed=0)
    ledger = traffic.Ledger()
    tiled.forward(
        q,
        k,
        v,
        causal=causal,
        window_size=window_size,
        block_m=block_m,
        block_n=block_n,
        ledger=ledger,
    )
    assert ledger.steps
    for st in ledger.steps:
        kind = decoding.block_kind(
            st["rows"], st["cols"], N_q, N_k, causal=causal, window_size=window_size
        )
        assert st["skipped"] == (kind == "skip"), (st["rows"], st["cols"], kind)
    expected = decoding.block_map(
        N_q, N_k, block_m, block_n, causal=causal, window_size=window_size
    )
    assert sum(st["skipped"] for st in ledger.steps) == (expected == "skip").sum()


def test_masked_rows_give_zero_output_in_every_window_implementation(rng):
    for name in _with("window"):
        impl = IMPLEMENTATIONS[name]
        try:
            impl.module
        except ModuleNotFoundError:
            continue
        _, _, (q, k, v, _) = _inputs(impl, 1, 2, 33, 17, 16, rng)
        o, lse = impl.forward(q, k, v, window_size=(2, 0))
        assert (to_numpy(o)[:, :, :16] == 0).all() and np.isneginf(
            to_numpy(lse)[:, :, :16]
        ).all(), name
