"""Split-KV decoding (NumPy and Triton) against the float64 reference; the block-visibility rule
against `masks.visible`; skipped splits never read; the Triton combine kernel against
`softmax.merge`."""

import functools

import numpy as np
import pytest
import torch

from flashedu import decoding, masks, reference, softmax
from flashedu.testing import assert_close, convert

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU tensors run under the interpreter

# triton 3.6's interpreter converts 1-element arrays to int in a way NumPy 2 deprecates;
# not our code
pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0:DeprecationWarning"
)


@pytest.mark.parametrize("N_q,N_k", [(1, 1), (4, 4), (3, 11), (11, 3), (1, 13)])
@pytest.mark.parametrize(
    "causal,window_size",
    [
        (False, None),
        (True, None),
        (False, (2, 1)),
        (True, (3, -1)),
        (False, (-1, 0)),
        (False, (0, 0)),
    ],
)
def test_block_kind_and_block_visible_agree_with_masks_visible(N_q, N_k, causal, window_size):
    full = masks.visible(N_q, N_k, causal=causal, window_size=window_size)
    for r0 in range(N_q):
        for r1 in range(r0 + 1, N_q + 1):
            for c0 in range(N_k):
                for c1 in range(c0 + 1, N_k + 1):
                    sub = full[r0:r1, c0:c1]
                    expected = "skip" if not sub.any() else "full" if sub.all() else "partial"
                    kw = dict(causal=causal, window_size=window_size)
                    assert decoding.block_kind((r0, r1), (c0, c1), N_q, N_k, **kw) == expected
                    assert (decoding.block_visible((r0, r1), (c0, c1), N_q, N_k, **kw) == sub).all()


def test_block_map_of_a_causal_square_is_lower_triangular():
    kinds = decoding.block_map(8, 8, 2, 2, causal=True)
    assert kinds.shape == (4, 4)
    assert (np.diag(kinds) == "partial").all()
    assert (kinds[np.tril_indices(4, -1)] == "full").all() and (
        kinds[np.triu_indices(4, 1)] == "skip"
    ).all()


def test_split_bounds_cover_the_cache_contiguously():
    assert decoding.split_bounds(10, 3) == [(0, 4), (4, 8), (8, 10)]
    assert decoding.split_bounds(3, 8) == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ValueError, match="num_splits must be a positive int, got 0"):
        decoding.split_bounds(10, 0)


# (B, H, H_kv, N_q, N_k, d, extras)
CASES = [
    (2, 2, 2, 1, 1, 16, {}),
    (1, 4, 2, 1, 97, 16, {}),
    (2, 4, 1, 1, 65, 32, {"causal": True}),
    (1, 2, 2, 3, 33, 16, {"causal": True}),
    (1, 2, 2, 5, 3, 16, {"causal": True}),  # N_q > N_k: rows 0, 1 see nothing
    (1, 4, 2, 2, 70, 16, {"window_size": (9, 0)}),
    (1, 4, 4, 1, 40, 16, {"alibi_slopes": masks.alibi_slopes(4), "causal": True}),
]


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("B,H,H_kv,N_q,N_k,d,extras", CASES)
def test_numpy_forward_matches_reference(
    B, H, H_kv, N_q, N_k, d, extras, num_splits, dtype, make_qkv
):
    q, k, v = make_qkv(B, H, N_q, N_k, d, dtype, H_kv=H_kv)
    o, lse = decoding.forward(q, k, v, num_splits=num_splits, **extras)
    o_ref, lse_ref = reference.forward(q, k, v, **extras)
    assert o.dtype == q.dtype and lse.dtype == (np.float64 if dtype == "float64" else np.float32)
    assert_close(o, o_ref, dtype, name="o")
    assert_close(lse, lse_ref, dtype, name="lse")


def test_rows_that_see_nothing_give_zero_and_minus_inf(make_qkv):
    q, k, v = make_qkv(1, 2, 6, 4, 8, "float32")
    o, lse = decoding.forward(q, k, v, causal=True, num_splits=2)
    assert (o[:, :, :2] == 0).all() and np.isneginf(lse[:, :, :2]).all() and np.isfinite(o).all()


