"""What used to be accepted without a word: a grader passing a function that writes into its
inputs, non-finite inputs answered differently by different implementations, and an impl name no
one checked because nothing ran. Each is now refused, reported, or made to agree with the float64
reference.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashedu import attention, checks, naive, reference, tiled, torch_tiled
from flashedu.checks import _limits


def _attention(q, k, v, causal=False):
    d, N_q, N_k = q.shape[-1], q.shape[-2], k.shape[-2]
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(d)
    if causal:
        s = np.where(np.arange(N_k)[None, :] <= np.arange(N_q)[:, None] + N_k - N_q, s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)) @ v


# ---------------------------------------------------------------------------- inputs modified


@pytest.mark.parametrize("arg", ["q", "k", "v"])
def test_a_grader_rejects_a_function_that_writes_into_its_input(arg):
    def scribbles(q, k, v, causal=False):
        o = _attention(q, k, v, causal)  # the right answer...
        {"q": q, "k": k, "v": v}[arg][...] = 0  # ...after which it clears an input
        return o

    lines = []
    report = checks.naive_attention(scribbles, seed=3, out=lines.append)
    assert report.status == "wrong" and all(not ok for _, ok, _ in report.results)
    assert f"changed its input {arg} in place" in report.text


def test_a_case_with_its_own_runner_is_checked_on_its_arrays():
    from flashedu.checks import Case, grade

    x = np.ones(3)

    def writes(a):
        a[0] = 5.0
        return a.sum()

    case = Case("own runner", (x,), 7.0, call=lambda f: f(x))  # the runner hands over x itself
    report = grade("demo", writes, [case], out=lambda line: None)
    assert not report.passed and "changed its input a in place" in report.text


def test_a_function_that_leaves_its_inputs_alone_still_passes():
    assert checks.naive_attention(_attention, seed=3, out=lambda line: None).passed


def test_copies_compare_tensors_and_nan_and_name_keyword_arguments():
    x = torch.tensor([1.0, float("nan")])

    def keeps(a, *, b):
        return a.sum()

    def writes_b(a, *, b):
        b.add_(1)

    assert _limits.on_copies(keeps, (x,), {"b": x.clone()})[1] == ""
    assert _limits.on_copies(writes_b, (x,), {"b": x.clone()})[1] == "b"
    assert torch.isnan(x[1]) and x[0] == 1  # the caller's tensor is untouched either way


# ---------------------------------------------------------------------------- non-finite inputs


def _nonfinite_map(o):
    o = np.asarray(o)
    return np.isnan(o), np.isposinf(o), np.isneginf(o)


def test_the_reported_nan_case_now_gives_256_nan_rows_everywhere():
    """Causal, N = 256, a NaN in the value row only the last query sees: the float64 reference
    and SDPA give 256 rows with NaN; so does every implementation now."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 256, 16, generator=g) for _ in range(3))
    v[0, 0, 255, 3] = float("nan")
    ref = reference.forward(*(x.double().numpy() for x in (q, k, v)), causal=True)[0]
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    rows = {"reference": int(np.isnan(ref).any(-1).sum()), "sdpa": int(sdpa.isnan().any(-1).sum())}
    for impl in ("naive", "tiled", "torch_tiled", "triton"):
        o = attention(q, k, v, causal=True, impl=impl)
        rows[impl] = int(o.isnan().any(-1).sum())
        assert (o.isnan().numpy() == np.isnan(ref)).all(), impl
    assert set(rows.values()) == {256}, rows


def test_the_hopper_path_propagates_as_the_reference_too():
    """float16 takes the Hopper kernel (interpreted here), which skips masked blocks too."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 1, 64, 64, generator=g) for _ in range(3))
    v[0, 0, 63, 3] = float("nan")
    ref = reference.forward(*(x.double().numpy() for x in (q, k, v)), causal=True)[0]
    o = attention(q.half(), k.half(), v.half(), causal=True, impl="hopper")
    assert (o.isnan().numpy() == np.isnan(ref)).all()


# (N_q, N_k, H, H_kv, window_size, causal, value)
NONFINITE = [
    (40, 24, 2, 1, None, True, float("inf")),  # fully masked rows, GQA
    (24, 40, 2, 2, None, True, float("-inf")),
    (33, 33, 2, 2, (4, -1), True, float("nan")),  # causal sliding window
    (24, 40, 4, 2, (5, 3), False, float("nan")),  # two-sided window
]


@pytest.mark.parametrize("N_q,N_k,H,H_kv,window,causal,value", NONFINITE)
def test_non_finite_values_propagate_as_in_the_reference(N_q, N_k, H, H_kv, window, causal, value):
    from flashedu import kernels

    g = torch.Generator().manual_seed(N_q * N_k)
    q = torch.randn(1, H, N_q, 16, generator=g)
    k, v = (torch.randn(1, H_kv, N_k, 16, generator=g) for _ in range(2))
    v[0, 0, 2, 1] = value
    v[0, -1, N_k - 3, 5] = value
    qkv = [x.double().numpy() for x in (q, k, v)]
    want = _nonfinite_map(reference.forward(*qkv, causal=causal, window_size=window)[0])
    got = {
        "naive": naive.forward(*qkv, causal=causal, window_size=window)[0],
        "triton": kernels.forward(
            q, k, v, causal=causal, window_size=window, block_m=16, block_n=16
        )[0],
    }
    if window is None:
        got["tiled"] = tiled.forward(*qkv, causal=causal, block_m=8, block_n=8)[0]
        got["torch_tiled"] = torch_tiled.forward(q, k, v, causal=causal, block_m=8, block_n=8)[0]
    assert want[0].any()
    for impl, o in got.items():
        for name, w, g_ in zip(("NaN", "+inf", "-inf"), want, _nonfinite_map(o)):
            assert (w == g_).all(), f"{impl}: {int((w != g_).sum())} entries differ in {name}"


def test_finite_inputs_are_untouched_by_the_non_finite_rule():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 37, 16, generator=g) for _ in range(3))
    o, _ = torch_tiled.forward(q, k, v, causal=True, block_m=8, block_n=8)
    ref = reference.forward(*(x.double().numpy() for x in (q, k, v)), causal=True)[0]
    assert np.isfinite(o.numpy()).all() and np.abs(o.numpy() - ref).max() < 1e-5


# ---------------------------------------------------------------------------- silent no more


def test_a_window_given_as_a_string_is_not_read_as_digits():
    q = np.zeros((1, 1, 4, 8))
    with pytest.raises(TypeError, match="window_size must be a pair .* got str '12'"):
        naive.forward(q, q, q, window_size="12")


def test_the_explorer_no_longer_clamps_sram_without_a_word():
    from flashedu import widgets

    with pytest.raises(ValueError, match=r"sram_kib must be an int in \[16, 256\], got 300"):
        widgets.traffic_explorer(sram_kib=300)
    explorer = widgets.traffic_explorer(sram_kib=64)
    assert explorer.controls["sram_kib"].value == 64  # an in-range value is shown as given
