"""Every documented misuse raises a named error before any arithmetic."""

import numpy as np
import pytest
import torch

from flashedu import decoding, kernels, naive, reference, tiled, torch_tiled, validation
from flashedu.validation import check_block, check_window, resolve_scale

GOOD = [np.zeros((1, 2, 3, 4)), np.zeros((1, 2, 5, 4)), np.zeros((1, 2, 5, 4))]


@pytest.mark.parametrize("fn", [naive.forward, reference.forward])
@pytest.mark.parametrize(
    "q,k,v,err,match",
    [
        (
            np.zeros((2, 3, 4)),
            GOOD[1],
            GOOD[2],
            ValueError,
            r"q must have shape \(B, H, N, d\).*\(2, 3, 4\)",
        ),
        (
            GOOD[0],
            np.zeros((1, 2, 5, 4)),
            np.zeros((1, 2, 6, 4)),
            ValueError,
            "k and v must have the same shape",
        ),
        (
            GOOD[0],
            np.zeros((1, 2, 5, 8)),
            np.zeros((1, 2, 5, 8)),
            ValueError,
            "head dimension d differs: q has d=4",
        ),
        (GOOD[0], np.zeros((2, 2, 5, 4)), np.zeros((2, 2, 5, 4)), ValueError, "batch size differs"),
        (
            np.zeros((1, 3, 3, 4)),
            GOOD[1],
            GOOD[2],
            ValueError,
            "H=3 heads, which is not a multiple of .* H_kv=2",
        ),
        (GOOD[0], GOOD[1].astype(np.float32), GOOD[2], TypeError, "must share one dtype"),
        (
            GOOD[0].astype(np.int64),
            GOOD[1].astype(np.int64),
            GOOD[2].astype(np.int64),
            TypeError,
            "dtype must be",
        ),
        (np.zeros((1, 2, 0, 4)), GOOD[1], GOOD[2], ValueError, "empty input"),
        ([[1.0]], GOOD[1], GOOD[2], TypeError, "q must be an array or tensor"),
    ],
)
def test_bad_inputs_raise_named_errors(fn, q, k, v, err, match):
    with pytest.raises(err, match=match):
        fn(q, k, v)


def test_numpy_implementation_rejects_torch_tensors():
    with pytest.raises(TypeError, match="q must be a numpy.ndarray, got torch"):
        naive.forward(*(torch.from_numpy(x) for x in GOOD))


@pytest.mark.parametrize(
    "scale,err", [(float("nan"), ValueError), (float("inf"), ValueError), ("x", TypeError)]
)
def test_softmax_scale_must_be_finite(scale, err):
    with pytest.raises(err, match="softmax_scale"):
        naive.forward(*GOOD, softmax_scale=scale)
    assert resolve_scale(None, 16) == 0.25


def test_backward_shapes_are_checked():
    o, lse = naive.forward(*GOOD)
    with pytest.raises(ValueError, match=r"lse must have shape \(B, H, N_q\)"):
        naive.backward(np.zeros_like(o), *GOOD, o, lse[..., :2])
    with pytest.raises(ValueError, match="do must have q's shape"):
        naive.backward(np.zeros((1, 2, 3, 5)), *GOOD, o, lse)


def test_window_and_block_arguments():
    assert check_window(None) is None and check_window((3, -1)) == (3, -1)
    with pytest.raises(ValueError, match="window_size entries must be >= 0"):
        check_window((-2, 0))
    with pytest.raises(TypeError, match="window_size must be a pair"):
        check_window(5)
    with pytest.raises(ValueError, match="block_m must be a positive int, got 0"):
        check_block(0, "block_m")


# ---- causal, scale and the backward's inputs: the same named error in every implementation -------
NUMPY_BACKWARDS = {"naive": naive.backward, "tiled": tiled.backward}
TORCH_BACKWARDS = {"torch_tiled": torch_tiled.backward, "triton": kernels.backward}


def _numpy_problem():
    q, k, v = (np.random.default_rng(0).standard_normal((1, 2, 16, 16)).astype(np.float32),) * 3
    o, lse = naive.forward(q, k, v)
    return q, k, v, o, lse


