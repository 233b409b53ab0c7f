"""Chapter 06's Triton graders against a learner in a hurry: every shortcut (right numbers by the
wrong method) is rejected with a message that names it, and honest kernels written in other shapes
(other loop forms, masks built in registers, base-2 exponentials) pass.

The grader launches the learner's @triton.jit kernel itself, with its own BLOCK_M and BLOCK_N,
into NaN-filled outputs: a Python wrapper is never graded, a tile wider than the grader's block is
named with both sizes, one program doing the whole grid's work is named by its stores, a second
pass over the keys by its bytes, and flashedu's own kernels by name, however reached. On CPU the
kernels run through Triton's interpreter (small shapes)."""

from __future__ import annotations

import importlib.util
import inspect
import sys
import types

import pytest
import torch
import triton
from fixtures import shortcut_kernels as sk
from fixtures.learner_kernels import my_flash_forward, my_scores_kernel, planted
from fixtures.planted_forward import bad_forward
from fixtures.planted_tiles import bad_scores

from flashedu import checks
from flashedu.checks import _triton
from flashedu.kernels import intro as triton_intro
from flashedu.kernels import solutions as triton_solutions
from flashedu.testing import run_grader

pytestmark = [
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="traffic is measured by the interpreter"),
]


def flat(text: str) -> str:
    return " ".join(text.split())


def rejected(grader, fn, words, seed=2):
    report, text = run_grader(grader, fn, seed)
    assert not report.passed, text
    assert words in flat(text), text
    return text


def jit_clone(kernel):
    """flashedu's kernel cloned from its code object into the notebook's module, as a learner
    could: a fresh function and a fresh @triton.jit around it."""
    fn = kernel.fn
    copy = types.FunctionType(fn.__code__, fn.__globals__, "my_kernel", fn.__defaults__)
    copy.__annotations__ = dict(fn.__annotations__)
    copy.__module__ = "__main__"
    return triton.jit(copy)


def copied_module(tmp_path, kernel, name):
    """flashedu's kernel's source (inspect.getsource), renamed and pasted into a module of the
    learner's (Triton reads a kernel's source from its file, so exec alone would not do)."""
    src = inspect.getsource(kernel.fn).replace(f"def {kernel.fn.__name__}(", f"def {name}(")
    header = (
        "import triton\nimport triton.language as tl\n"
        "from flashedu.kernels.exercises import fwd_program, dq_program, dkdv_program, dkdv_head\n"
    )
    path = tmp_path / f"{name}_module.py"
    path.write_text(header + src)
    spec = importlib.util.spec_from_file_location(f"{name}_module", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return getattr(mod, name)


# ------------------------------------------------------------------------------- 6.1: scores


@pytest.mark.parametrize(
    "kernel", [my_scores_kernel, planted(bad_scores, "")], ids=["k loaded transposed", "plain"]
)
def test_honest_scores_kernels_pass(kernel):
    report, text = run_grader(checks.triton_scores, kernel, seed=2)
    assert report.passed, text


def _decoy_and_torch(q, k, *, causal=False):
    """A kernel is launched (and does nothing useful); torch computes the answer."""
    junk = torch.empty(16, 16)
    sk.lone_scores[(1, 1)](q, k, junk, q.stride(0), k.stride(0), 16, 0, 0, 1.0, False,
                           q.shape[1], 16, 16)  # fmt: skip
    s = q @ k.T / q.shape[1] ** 0.5
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).tril(k.shape[0] - q.shape[0])
                          .logical_not(), float("-inf"))  # fmt: skip
    return s


@pytest.mark.parametrize(
    "fn,words",
    [
        (_decoy_and_torch, "_decoy_and_torch is a Python function: checks.triton_scores grades "
         "your @triton.jit kernel itself"),
        (triton_intro.scores, "scores is a Python function"),
        (sk.with_globals(sk.wide_scores, WIDE=128), "in one tile; the grader asked for BLOCK_N ="),
        (sk.lone_scores, "program (0, 0) stored columns 16..31 of S, outside its own columns "
         "0..15"),
        (triton_solutions.scores_kernel, "passed flashedu.kernels.solutions.scores_kernel, "
         "flashedu's own kernel"),
        (sys.modules["flashedu.kernels.solutions"].scores_kernel, "flashedu's own kernel"),
        (jit_clone(triton_solutions.scores_kernel), "your code is flashedu's "
         "flashedu.kernels.solutions.scores_kernel (the same code under another name)"),
        (triton_intro.tile_kernel, "flashedu.kernels.intro.tile_kernel, flashedu's own kernel"),
    ],
    ids=["decoy kernel + torch", "the package's function", "one tile of every key",
         "one program per row strip", "the solution", "via sys.modules", "cloned code object",
         "the package's kernel"],
)  # fmt: skip
def test_scores_shortcuts_are_named(fn, words):
    rejected(checks.triton_scores, fn, words)


