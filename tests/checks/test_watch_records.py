"""The recording behind the method checks (flashedu/checks/_watch.py): every array or tensor a
call makes is seen, however it is made; shapes are judged against the grader's tiles; score
pairs are counted; NumPy memory is counted in NumPy's domain only."""

from __future__ import annotations

import tempfile

import numpy as np
import pytest
import torch

from flashedu.checks._shared import Shortcut
from flashedu.checks._watch import OnePass, TileRule, numpy_held, watch_arrays

RULE = dict(n_q=20, n_k=300, d=7, block_m=8, block_n=10)


def _recorded(fn):
    with watch_arrays() as w:
        fn()
    return w.largest_shape


def test_torch_views_out_results_and_tensors_made_in_a_custom_backward_are_recorded():
    class Squares(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            big = torch.ones(50, 60, dtype=x.dtype)  # made inside backward only
            return 2 * x * g + 0 * big.sum()

    x = torch.ones(3, requires_grad=True)
    assert _recorded(lambda: torch.autograd.grad(Squares.apply(x).sum(), x)) == (50, 60)
    out = torch.empty(40, 40)
    assert _recorded(lambda: torch.mm(torch.ones(40, 2), torch.ones(2, 40), out=out)) == (40, 40)
    base = torch.zeros(5000)
    assert _recorded(lambda: base.view(50, 100)) == (50, 100)


def test_numpy_arrays_made_by_constructors_and_memmaps_are_recorded():
    assert _recorded(lambda: np.zeros((30, 70))) == (30, 70)
    with tempfile.NamedTemporaryFile() as f:
        assert _recorded(lambda: np.memmap(f.name, np.float64, "w+", shape=(11, 13))) == (11, 13)


def test_the_tile_rule_names_a_block_wider_than_block_n_and_spares_row_vectors():
    rule = TileRule(**RULE)
    assert rule.judge((8, 10), "f") == "" and rule.judge((300, 7), "f") == ""
    assert rule.judge((20,), "f") == "" and rule.judge((300,), "i") == ""
    assert "8x300 block of scores, 300 keys at once" in rule.judge((8, 300), "f")
    assert "block_n = 10" in rule.judge((1, 1, 8, 300), "f")
    assert "matrix of all scores" in rule.judge((20, 300), "f")
    assert "mask over all N_q x N_k pairs" in rule.judge((20, 300), "b")


def test_scores_computed_twice_are_a_second_pass():
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((20, 7)), rng.standard_normal((300, 7))

    def tiles(times):
        with watch_arrays(rule=TileRule(**RULE)) as w:
            qw, kw = w.wrap((q, k))
            w.source(qw, "q")
            w.source(kw, "k")
            for _ in range(times):
                for r0 in range(0, 20, 8):
                    for c0 in range(0, 300, 10):
                        qw[r0 : r0 + 8] @ (kw[c0 : c0 + 10] * 0.5).T

    tiles(1)
    with pytest.raises(Shortcut, match="^two passes over the keys"):
        tiles(2)


def test_numpy_memory_is_counted_in_numpys_domain_only():
    junk = []

    def python_objects():
        junk[:] = [float(i) for i in range(50_000)]  # a few MB, none of it NumPy's

    def numpy_arrays():
        junk[:] = [np.ones(1000) for _ in range(100)]  # 800 KB of NumPy data

    assert numpy_held(python_objects, 200_000) is None
    found = numpy_held(numpy_arrays, 200_000)
    assert found is not None and found[0] >= 200_000


def test_the_stream_hides_the_row_and_expires_its_blocks():
    stream = OnePass(np.arange(12.0).reshape(3, 4), 2)
    assert not [v for v in vars(stream).values() if isinstance(v, np.ndarray)]
    first = np.asarray(next(iter(stream)))
    stream.close()
    assert np.isnan(first).all()


def test_the_packages_own_solutions_pass_the_method_checks(monkeypatch):
    """The code checks.solution shows (tiled.forward, tiled_backward.backward, ch05's
    TiledAttention) passes the tiles, passes and saved-tensor checks, the flashedu guard aside."""
    from flashedu import checks, tiled, tiled_backward
    from flashedu.checks import _core, ch03, ch04, ch05
    from flashedu.testing import run_grader

    def unguarded(*args, **kwargs):
        return _core.grade(*args, **{**kwargs, "forbid": False})

    for module in (ch03, ch04, ch05):
        monkeypatch.setattr(module, "grade", unguarded)

    def forward(q, k, v, *, causal=False, block_m, block_n):
        o, lse = tiled.forward(q[None, None], k[None, None], v[None, None], causal=causal,
                               block_m=block_m, block_n=block_n)  # fmt: skip
        return o[0, 0], lse[0, 0]

    def backward(do, q, k, v, o, lse, *, causal=False, block_m, block_n):
        args = (t[None, None] for t in (do, q, k, v, o, lse))
        grads = tiled_backward.backward(*args, causal=causal, block_m=block_m, block_n=block_n)
        return tuple(g[0, 0] for g in grads)

    for grader, fn in (
        (checks.tiled_attention, forward),
        (checks.tiled_attention_backward, backward),
        (checks.check_autograd_function, ch05.TiledAttention.apply),
    ):
        report, text = run_grader(grader, fn, seed=21)
        assert report.passed, text
