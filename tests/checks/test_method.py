"""The method guards (flashedu/checks/_method.py): each shortcut is caught and named, and the
honest computation passes untouched."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashedu import api, reference, tiled, torch_tiled
from flashedu.checks import _method
from flashedu.checks._method import OnePass, Shortcut, forbid_flashedu, largest_array
from flashedu.tiled import forward as imported_forward

Q = np.random.default_rng(0).standard_normal((1, 1, 8, 4))


@pytest.mark.parametrize(
    "call,name",
    [
        (lambda: tiled.forward(Q, Q, Q), "flashedu.tiled.forward"),
        (lambda: imported_forward(Q, Q, Q), "flashedu.tiled.forward"),
        (lambda: reference.forward(Q, Q, Q), "flashedu.reference.forward"),
        (lambda: torch_tiled.forward(*[torch.tensor(Q)] * 3), "flashedu.torch_tiled.forward"),
        (lambda: api.attention(*[torch.tensor(Q)] * 3), "flashedu.api.attention"),
    ],
    ids=["module attribute", "imported name", "reference", "decorated", "api"],
)
def test_a_call_into_flashedu_is_a_named_shortcut(call, name):
    with pytest.raises(Shortcut, match=f"^called {name}$"):
        with forbid_flashedu():
            call()
    assert tiled.forward(Q, Q, Q)[0].shape == Q.shape  # everything is put back


def test_a_swallowed_shortcut_is_still_reported():
    def sneaky():
        try:
            return reference.forward(Q, Q, Q)
        except Exception:
            return None

    with pytest.raises(Shortcut, match="called flashedu.reference.forward"):
        with forbid_flashedu():
            sneaky()


def test_an_allowed_function_runs_with_everything_it_calls():
    t = torch.tensor(Q)
    with forbid_flashedu(allow=("flashedu.api.attention",)):
        o = api.attention(t, t, t, causal=True)
    assert torch.allclose(o, torch.tensor(reference.forward(Q, Q, Q, causal=True)[0]))
    with pytest.raises(Shortcut, match="called flashedu.torch_tiled.forward"):
        with forbid_flashedu(allow=("flashedu.api.attention",)):
            torch_tiled.forward(t, t, t)


def test_a_graders_solution_is_forbidden_too():
    from flashedu.checks import ch00

    with pytest.raises(Shortcut, match="called flashedu.checks.ch00.matmul_intensity"):
        with forbid_flashedu():
            ch00.matmul_intensity(2, 2, 2)


def test_a_flashedu_triton_kernel_launch_is_a_shortcut():
    from flashedu.kernels import fwd

    with pytest.raises(Shortcut, match="called flashedu.kernels.fwd._attn_fwd"):
        with forbid_flashedu():
            fwd._attn_fwd[(1,)]()
    assert not getattr(type(fwd._attn_fwd), "_forbidden", False)


def test_plain_numpy_and_torch_run_normally_under_the_guard():
    with forbid_flashedu() as hits:
        s = Q[0, 0] @ Q[0, 0].T
        t = torch.softmax(torch.tensor(s), dim=-1)
    assert hits == [] and t.shape == (8, 8)


# ---------------------------------------------------------------------------- array watcher

X = np.random.default_rng(1).standard_normal((300, 8))
LIMIT = 300 * 300 // 2


def _full(q, k):
    return (q @ k.T).max()


def _filled(q, k):
    s = np.zeros((q.shape[0], k.shape[0]))  # never touches the watched inputs
    for i in range(q.shape[0]):
        s[i] = np.asarray(q)[i] @ np.asarray(k).T
    return s.max()


def _by_einsum(q, k):
    return np.einsum("id,jd->ij", q, k).max()


def _tiles(q, k):
    best = -np.inf
    for i in range(0, q.shape[0], 16):
        for j in range(0, k.shape[0], 16):
            best = max(best, float((q[i : i + 16] @ k[j : j + 16].T).max()))
    return best


@pytest.mark.parametrize("fn", [_full, _filled, _by_einsum], ids=["matmul", "zeros", "einsum"])
def test_a_full_score_matrix_is_named_with_its_shape(fn):
    with pytest.raises(Shortcut, match="^built a 300x300 array$"):
        largest_array(fn, X, X, limit_elems=LIMIT)


def test_torch_tensors_are_watched_through_every_operation():
    t = torch.tensor(X)
    with pytest.raises(Shortcut, match="built a 300x300 array"):
        largest_array(lambda q, k: torch.softmax(q @ k.T, -1).sum(), t, t, limit_elems=LIMIT)


def test_tiles_pass_and_report_their_largest_array():
    result, watch = largest_array(_tiles, X, X, limit_elems=LIMIT)
    assert result == pytest.approx((X @ X.T).max())
    assert watch.largest_shape == (16, 16) and watch.peak_bytes < 8 * LIMIT


# ---------------------------------------------------------------------------- one pass

ROWS = np.random.default_rng(2).standard_normal((3, 10))


def _online(blocks):
    m, l = np.full(blocks.shape[0], -np.inf), np.zeros(blocks.shape[0])
    for b in blocks:
        m_new = np.maximum(m, b.max(axis=1))
        l = l * np.exp(m - m_new) + np.exp(b - m_new[:, None]).sum(axis=1)
        m = m_new
    return m, l


def _two_passes(blocks):
    m = max(b.max() for b in blocks)
    return m, sum(np.exp(b - m).sum() for b in blocks)


def _kept(blocks):
    kept = list(blocks)
    x = np.concatenate(kept, axis=1)
    return x.max(axis=1), x.sum(axis=1)


def test_one_pass_accepts_the_online_softmax():
    m, l = _online(OnePass(ROWS, 4))
    assert np.allclose(m, ROWS.max(axis=1))
    assert np.allclose(l, np.exp(ROWS - ROWS.max(axis=1, keepdims=True)).sum(axis=1))


@pytest.mark.parametrize(
    "fn,why",
    [(_two_passes, "walked the blocks a second time"), (_kept, "used block 0 again")],
    ids=["second walk", "blocks kept"],
)
def test_a_second_pass_is_named(fn, why):
    stream = OnePass(ROWS, 4)
    with pytest.raises(Shortcut, match="read the row twice") as e:
        fn(stream)
    assert why in str(e.value) and stream.violations


def test_an_expired_block_holds_nan():
    stream = OnePass(ROWS, 5)
    first = np.asarray(next(iter(stream)))
    stream.close()
    assert np.isnan(first).all()


def test_the_guard_module_names_its_public_parts():
    assert set(_method.__all__) >= {"Shortcut", "forbid_flashedu", "watch_arrays", "largest_array"}