def _torch_problem():
    return tuple(torch.from_numpy(x) for x in _numpy_problem())


def _forwards():
    q = np.zeros((1, 1, 2, 16), np.float32)
    t = torch.from_numpy(q)
    return [
        (naive.forward, q),
        (tiled.forward, q),
        (reference.forward, q),
        (decoding.forward, q),
        (torch_tiled.forward, t),
        (kernels.forward, t),
    ]


@pytest.mark.parametrize("fn,q", _forwards(), ids=lambda x: getattr(x, "__module__", ""))
@pytest.mark.parametrize("causal", ["False", 1, None])
def test_causal_must_be_a_bool_everywhere(fn, q, causal):
    with pytest.raises(TypeError, match=f"causal must be a bool, got {type(causal).__name__}"):
        fn(q, q, q, causal=causal)


@pytest.mark.parametrize("fn,q", _forwards(), ids=lambda x: getattr(x, "__module__", ""))
@pytest.mark.parametrize("scale", ["0.5", True, np.bool_(True), 1j])
def test_softmax_scale_must_be_a_real_number_everywhere(fn, q, scale):
    with pytest.raises(TypeError, match="softmax_scale must be a real number or None, got"):
        fn(q, q, q, softmax_scale=scale)


@pytest.mark.parametrize("scale", [-0.7, 0.0, 3, np.float32(0.25)])
def test_zero_and_negative_scales_are_valid_math(scale):
    q, k, v = GOOD
    q = np.random.default_rng(1).standard_normal(q.shape)
    for fn in (naive.forward, tiled.forward):
        o, _ = fn(q, q, q, softmax_scale=scale)
        np.testing.assert_allclose(o, reference.forward(q, q, q, softmax_scale=scale)[0], 1e-12)


def _bad_lse(lse, how):
    if how == "int":
        return lse.astype(np.int32) if isinstance(lse, np.ndarray) else lse.to(torch.int32)
    if how == "float16":
        return lse.astype(np.float16) if isinstance(lse, np.ndarray) else lse.half()
    bad = lse.copy() if isinstance(lse, np.ndarray) else lse.clone()
    bad[0, 1, 3] = {"+inf": np.inf, "nan": np.nan}[how]
    return bad


LSE_CASES = [
    ("int", TypeError, "lse must be float32 for float32 inputs .* got int32"),
    ("float16", TypeError, "lse must be float32 for float32 inputs .* got float16"),
    ("+inf", ValueError, "lse has 1 NaN or \\+inf entries"),
    ("nan", ValueError, "lse has 1 NaN or \\+inf entries"),
]


@pytest.mark.parametrize("how,err,match", LSE_CASES)
def test_lse_is_checked_in_every_backward_with_the_same_message(how, err, match):
    messages = set()
    for impls, problem in ((NUMPY_BACKWARDS, _numpy_problem), (TORCH_BACKWARDS, _torch_problem)):
        for name, backward in impls.items():
            q, k, v, o, lse = problem()
            with pytest.raises(err, match=match) as info:
                backward(o, q, k, v, o, _bad_lse(lse, how))
            messages.add(str(info.value).split(": ", 1)[1])
    assert len(messages) == 1, messages


def test_lse_of_minus_inf_marks_a_fully_masked_row_and_is_accepted():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal(s) for s in ((1, 2, 9, 8), (1, 2, 4, 8), (1, 2, 4, 8)))
    o, lse = reference.forward(q, k, v, causal=True)  # rows 0..4 see no key: lse = -inf
    assert np.isneginf(lse).any()
    want = reference.backward(o, q, k, v, causal=True)
    for backward in NUMPY_BACKWARDS.values():
        for got, ref in zip(backward(o, q, k, v, o, lse, causal=True), want):
            np.testing.assert_allclose(got, ref, atol=1e-12)
    t = [torch.from_numpy(x) for x in (o, q, k, v, o, lse)]
    for got, ref in zip(torch_tiled.backward(*t, causal=True), want):
        np.testing.assert_allclose(got.numpy(), ref, atol=1e-12)