def test_huge_logits_stay_finite_and_exact(make_qkv):
    q, k, v = make_qkv(1, 2, 1, 50, 16, "float64")
    q, k = q * 100, k * 100  # logits of order 1e4
    o, lse = decoding.forward(
        q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), num_splits=5
    )
    o_ref, lse_ref = reference.forward(
        q.astype(np.float32), k.astype(np.float32), v.astype(np.float32)
    )
    assert np.isfinite(o).all() and np.isfinite(lse).all()
    assert_close(o, o_ref, "float32", name="o")
    assert_close(lse, lse_ref, "float32", name="lse")


def test_hidden_splits_are_never_read(make_qkv):
    """NaN in every key and value no query may see: a split that read them would spread NaN."""
    q, k, v = make_qkv(1, 2, 1, 64, 16, "float64")
    k[:, :, :48], v[:, :, :48] = np.nan, np.nan  # window (8, 0) sees keys 55..63
    o, lse, states = decoding.forward(q, k, v, window_size=(8, 0), num_splits=8, return_states=True)
    assert [kind for _, kind, _ in states] == ["skip"] * 6 + ["partial", "full"]
    assert_close(
        o,
        reference.forward(q[..., :], k[:, :, 48:], v[:, :, 48:], window_size=(8, 0))[0],
        "float64",
    )


def test_partial_states_merge_in_any_order(make_qkv):
    q, k, v = make_qkv(2, 2, 1, 41, 16, "float64")
    _, _, states = decoding.forward(q, k, v, num_splits=5, return_states=True)
    parts = [s for _, _, s in states]
    forward = softmax.finalize(*functools.reduce(softmax.merge, parts))
    backward = softmax.finalize(*functools.reduce(softmax.merge, parts[::-1]))
    for a, b in zip(forward, backward):
        np.testing.assert_allclose(a, b, rtol=1e-14, atol=1e-15)


def test_numpy_errors_name_the_argument(make_qkv):
    q, k, v = make_qkv(1, 2, 1, 8, 16, "float32")
    with pytest.raises(
        ValueError, match=r"alibi_slopes must have shape \(H,\) = \(2,\), got \(3,\)"
    ):
        decoding.forward(q, k, v, alibi_slopes=[1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="num_splits must be a positive int, got -1"):
        decoding.forward(q, k, v, num_splits=-1)
    with pytest.raises(TypeError, match="numpy.ndarray"):
        decoding.forward(torch.from_numpy(q), k, v)


# ------------------------------------------------------------------------------------------- Triton

TRITON_CASES = [
    (2, 4, 2, 1, 97, 16, "float32", 4, {}),
    (1, 4, 1, 2, 50, 32, "float32", 3, {"causal": True}),  # MQA: 8 rows in one program
    (1, 2, 2, 5, 3, 16, "float32", 2, {"causal": True}),  # rows that see nothing
    (1, 2, 2, 1, 70, 16, "float16", 5, {"window_size": (20, 0)}),
    (2, 4, 2, 1, 33, 16, "bfloat16", 4, {"alibi_slopes": masks.alibi_slopes(4)}),
    (
        1,
        2,
        1,
        3,
        40,
        64,
        "float32",
        8,
        {"causal": True, "window_size": (7, -1), "alibi_slopes": masks.alibi_slopes(2)},
    ),
]


@pytest.mark.parametrize("B,H,H_kv,N_q,N_k,d,dtype,num_splits,extras", TRITON_CASES)
def test_triton_forward_matches_reference(
    B, H, H_kv, N_q, N_k, d, dtype, num_splits, extras, make_qkv
):
    q, k, v = (x.to(DEVICE) for x in make_qkv(B, H, N_q, N_k, d, dtype, H_kv=H_kv, kind="torch"))
    o, lse = decoding.triton_forward(q, k, v, num_splits=num_splits, **extras)
    o_ref, lse_ref = reference.forward(q, k, v, **extras)
    assert o.dtype == q.dtype and lse.dtype == torch.float32
    assert_close(o, o_ref, dtype, name="o")
    assert_close(lse, lse_ref, "float32", name="lse")


def test_triton_partial_states_equal_numpy_ones(make_qkv):
    q, k, v = make_qkv(1, 4, 2, 29, 16, "float32", H_kv=2, kind="torch")
    extras = dict(causal=True, alibi_slopes=masks.alibi_slopes(4))
    *_, (m, l, o) = decoding.triton_forward(
        q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), num_splits=3, return_states=True, **extras
    )
    _, _, states = decoding.forward(
        q.numpy(), k.numpy(), v.numpy(), num_splits=3, return_states=True, **extras
    )
    for s, (_, _, (m_np, l_np, o_np)) in enumerate(states):
        for name, got, want in (("m", m[s], m_np), ("l", l[s], l_np), ("o", o[s], o_np)):
            assert_close(got, want, "float32", name=f"split {s} {name}")


