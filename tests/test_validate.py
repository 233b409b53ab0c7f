"""Every documented misuse raises a named error before any arithmetic."""

import numpy as np
import pytest
import torch

from flashedu import naive, reference
from flashedu._validate import check_block, check_window, resolve_scale

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
