"""The guard that keeps flashedu's own answers out of a learner's reach (flashedu.checks._method):
a function whose code is flashedu's is rejected however it was obtained (called directly, cloned
from its code object, re-executed from its source, reached through sys.modules, pasted into
another module under another name), and so are the graders' float64 mistake twins; honest code,
and a one-line helper that happens to equal one of ours, run untouched."""

from __future__ import annotations

import importlib.util
import inspect
import sys
import types

import numpy as np
import pytest

from flashedu import softmax
from flashedu.checks import _attn_variants, _method, _tiled_twins
from flashedu.checks._method import Shortcut, forbid_flashedu, same_code_as_flashedu
from flashedu.kernels import solutions as triton_solutions

X = np.random.default_rng(0).standard_normal((3, 40))
COPY = "your code is flashedu's flashedu.softmax.online_softmax"


def _clone(f, name="mine"):
    g = types.FunctionType(f.__code__, f.__globals__, name, f.__defaults__)
    g.__kwdefaults__ = f.__kwdefaults__
    return g


def _exec_copy(f, name="mine"):
    scope = dict(f.__globals__)
    exec(inspect.getsource(f).replace(f"def {f.__name__}(", f"def {name}("), scope)
    return scope[name]


def _pasted(tmp_path, f, name="pasted"):
    """f's source, renamed and without its docstring, in a module of the learner's."""
    src = inspect.getsource(f).replace(f"def {f.__name__}(", f"def {name}(")
    if f.__doc__:
        src = src.replace(f'"""{f.__doc__}"""', "")
    path = tmp_path / f"{name}_mod.py"
    path.write_text("import numpy as np\nfrom flashedu.softmax import *  # noqa\n" + src)
    spec = importlib.util.spec_from_file_location(f"{name}_mod", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return getattr(mod, name)


def _run(fn):
    with forbid_flashedu():
        return fn(X, 8)


@pytest.mark.parametrize(
    "make,words",
    [
        (lambda tmp: softmax.online_softmax, "called flashedu.softmax.online_softmax"),
        (lambda tmp: sys.modules["flashedu.softmax"].online_softmax, "called flashedu.softmax"),
        (lambda tmp: _clone(softmax.online_softmax), COPY),
        (lambda tmp: _exec_copy(softmax.online_softmax), COPY),
        (lambda tmp: _pasted(tmp, softmax.online_softmax), COPY),
        (lambda tmp: (lambda x, b, c=_clone(softmax.online_softmax): c(x, b)), COPY),
    ],
    ids=["direct", "sys.modules", "FunctionType clone", "getsource + exec",
         "pasted into another module", "a wrapper around a clone"],
)  # fmt: skip
def test_flashedus_function_is_refused_however_reached(make, words, tmp_path):
    fn = make(tmp_path)
    with pytest.raises(Shortcut, match=words.replace(".", r"\.")):
        _run(fn)
    assert sys.gettrace() is None  # the guard's trace hook is gone


def test_a_swallowed_copy_is_still_reported():
    clone = _clone(softmax.online_softmax)

    def sneaky(x, b):
        try:
            return clone(x, b)
        except Exception:
            return np.exp(x) / np.exp(x).sum(-1, keepdims=True)

    with pytest.raises(Shortcut, match="your code is flashedu's"):
        _run(sneaky)


@pytest.mark.parametrize(
    "twin,call",
    [
        (_attn_variants.online_forward, lambda f: f(*[np.ones((1, 1, 4, 16))] * 3, 0.25,
                                                    np.ones((4, 4), bool), 2)),
        (_tiled_twins.twin_forward, lambda f: f(*[np.ones((4, 16))] * 3, causal=False,
                                                block_m=2, block_n=2)),
    ],
    ids=["_attn_variants.online_forward", "_tiled_twins.twin_forward"],
)  # fmt: skip
def test_the_graders_mistake_twins_are_guarded(twin, call):
    name = f"{twin.__module__}.{twin.__qualname__}"
    clone = _clone(twin)  # made before the guard, as a learner's notebook would
    with pytest.raises(Shortcut, match=f"called {name}"):
        with forbid_flashedu():
            call(twin)
    with pytest.raises(Shortcut, match=f"your code is flashedu's {name}"):
        with forbid_flashedu():
            call(clone)
    call(twin)  # outside the guard the graders use them freely


def test_honest_code_runs_and_a_tiny_equal_helper_is_not_flagged():
    def online(x, block):
        m, total = np.full(x.shape[0], -np.inf), np.zeros(x.shape[0])
        for j in range(0, x.shape[1], block):
            t = x[:, j : j + block]
            m_new = np.maximum(m, t.max(1))
            total = total * np.exp(m - m_new) + np.exp(t - m_new[:, None]).sum(1)
            m = m_new
        return np.exp(x - m[:, None]) / total[:, None]

    def finite_or_zero(m):  # the same code as a one-line flashedu helper: too short to compare
        return np.where(np.isfinite(m), m, 0.0)

    out = _run(online)
    assert np.allclose(out, softmax.safe_softmax(X))
    with forbid_flashedu():
        finite_or_zero(np.array([1.0, -np.inf]))
    assert same_code_as_flashedu(online) == "" and same_code_as_flashedu(finite_or_zero) == ""


def test_same_code_names_a_copied_kernel_and_nothing_else():
    import triton

    fn = triton_solutions.dq_kernel.fn
    copy = types.FunctionType(fn.__code__, fn.__globals__, "my_dq", fn.__defaults__)
    copy.__annotations__ = dict(fn.__annotations__)
    copy.__module__ = "__main__"
    assert same_code_as_flashedu(triton.jit(copy)) == "flashedu.kernels.solutions.dq_kernel"
    from fixtures.learner_kernels import my_dq

    assert same_code_as_flashedu(my_dq) == ""


def test_fingerprints_ignore_names_docstrings_and_layout():
    f = softmax.online_softmax
    assert _method.code_fingerprint(_exec_copy(f).__code__) == _method.code_fingerprint(f.__code__)
    src = inspect.getsource(f)
    spaced = src.replace("def online_softmax(", "def other(  ").replace("    ", "    ", 1)
    scope: dict = dict(f.__globals__)
    exec(spaced, scope)
    assert _method.source_fingerprint(scope["other"]) in ("", _method.source_fingerprint(f))


def test_a_graders_own_solution_in_flashedu_checks_is_guarded_when_cloned():
    """flashedu.checks is the graders' machinery, not guarded as a whole; the solutions its
    modules hold are, copies included."""
    from flashedu import checks
    from flashedu.checks import ch02
    from flashedu.testing import run_grader

    clone = _clone(ch02.online_stats)
    report, text = run_grader(checks.online_softmax, clone, seed=1)
    assert not report.passed
    assert "your code is flashedu's flashedu.checks.ch02.online_stats" in " ".join(text.split())