def test_triton_hidden_splits_are_never_read(make_qkv):
    q, k, v = make_qkv(1, 2, 1, 64, 16, "float32", kind="torch")
    k_nan, v_nan = k.clone(), v.clone()
    k_nan[:, :, :48], v_nan[:, :, :48] = float("nan"), float("nan")
    o, lse = decoding.triton_forward(
        q.to(DEVICE), k_nan.to(DEVICE), v_nan.to(DEVICE), window_size=(8, 0), num_splits=8
    )
    assert_close(o, reference.forward(q, k, v, window_size=(8, 0))[0], "float32")


def test_triton_combine_is_softmax_merge(rng):
    S, shape, d = 5, (2, 3, 4), 16
    m = rng.standard_normal((S, *shape)) * 3
    m[1:3, 0] = -np.inf  # empty splits for some rows
    m[:, 1, 0] = -np.inf  # a row no split saw
    l = np.where(np.isinf(m), 0.0, rng.uniform(0.5, 3.0, m.shape))
    o = np.where(np.isinf(m)[..., None], 0.0, rng.standard_normal((S, *shape, d)))
    parts = [convert(x, "float32", kind="torch", device=DEVICE) for x in (m, l, o)]
    got_o, got_lse = decoding.combine(*parts)
    state = functools.reduce(
        softmax.merge, [tuple(x[s].cpu().numpy() for x in parts) for s in range(S)]
    )
    want_o, want_lse = softmax.finalize(*state)
    assert_close(got_o, want_o, "float32", name="o")
    assert_close(got_lse, want_lse, "float32", name="lse")
    assert (got_o[1, 0] == 0).all() and torch.isneginf(got_lse[1, 0]).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_triton_decoding_of_a_long_cache_on_a_gpu(dtype, make_qkv):
    q, k, v = (x.cuda() for x in make_qkv(2, 16, 1, 8191, 128, dtype, H_kv=4, kind="torch"))
    o, lse = decoding.triton_forward(q, k, v, num_splits=16, causal=True)
    o_ref, lse_ref = reference.forward(q, k, v, causal=True)
    assert_close(o, o_ref, dtype, name="o")
    assert_close(lse, lse_ref, "float32", name="lse")


def test_triton_errors_name_the_argument(make_qkv):
    def make_qkv_dev(*a, **kw):
        return tuple(x.to(DEVICE) for x in make_qkv(*a, **kw))

    q, k, v = make_qkv_dev(1, 16, 9, 8, 16, "float32", H_kv=1, kind="torch")
    with pytest.raises(ValueError, match=r"16 \* 9 query rows exceed the 128"):
        decoding.triton_forward(q, k, v)
    q, k, v = make_qkv_dev(1, 2, 1, 8, 16, "float32", kind="torch")
    with pytest.raises(ValueError, match="block_n must be a power of two >= 16, got 24"):
        decoding.triton_forward(q, k, v, block_n=24)
    with pytest.raises(ValueError, match="num_splits must be a positive int"):
        decoding.triton_forward(q, k, v, num_splits=0)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        decoding.triton_forward(q.double(), k.double(), v.double())
    q, k, v = make_qkv_dev(1, 2, 1, 8, 257, "float32", kind="torch")
    with pytest.raises(ValueError, match="head dimension d=257 .* expected 1 to 256"):
        decoding.triton_forward(q, k, v)
