"""The GPU form of the non-finite rule (`flashedu.kernels.nonfinite`), run under Triton's
interpreter on CPU tensors, against the torch form (`flashedu._nonfinite`): the same NaN in the
same places, for causal, sliding windows and both edges, GQA, N_q != N_k, columns past a power of
two, several key programs, and o left alone where v is finite."""

from __future__ import annotations

import pytest
import torch

from flashedu._nonfinite import poison_hidden_values as torch_form
from flashedu.kernels import nonfinite


def _case(B, H, H_kv, N_q, N_k, d, bad, dtype=torch.float16, seed=0):
    """o and v with the given non-finite entries in v; o's last row is NaN in each bad column of
    every head of the group, as a forward makes it (that row sees every key but a left edge's)."""
    g = torch.Generator().manual_seed(seed)
    o = torch.randn(B, H, N_q, d, generator=g).to(dtype)
    v = torch.randn(B, H_kv, N_k, d, generator=g).to(dtype)
    G = H // H_kv
    for b, h, j, c, x in bad:
        v[b, h, j, c] = x
        o[b, h * G : (h + 1) * G, N_q - 1, c] = float("nan")
    return o, v


CASES = [  # (B, H, H_kv, N_q, N_k, d), the non-finite entries of v (b, h_kv, key, column, value)
    ((1, 1, 1, 40, 40, 16), [(0, 0, 37, 3, float("nan"))]),
    ((2, 4, 2, 33, 70, 40), [(1, 1, 69, 39, float("inf")), (0, 0, 2, 0, -float("inf"))]),
    ((1, 2, 1, 70, 33, 24), [(0, 0, 5, 7, float("nan")), (0, 0, 30, 7, float("nan"))]),
    ((1, 2, 2, 17, 1100, 8), [(0, 1, 1090, 5, float("inf")), (0, 1, 3, 5, float("nan"))]),
]
MASKS = [(-1, 0), (5, 0), (3, 2), (0, -1), (-1, 4)]  # (left, right); -1 unbounded


@pytest.mark.parametrize("shape,bad", CASES)
@pytest.mark.parametrize("left,right", MASKS)
def test_the_kernels_poison_the_entries_the_torch_form_poisons(shape, bad, left, right):
    o, v = _case(*shape, bad)
    want = torch_form(o.clone(), v, shape[3], left, right)
    got = nonfinite.poison_hidden_values(o.clone(), v, shape[3], left, right)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.isnan(want).any() or left == 0  # each case poisons something
    finite = ~torch.isnan(want)
    assert torch.equal(got[finite], o[finite])  # everything else untouched


def test_finite_values_leave_o_as_it_was_and_unbounded_masks_skip_the_kernels():
    o, v = _case(2, 4, 2, 33, 70, 40, [])
    got = nonfinite.poison_hidden_values(o.clone(), v, 33, 3, 0)
    assert torch.equal(got, o)
    o2, v2 = _case(1, 1, 1, 8, 8, 16, [(0, 0, 7, 0, float("nan"))])
    assert nonfinite.poison_hidden_values(o2, v2, 8, -1, -1) is o2


def test_without_a_left_edge_a_finite_last_row_means_no_v_is_read():
    """The last row sees every key, so a forward that left it finite saw no bad v: the scan
    stops there (a NaN planted in v behind a finite last row is not looked for)."""
    o, v = _case(1, 2, 1, 20, 20, 32, [])
    v[0, 0, 19, 5] = float("nan")
    assert torch.equal(nonfinite.poison_hidden_values(o.clone(), v, 20, -1, 0), o)
    assert torch.isnan(nonfinite.poison_hidden_values(o.clone(), v, 20, 3, 0)).any()  # left edge


def test_a_bfloat16_and_a_float32_output_are_poisoned_in_their_own_dtype():
    for dtype in (torch.bfloat16, torch.float32):
        o, v = _case(1, 2, 1, 20, 20, 32, [(0, 0, 19, 31, float("nan"))], dtype=dtype)
        got = nonfinite.poison_hidden_values(o.clone(), v, 20, -1, 0)
        assert got.dtype == dtype and torch.isnan(got[0, :, :19, 31]).all()
        assert not torch.isnan(got[0, :, 19, :31]).any()


# ---- on a GPU: the compiled kernels, and the forwards that call them -----------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape,bad", CASES)
@pytest.mark.parametrize("left,right", MASKS)
def test_gpu_kernels_poison_what_the_torch_form_poisons(shape, bad, left, right):
    o, v = _case(*shape, bad)
    want = torch_form(o.clone(), v, shape[3], left, right)
    got = nonfinite.poison_hidden_values(o.cuda(), v.cuda(), shape[3], left, right).cpu()
    assert torch.equal(torch.isnan(got), torch.isnan(want))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("d", [64, 96, 128, 192])
@pytest.mark.parametrize("impl", ["triton", "auto"])
def test_gpu_forwards_give_the_reference_nan_rows(d, impl):
    """Causal, a NaN in the value of the last key and an infinity in an early one: the float64
    reference's NaN entries exactly, through the Triton kernels and impl="auto" (the Hopper
    kernels at d = 64 and 128)."""
    import flashedu
    from flashedu import reference

    g = torch.Generator().manual_seed(d)
    q, k, v = (torch.randn(1, 4, 300, d, generator=g).to(torch.bfloat16) for _ in range(3))
    v[0, 1, 299, 3] = float("nan")
    v[0, 2, 7, d - 1] = float("inf")
    want = torch.as_tensor(reference.forward(*(x.double() for x in (q, k, v)), causal=True)[0])
    got = flashedu.attention(q.cuda(), k.cuda(), v.cuda(), causal=True, impl=impl).cpu()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.isnan(got[0, 1, :, 3]).all() and torch.isnan(got[0, 2, :7, d - 1]).all()