def test_scores_copied_source_is_named(tmp_path):
    kernel = copied_module(tmp_path, triton_solutions.scores_kernel, "my_scores_copy")
    rejected(checks.triton_scores, kernel, "your code is flashedu's "
             "flashedu.kernels.solutions.scores_kernel")  # fmt: skip


def test_a_wide_tile_names_both_sizes():
    text = rejected(checks.triton_scores, sk.with_globals(sk.wide_scores, WIDE=64), "one tile")
    assert "the grader asked for BLOCK_N = 16" in flat(text), text
    assert "columns of K in one tile" in flat(text) or "columns of S in one tile" in flat(text)


# ------------------------------------------------------------------------------- 6.2: kv ranges


def _honest_kv_range(first, last, N_q, N_k, block_n, *, causal=False):
    if not causal:
        return 0, 0, N_k // block_n * block_n, -(-N_k // block_n) * block_n
    shift = N_k - N_q
    hi = min(max(last + shift + 1, 0), N_k)
    full = min(max(first + shift + 1, 0), N_k)
    hi = -(-hi // block_n) * block_n
    return 0, 0, min(full // block_n * block_n, hi), hi


def _clone_kv_range():
    f = triton_intro.kv_range
    g = types.FunctionType(f.__code__, f.__globals__, "my_kv_range", f.__defaults__)
    g.__kwdefaults__ = f.__kwdefaults__
    return g


def _exec_kv_range():
    scope = dict(triton_intro.kv_range.__globals__)
    exec(inspect.getsource(triton_intro.kv_range).replace("def kv_range", "def mine"), scope)
    return scope["mine"]


_CLONE = _clone_kv_range()


def _wraps_a_clone(first, last, N_q, N_k, block_n, *, causal=False):
    return _CLONE(first, last, N_q, N_k, block_n, causal=causal)


def test_honest_kv_range_passes():
    report, text = run_grader(checks.kv_block_range, _honest_kv_range, seed=1)
    assert report.passed, text


@pytest.mark.parametrize(
    "fn,words",
    [
        (triton_intro.kv_range, "called flashedu.kernels.intro.kv_range"),
        (sys.modules["flashedu.kernels.intro"].kv_range, "called flashedu.kernels.intro.kv_range"),
        (_CLONE, "your code is flashedu's flashedu.kernels.intro.kv_range"),
        (_exec_kv_range(), "your code is flashedu's flashedu.kernels.intro.kv_range"),
        (_wraps_a_clone, "your code is flashedu's flashedu.kernels.intro.kv_range"),
    ],
    ids=["direct", "sys.modules", "FunctionType clone", "getsource + exec", "wrapper of a clone"],
)
def test_kv_range_shortcuts_are_named(fn, words):
    rejected(checks.kv_block_range, fn, words, seed=1)


# ------------------------------------------------------------------------------- 6.3: forward


@pytest.mark.parametrize(
    "kernel",
    [my_flash_forward, planted(bad_forward, "")],
    ids=["exp2, full and diagonal loops, k^T loaded", "one masked loop"],
)
def test_honest_forward_kernels_pass(kernel):
    report, text = run_grader(checks.triton_forward, kernel, seed=4)
    assert report.passed, text


def _decoy_forward(q, k, v, *, causal=False):
    """Launches the learner's kernel for show, then answers with torch's SDPA."""
    from flashedu.kernels.exercises import launch_forward

    launch_forward(my_flash_forward, q, k, v, causal=causal)
    o = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(q.shape[1] // k.shape[1], 1),
        v.repeat_interleave(q.shape[1] // k.shape[1], 1), is_causal=causal,
    )  # fmt: skip
    return o, torch.zeros(q.shape[:3])


@pytest.mark.parametrize(
    "fn,words",
    [
        (_decoy_forward, "_decoy_forward is a Python function: checks.triton_forward grades your "
         "@triton.jit kernel itself"),
        (sk.with_globals(sk.wide_forward, WIDE=128), "your kernel read all 32 keys of K in one "
         "tile; the grader asked for BLOCK_N = 16"),
        (sk.with_globals(sk.wide_forward, WIDE=32), "keys of K in one tile; the grader asked for "
         "BLOCK_N = 16"),
        (sk.two_pass_forward, "two passes over the keys, the first for the row max; the online "
         "softmax takes one"),
        (sk.lone_forward, "program (0) stored rows 16..31 of O, outside its own rows 0..15"),
        (sk.borrowed_forward, "flashedu.kernels.solutions.flash_forward_kernel"),
        (jit_clone(triton_solutions.flash_forward_kernel), "your code is flashedu's "
         "flashedu.kernels.solutions.flash_forward_kernel"),
        (triton_solutions.flash_forward_kernel, "flashedu's own kernel: pass the one you wrote"),
    ],
    ids=["decoy kernel + torch", "one tile of every key", "tiles twice the block",
         "two-pass softmax", "program 0 does every query block", "device call of the solution",
         "cloned code object", "the solution"],
)  # fmt: skip
def test_forward_shortcuts_are_named(fn, words):
    rejected(checks.triton_forward, fn, words, seed=4)


def test_forward_copied_source_is_named(tmp_path):
    kernel = copied_module(tmp_path, triton_solutions.flash_forward_kernel, "my_fwd_copy")
    rejected(checks.triton_forward, kernel, "your code is flashedu's "
             "flashedu.kernels.solutions.flash_forward_kernel", seed=4)  # fmt: skip


def test_forward_blocks_are_the_graders_and_differ_between_stages():
    """The stages hand the kernel BLOCK_M != BLOCK_N too, so a kernel that swaps them fails."""
    from flashedu.checks import _kernel_cases

    specs = _kernel_cases.stage_specs(__import__("numpy").random.default_rng(0),
                                      _kernel_cases.FORWARD_HINTS)  # fmt: skip
    blocks = {spec[-1] for spec in specs}
    assert len(blocks) == 3 and any(bm != bn for bm, bn in blocks), blocks


def test_the_rescale_formula_waits_for_the_hint():
    report, text = run_grader(checks.triton_forward, planted(bad_forward, "no rescale"), seed=3)
    assert "not rescaled when the row max grew" in flat(text), text
    assert "alpha" not in text and "exp(m" not in text, text
    hints = []
    checks.hint(checks.triton_forward, out=hints.append)
    assert any("alpha" in line for line in hints), hints


def test_a_failure_no_mistake_explains_says_where_not_causal():
    """A kernel wrong in a way no twin knows (the score mask compares keys with N_q) is located by
    its rows, not blamed on the causal mask or any other named mistake."""
    text = rejected(
        checks.triton_forward,
        planted(bad_forward, "N_q mask"),
        "and right elsewhere; it matches none of the usual mistakes",
        seed=3,
    )
    assert "bottom-right" not in flat(text), text


def test_a_kernel_decorated_before_the_interpreter_is_remade(monkeypatch):
    """`import triton` before `import flashedu` on a machine without a GPU: the kernel is a
    compiled JITFunction; the grader re-makes it for the interpreter and grades it."""
    from triton.runtime.jit import JITFunction

    compiled = JITFunction(my_scores_kernel.fn)
    report, text = run_grader(checks.triton_scores, compiled, seed=2)
    assert report.passed, text
    assert _triton.runnable(compiled) is not compiled


def test_a_kernel_that_calls_a_precompiled_helper_says_what_to_restart():
    """When a helper it calls was also decorated before the interpreter was set up, the kernel
    cannot be re-made here: the report says in one line what to restart."""
    from fixtures import learner_kernels
    from triton.runtime.jit import JITFunction

    fn = learner_kernels.my_flash_forward.fn
    scope = dict(fn.__globals__, _fwd_block=JITFunction(learner_kernels._fwd_block.fn))
    compiled = JITFunction(learner_kernels._copy(fn, scope))
    rejected(
        checks.triton_forward,
        compiled,
        "restart the notebook's kernel and run its first "
        "cell, which imports flashedu, before the cell that defines the kernel",
        seed=4,
    )