def test_backward_names_the_array_kind_and_a_missing_output():
    q, k, v, o, lse = _numpy_problem()
    with pytest.raises(TypeError, match="do must be a numpy.ndarray, got torch.Tensor"):
        naive.backward(torch.from_numpy(o), q, k, v, o, lse)
    with pytest.raises(TypeError, match="lse must be a numpy.ndarray, got torch.Tensor"):
        tiled.backward(o, q, k, v, o, torch.from_numpy(lse))
    for backward in NUMPY_BACKWARDS.values():
        with pytest.raises(TypeError, match=r"o must be an array or tensor \(the forward's output"):
            backward(o, q, k, v, None, lse)
    qt, kt, vt, ot, lset = _torch_problem()
    for backward in TORCH_BACKWARDS.values():
        with pytest.raises(TypeError, match="do must be a torch.Tensor, got numpy.ndarray"):
            backward(o, qt, kt, vt, ot, lset)
        with pytest.raises(TypeError, match=r"lse must be an array or tensor .* got None"):
            backward(ot, qt, kt, vt, ot, None)


# ---- paged KV caches and sinks ------------------------------------------------------------------
def test_a_block_table_is_read_only_as_far_as_each_length():
    table = np.array([[3, 0, -1], [1, 2, 7]], dtype=np.int32)  # row 0 holds 5 keys: pages 3, 0
    assert validation.check_block_table(table, np.array([5, 9]), num_pages=8, page_size=4) == [5, 9]
    shared = np.array([[0, 1], [0, 2]], dtype=np.int32)  # a shared prefix page is fine
    assert validation.check_block_table(shared, np.array([8, 7]), num_pages=3, page_size=4)


@pytest.mark.parametrize(
    "table,lens,match",
    [
        (np.array([[0, 9]]), np.array([8]), r"block_table\[0\] names page 9, outside"),
        (np.array([[0, -1]]), np.array([5]), r"block_table\[0\] names page -1"),
        (np.array([[2, 2]]), np.array([8]), r"block_table\[0\] names page 2 twice"),
        (np.array([[0, 1]]), np.array([9]), r"cache_seqlens\[0\] = 9 must lie in \[0, 8\]"),
        (np.array([[0.0, 1.0]]), np.array([8]), "block_table must hold integers"),
        (np.array([0, 1]), np.array([8]), "block_table must have 2 dims"),
        (np.array([[0, 1]]), np.array([8, 8]), r"cache_seqlens must have shape \(B,\) = \(1,\)"),
        (np.array([[0, 1]]), torch.tensor([8.0]), "cache_seqlens must hold integers"),
    ],
)
def test_a_bad_block_table_is_one_named_error(table, lens, match):
    with pytest.raises((ValueError, TypeError), match=match):
        validation.check_block_table(table, lens, num_pages=4, page_size=4)


def test_sinks_are_one_float_per_query_head():
    assert validation.check_sinks(None, 4) is None
    s = torch.tensor([0.5, -1.0, float("-inf")])
    assert validation.check_sinks(s, 3) is s
    with pytest.raises(ValueError, match=r"sinks must have shape \(H,\) = \(4,\)"):
        validation.check_sinks(torch.zeros(3), 4)
    with pytest.raises(TypeError, match="sinks must be floating point"):
        validation.check_sinks(torch.zeros(3, dtype=torch.int32), 3)
    with pytest.raises(ValueError, match="sinks must be finite or -inf"):
        validation.check_sinks(np.array([0.0, np.nan]), 2)


def test_the_lse_scan_is_skipped_only_for_a_cuda_lse_handed_over_by_autograd():
    """Inside `lse_from_forward` (autograd's backward) a CUDA lse is not scanned for NaN / +inf,
    to keep a host sync out of the backward; a CPU lse still is, and so is any lse outside it."""
    from flashedu import validation

    q = torch.zeros(1, 1, 3, 4)
    lse = torch.tensor([[[0.0, float("nan"), 1.0]]])
    with pytest.raises(ValueError, match="lse has 1 NaN"):
        validation.check_backward(q, q, lse, q)
    with validation.lse_from_forward(), pytest.raises(ValueError, match="lse has 1 NaN"):
        validation.check_backward(q, q, lse, q)  # on the CPU the scan costs no sync: kept
    assert not getattr(validation._trust, "lse", False)  # the flag does not outlive the block
