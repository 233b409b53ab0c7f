"""Graders for notebooks/10_in_practice.ipynb: FlexAttention score mods and mask mods.

Each exercise asks for a factory that returns a mod with FlexAttention's signature, e.g.
`my_softcap(cap) -> score_mod(score, b, h, q_idx, kv_idx)`. A grader evaluates the learner's mod on
the whole (B, H, N_q, N_k) grid (`flashedu.flex.score_array` / `mask_array`) and runs it through
torch's FlexAttention (eager, float64, CPU). It compares the modded scores or the mask with the
definition written out in NumPy, and the output with the float64 softmax of those explicit scores
(`flashedu.reference.forward` fed the explicit mask, or ALiBi slopes), so the mod is checked both as
a function and in use. The factory and every call of its mod run with flashedu's implementations
off limits (`forbid_flashedu`): `flex.alibi` and the other package mods are the answers. A wrong
answer is matched against the classic mistakes, each a buggy variant of the scores or mask together
with the output it gives (a flipped sign, an exclusive window edge, a prefix that is only causal, a
document mask that lets tokens see other documents, ...); otherwise the report shows the first wrong
entry and what the case tests. `checks.hint` prints each mod as a formula.

The last case of each grader but softcap's is a sequence of thousands of tokens, where the mod is
called as FlexAttention calls it, one (head, query, key) at a time with 0-d index tensors, at pairs
drawn at random and near the diagonal, a window's edge or a document's start. There the factory may
make no array of 16 N elements or more, nothing the mod can reach (closure, defaults, globals it
names, attributes) may be that large, and no call may make one: an N x N mask or bias table, built
in the factory, before it or lazily in the mod, is a named shortcut. Errors with a known cause are
named too: a Python `if`, float() or .item() on a tensor, on the grid or inside FlexAttention.

Limits: forward only (FlexAttention has no backward on CPU in torch 2.13); small shapes.
"""

from __future__ import annotations

import functools
import inspect
import types

import numpy as np
import torch

from .. import flex, masks, reference, softmax
from ..testing import max_error
from ._core import Case, grade, grader, rng_for
from ._method import forbid_flashedu
from ._shared import Shortcut
from ._watch import shape_text, watch_arrays

__all__ = [
    "alibi_mod",
    "softcap_mod",
    "relative_bias_mod",
    "sliding_window_mask",
    "prefix_lm_mask",
    "document_mask",
]

_TOL = 1e-10


def _qkv(rng, B, H, N, d=8, scale=1.0):
    return tuple(torch.from_numpy(rng.standard_normal((B, H, N, d)) * scale) for _ in range(3))


def _grid(N):
    """i (N, 1), j (1, N): query and key positions."""
    return np.arange(N)[:, None], np.arange(N)[None, :]


def _first_wrong(got: np.ndarray, want: np.ndarray) -> str:
    b, h, i, j = (int(x) for x in np.argwhere(~np.isclose(got, want, rtol=0, atol=_TOL))[0])
    return f"first wrong: head {h}, query {i}, key {j}: {got[b, h, i, j]:.4g}, expected " + (
        f"{want[b, h, i, j]:.4g}"
    )


def _checker(part: str):
    """Compare (array, o) with the expected pair: the array entry by entry, then the output."""

    def check(got, expected):
        (arr, o), (want, o_ref) = got, expected
        if isinstance(arr, _Raised):
            return False, f"on the grid of indices the mod {arr.text}", arr.why
        if isinstance(o, _Raised):
            return False, f"FlexAttention {o.text}", o.why or _NOT_IN_FLEX
        arr, want = np.asarray(arr, dtype=float), np.asarray(want, dtype=float)
        if arr.shape != want.shape:
            return False, f"{part} has shape {arr.shape}, expected {want.shape}"
        err, err_o = max_error(arr, want)[0], max_error(o, o_ref)[0]
        if err <= _TOL:
            ok = err_o <= _TOL
            detail = f"{part} max|diff|={err:.1e}, o max|diff|={err_o:.1e}"
            return (ok, detail) if ok else (ok, detail, _NOT_IN_FLEX)
        wrong = int((~np.isclose(arr, want, rtol=0, atol=_TOL)).sum())
        return False, f"{part}: {wrong} of {arr.size} entries wrong; {_first_wrong(arr, want)}"

    return check


_NOT_IN_FLEX = (
    "right on the grid but not inside FlexAttention: write the mod with tensor operations only "
    "(no Python `if` on a value, no .item())"
)


class _Raised:
    """What a call of the learner's mod raised, kept for the check to name."""

    def __init__(self, e: BaseException):
        msg = (str(e).strip().splitlines() or [""])[0][:120]
        self.text = f"raised {type(e).__name__}" + (f": {msg}" if msg else "")
        self.why = _why_raised(e)


def _why_raised(e: BaseException) -> str:
    """The cause of an error a mod raises, when it is a known one."""
    msg = str(e)
    if any(w in msg for w in ("ambiguous", ".item()", "data-dependent", "Data-dependent")):
        return (
            "a Python `if`, float() or .item() on a tensor: the mod is called with tensors of "
            "indices, so write it with tensor operations (&, |, torch.where)"
        )
    return ""


def _guarded(mod, kind: str):
    """The learner's mod, run under forbid_flashedu at every call, for the grid evaluation.
    (FlexAttention traces its mods with torch.compile's tracer, which cannot enter the guard, so
    it gets the bare mod; the grid, evaluated first, has already seen any call into flashedu.)"""
    if kind == "mask_mod":

        def mask_mod(b, h, q_idx, kv_idx):
            with forbid_flashedu():
                return mod(b, h, q_idx, kv_idx)

        return mask_mod

    def score_mod(score, b, h, q_idx, kv_idx):
        with forbid_flashedu():
            return mod(score, b, h, q_idx, kv_idx)

    return score_mod


def _runner(make, kind: str):
    """Wrap the learner's factory: (params, q, k, v, mask_mod) -> (array on the grid, o by flex).
    The factory and the mod's calls on the grid run with flashedu's implementations off limits;
    the package's evaluators around them do not."""

    def run(params, q, k, v, mask_mod=None):
        with forbid_flashedu():
            mod = make(*params)
        if not callable(mod):
            raise TypeError(f"expected a {kind} function, got {type(mod).__name__}")
        guarded = _guarded(mod, kind)  # the grid sees every call the mod makes
        try:
            if kind == "mask_mod":
                arr = flex.mask_array(guarded, *q.shape[:3], k.shape[2])
            else:
                arr = flex.score_array(guarded, flex.dense_scores(q, k))
        except (NotImplementedError, Shortcut):
            raise
        except Exception as e:  # named below when the cause is a known one
            return _Raised(e), None
        try:
            if kind == "mask_mod":
                return arr, flex.flex_forward(q, k, v, mask_mod=mod, block_size=16)[0]
            mods = dict(score_mod=mod, mask_mod=mask_mod, block_size=16)
            return arr, flex.flex_forward(q, k, v, **mods)[0]
        except Shortcut:
            raise
        except Exception as e:  # right on the grid, refused by FlexAttention: say why
            return arr, _Raised(e)

    return run


def _attend(scores: np.ndarray, v, visible=None) -> np.ndarray:
    """softmax(scores) @ v in float64: the output for explicitly modded scores (B, H, N_q, N_k),
    with the keys outside `visible` (N_q, N_k) masked out."""
    if visible is not None:
        scores = np.where(visible, scores, -np.inf)
    return softmax.finalize(*softmax.state(scores, v.numpy()))[0]


def _score_case(label, params, qkv, want, mistakes, hint, o_ref=None, visible=None) -> Case:
    """A score-mod case; want and mistakes are modded score arrays (B, H, N, N). `visible`: the
    causal mask the case runs with (its mask_mod is flex.causal())."""
    v = qkv[2]
    expected = (want, _attend(want, v) if o_ref is None else o_ref)
    variants = {
        why: (lambda bad=bad: (bad, _attend(bad, v, visible))) for why, bad in mistakes.items()
    }
    mask_mod = None if visible is None else flex.causal()
    return Case(
        label,
        (params, *qkv, mask_mod),
        expected,
        hint=hint,
        check=_checker("scores"),
        mistakes=variants,
        inputs=_inputs(params, qkv, visible is not None),
    )


def _mask_case(label, rng, params, want: np.ndarray, mistakes: dict, hint: str, H=2) -> Case:
    """A mask-mod case on fresh (1, H, N, N) inputs; want and mistakes are (N, N) bool masks."""
    N = want.shape[0]
    q, k, v = _qkv(rng, 1, H, N)
    full = lambda m: np.broadcast_to(m, (1, H, N, N))

    def variant(bad):
        return lambda: (full(bad), reference.forward(q, k, v, attn_mask=bad)[0])

    return Case(
        label,
        (params, q, k, v),
        (full(want), reference.forward(q, k, v, attn_mask=want)[0]),
        hint=hint,
        check=_checker("mask"),
        mistakes={why: variant(bad) for why, bad in mistakes.items()},
        inputs=_inputs(params, (q, k, v), False),
    )


def _inputs(params, qkv, causal: bool) -> str:
    """'factory(cap=5.3); q, k, v (1, 2, 27, 8)': what the grader built and ran."""
    shown = ", ".join(
        f"tensor {tuple(p.shape)}"
        if isinstance(p, torch.Tensor)
        else f"{p:.6g}"
        if isinstance(p, float)
        else repr(p)
        for p in params
    )
    return f"factory({shown}); q, k, v {tuple(qkv[0].shape)} float64" + (
        ", causal" if causal else ""
    )


def _grade(name, fn, kind, cases, out):
    return grade(name, _runner(fn, kind), cases, out=out)


# ------------------------------------------------------------------ long sequences: no N x N table

_MASK_TABLE = (
    "a mask_mod answers for one (q_idx, kv_idx) at a time, from the indices; FlexAttention builds "
    "its block mask from those calls, and an N x N table is the memory it exists to avoid"
)
_SCORE_TABLE = (
    "a score_mod computes the score of one (q_idx, kv_idx) at a time, from the indices; an N x N "
    "table of biases is the memory FlexAttention exists to avoid"
)
_DOC_TABLE = (
    "a document mask needs each token's document id, N numbers, and compares two of them per "
    "call; an N x N table of which token sees which is the memory FlexAttention exists to avoid"
)


def _made(w) -> str:
    if w.largest_elems >= w.limit_elems:
        return f"built a {shape_text(w.largest_shape)} table"
    return f"held {w.peak_bytes / 2**20:,.1f} MiB of arrays at once"


def _table_in_reach(obj, limit: int, name: str = "", depth: int = 0, seen=None):
    """(name, shape) of an array or tensor of >= limit elements that `obj` can read: a closure
    cell, a default, a global its code names, a partial's arguments, an attribute; else None."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 4 or isinstance(obj, (types.ModuleType, type)):
        return None
    seen.add(id(obj))
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        return (name, tuple(obj.shape)) if int(np.prod(obj.shape)) >= limit else None

    def nxt(x, n):
        return _table_in_reach(x, limit, n, depth + 1, seen)

    items: list[tuple[str, object]] = []
    if isinstance(obj, (list, tuple, set, frozenset)):
        items = [(name, x) for x in list(obj)[:1000]]
    elif isinstance(obj, dict):
        items = [(str(k), x) for k, x in list(obj.items())[:1000]]
    elif isinstance(obj, functools.partial):
        items = [("", obj.func), ("", obj.args), ("", obj.keywords)]
    elif inspect.ismethod(obj):
        items = [("", obj.__func__), ("self", obj.__self__)]
    elif inspect.isfunction(obj):
        if (obj.__module__ or "").split(".")[0] in ("torch", "numpy", "flashedu"):
            return None
        code = obj.__code__
        cells = zip(code.co_freevars, obj.__closure__ or ())
        items = [(n, c.cell_contents) for n, c in cells if _filled(c)]
        items += [("default", x) for x in (obj.__defaults__ or ())]
        items += list((obj.__kwdefaults__ or {}).items())
        items += [(n, obj.__globals__[n]) for n in _names(code) if n in obj.__globals__]
    elif callable(obj) and hasattr(obj, "__dict__"):
        items = list(vars(obj).items()) + [("", type(obj).__call__)]
    for n, x in items:
        found = nxt(x, n or name)
        if found:
            return found
    return None


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # a cell not yet assigned
        return False
    return True


def _names(code) -> set[str]:
    """The global names a code object and the code nested in it read."""
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _names(c)
    return names


def _points(rng, N: int, H: int, near: int, n_random: int = 40) -> np.ndarray:
    """(P, 3) int rows (h, i, j): random pairs, and pairs within `near` of the diagonal."""
    i = rng.integers(0, N, n_random + 24)
    close = np.clip(i[n_random:] - rng.integers(-2, near + 3, 24), 0, N - 1)
    j = np.concatenate([rng.integers(0, N, n_random), close])
    return np.stack([rng.integers(0, H, i.size), i, j], axis=1)


def _long_case(label, fn, kind, params, N, pts, want, lesson, hint, score=None) -> Case:
    """The learner's factory and mod on a sequence of N tokens: the factory's arrays, what the mod
    can reach and what each call makes must all stay under 16 N elements (an N x N table is far
    over), and the mod, called at the points (h, i, j) as FlexAttention calls it (0-d index
    tensors), must give `want` there. `score`: the score handed to a score_mod at each point."""
    limit = 16 * N

    def call(_runner):
        try:
            with forbid_flashedu(), watch_arrays(limit) as w:
                mod = fn(*params)
        except Exception as e:
            if "w" in locals() and w.over:  # the table, not what went wrong after it was built
                raise Shortcut(f"the factory {_made(w)} for N={N}: {lesson}") from None
            raise e
        if not callable(mod):
            raise TypeError(f"expected a {kind} function, got {type(mod).__name__}")
        found = _table_in_reach(mod, limit, "the mod")
        if found:
            where, shape = found
            raise Shortcut(f"the mod reads a {shape_text(shape)} table ({where}): {lesson}")
        got = []
        t = lambda x: torch.tensor(int(x))
        try:
            with forbid_flashedu(), watch_arrays(limit) as w2:
                for p, (h, i, j) in enumerate(pts):
                    idx = (t(0), t(h), t(i), t(j))
                    if kind == "mask_mod":
                        out = mod(*idx)
                    else:
                        out = mod(torch.tensor(float(score[p]), dtype=torch.float64), *idx)
                    got.append(float(torch.as_tensor(out).double()))
        except Exception as e:
            if "w2" in locals() and w2.over:  # the table, not what went wrong after it was built
                raise Shortcut(f"one call of the mod {_made(w2)}: {lesson}") from None
            if isinstance(e, (Shortcut, NotImplementedError)):
                raise
            return _Raised(e)
        return np.array(got)

    def check(got, expected):
        if isinstance(got, _Raised):
            return False, f"called at single indices, the mod {got.text}", got.why
        wrong = ~np.isclose(got, expected, rtol=0, atol=_TOL)
        if not wrong.any():
            return True, f"{len(pts)} (query, key) pairs of {N} tokens right; no table"
        p = int(np.argmax(wrong))
        h, i, j = (int(x) for x in pts[p])
        return False, (
            f"{int(wrong.sum())} of {len(pts)} pairs wrong; first: head {h}, query {i}, key {j}: "
            f"{got[p]:.4g}, expected {expected[p]:.4g}"
        )

    shown = ", ".join(f"tensor {tuple(x.shape)}" if isinstance(x, torch.Tensor) else repr(x)
                      for x in params)  # fmt: skip
    return Case(
        label,
        (),
        want,
        hint=hint,
        check=check,
        call=call,
        inputs=f"factory({shown}); the mod called at {len(pts)} (head, query, key) points of "
        f"N={N}, each index a 0-d tensor",
    )


# ------------------------------------------------------------------------------------ score mods


_ALIBI_FORMULA = """
score_mod(score, b, h, q_idx, kv_idx) = score - slopes[h] * (q_idx - kv_idx).abs()
"""


@grader("flashedu.flex.alibi", formula=_ALIBI_FORMULA)
def alibi_mod(fn, *, seed=None, out=print):
    """Grade `fn(slopes) -> score_mod`: score - slopes[h] * |q_idx - kv_idx|, slopes (H,)."""
    rng = rng_for(seed)
    cases = []
    for H, N, causal, hint in [
        (1, 7, False, "subtract slope * |q_idx - kv_idx| from the score"),
        (4, 23, True, "one slope per head: slopes[h]"),
        (8, 33, False, "ALiBi penalises distance both ways: |q_idx - kv_idx|"),
    ]:
        q, k, v = _qkv(rng, 2, H, N)
        slopes = masks.alibi_slopes(H) * rng.uniform(0.5, 2.0)  # fresh, still one per head
        s, (i, j) = flex.dense_scores(q, k), _grid(N)
        dist = slopes[:, None, None] * np.abs(i - j)  # (H, N, N)
        mistakes = {
            "wrong sign: ALiBi subtracts slope * distance, so far keys score lower": s + dist,
            "no absolute value: keys after the query are penalised too, |q_idx - kv_idx|": s
            - slopes[:, None, None] * (i - j),
            "one slope for all heads: index the slopes by the head, slopes[h]": s
            - slopes[0] * np.abs(i - j),
            "the distance is not multiplied by the head's slope": s - np.abs(i - j),
        }
        if H >= s.shape[0]:  # slopes[b] exists: it gives a wrong answer instead of an error
            by_batch = slopes[: s.shape[0], None, None, None] * np.abs(i - j)
            mistakes[
                "the slopes were indexed by the batch b: index them by the head, slopes[h]"
            ] = s - by_batch
        o_ref = reference.forward(q, k, v, causal=causal, alibi_slopes=slopes)[0]
        label = f"H={H}, N={N}" + (", causal" if causal else "")
        cases.append(
            _score_case(
                label,
                (torch.from_numpy(slopes),),
                (q, k, v),
                s - dist,
                mistakes,
                hint,
                o_ref,
                np.tril(np.ones((N, N), bool)) if causal else None,
            )
        )
    H, N = 4, int(rng.integers(4096, 6145))
    slopes = masks.alibi_slopes(H) * rng.uniform(0.5, 2.0)
    pts, score = _points(rng, N, H, 8), rng.standard_normal(64)
    h, i, j = pts.T
    cases.append(
        _long_case(
            f"N={N}: single (query, key) pairs, no table",
            fn,
            "score_mod",
            (torch.from_numpy(slopes),),
            N,
            pts,
            score - slopes[h] * np.abs(i - j),
            _SCORE_TABLE,
            "subtract slopes[h] * |q_idx - kv_idx| at each call",
            score,
        )
    )
    return _grade("alibi_mod", fn, "score_mod", cases, out)


_SOFTCAP_FORMULA = """
score_mod(score, b, h, q_idx, kv_idx) = cap * torch.tanh(score / cap)
"""


@grader("flashedu.flex.softcap", formula=_SOFTCAP_FORMULA)
def softcap_mod(fn, *, seed=None, out=print):
    """Grade `fn(cap) -> score_mod`: cap * tanh(score / cap)."""
    rng = rng_for(seed)
    cases = []
    for cap, scale, what, hint in [
        (50.0, 1.0, "scores << cap", "far below the cap, soft-capping changes little"),
        (5.0, 3.0, "scores >> cap", "every capped score lies strictly inside (-cap, cap)"),
        (20.0, 2.5, "both", "cap * tanh(score / cap)"),
    ]:
        cap *= rng.uniform(0.8, 1.25)
        q, k, v = _qkv(rng, 1, 2, int(rng.integers(17, 40)), scale=scale)
        s = flex.dense_scores(q, k)
        mistakes = {
            "not scaled back: multiply by cap after the tanh": np.tanh(s / cap),
            "score not divided by cap inside the tanh": cap * np.tanh(s),
            "a hard clamp is not soft-capping: use cap * tanh(score / cap)": np.clip(s, -cap, cap),
            "tanh(score) alone: divide by cap inside, multiply by cap outside": np.tanh(s),
        }
        label = f"cap={cap:.3g}, {what}"
        cases.append(_score_case(label, (cap,), (q, k, v), cap * np.tanh(s / cap), mistakes, hint))
    return _grade("softcap_mod", fn, "score_mod", cases, out)


_RELATIVE_BIAS_FORMULA = """
score_mod(score, b, h, q_idx, kv_idx) =
    score + table[h, (kv_idx - q_idx).clamp(-max_distance, max_distance) + max_distance]
"""


@grader("flashedu.flex.relative_bias", formula=_RELATIVE_BIAS_FORMULA)
def relative_bias_mod(fn, *, seed=None, out=print):
    """Grade `fn(table, max_distance) -> score_mod`: score + table[h, clip(kv - q, -D, D) + D]
    with table (H, 2 D + 1) and D = max_distance."""
    rng = rng_for(seed)
    cases = []
    for H, N, D, hint in [
        (1, 5, 4, "add table[h, kv_idx - q_idx + D]"),
        (3, 9, 8, "each head has its own row of the table: table[h, ...]"),
        (2, 30, 3, "offsets beyond D share the end entries: clamp kv_idx - q_idx to [-D, D]"),
    ]:
        q, k, v = _qkv(rng, 1, H, N)
        table = rng.standard_normal((H, 2 * D + 1))
        s, (i, j) = flex.dense_scores(q, k), _grid(N)
        rel = np.clip(j - i, -D, D) + D
        mistakes = {
            "offset reversed: index by kv_idx - q_idx, not q_idx - kv_idx": s
            + table[:, np.clip(i - j, -D, D) + D],
            "one row for all heads: index the table by the head, table[h, ...]": s + table[0][rel],
            "offset not shifted: add D so that -D .. D maps to 0 .. 2D": s
            + table[:, np.clip(j - i, -D, D) % (2 * D + 1)],
        }
        label = f"H={H}, N={N}, D={D}" + (" (clipped)" if N > D + 1 else "")
        cases.append(
            _score_case(
                label, (torch.from_numpy(table), D), (q, k, v), s + table[:, rel], mistakes, hint
            )
        )
    H, D, N = 3, 8, int(rng.integers(4096, 6145))
    table = rng.standard_normal((H, 2 * D + 1))
    pts, score = _points(rng, N, H, D + 2), rng.standard_normal(64)
    h, i, j = pts.T
    cases.append(
        _long_case(
            f"N={N}, D={D}: single (query, key) pairs, no table",
            fn,
            "score_mod",
            (torch.from_numpy(table), D),
            N,
            pts,
            score + table[h, np.clip(j - i, -D, D) + D],
            _SCORE_TABLE,
            "add table[h, clamp(kv_idx - q_idx, -D, D) + D] at each call",
            score,
        )
    )
    return _grade("relative_bias_mod", fn, "score_mod", cases, out)


# ------------------------------------------------------------------------------------- mask mods


_SLIDING_WINDOW_FORMULA = """
mask_mod(b, h, q_idx, kv_idx) = (kv_idx <= q_idx) & (q_idx - kv_idx <= window)
"""


@grader("flashedu.flex.sliding_window", formula=_SLIDING_WINDOW_FORMULA)
def sliding_window_mask(fn, *, seed=None, out=print):
    """Grade `fn(window) -> mask_mod`: query i sees key j iff i - window <= j <= i (causal window,
    flashedu's window_size=(window, 0))."""
    rng = rng_for(seed)
    cases = []
    for N, w, hint in [
        (9, 0, "window 0 keeps only kv_idx == q_idx"),
        (int(rng.integers(15, 30)), 3, "keys from q_idx - window to q_idx, both ends included"),
        (40, int(rng.integers(5, 9)), "a sliding window is causal and bounded"),
    ]:
        i, j = _grid(N)
        mistakes = {
            "off by one: the window is inclusive, q_idx - kv_idx <= window": (i >= j) & (i - j < w),
            "keys after the query are visible: the window is causal too": np.abs(i - j) <= w,
            "that is causal attention: also hide keys more than `window` back": j <= i,
            "one key too many: q_idx - kv_idx <= window": (i >= j) & (i - j <= w + 1),
            "the diagonal was hidden: a query sees its own key, kv_idx <= q_idx": (i > j)
            & (i - j <= w),
        }
        want = (i >= j) & (i - j <= w)
        cases.append(_mask_case(f"N={N}, window={w}", rng, (w,), want, mistakes, hint))
    N, w = int(rng.integers(4096, 6145)), int(rng.integers(16, 65))
    pts = _points(rng, N, 2, w + 2)
    _, i, j = pts.T
    cases.append(
        _long_case(
            f"N={N}, window={w}: single (query, key) pairs, no table",
            fn,
            "mask_mod",
            (w,),
            N,
            pts,
            ((i >= j) & (i - j <= w)).astype(float),
            _MASK_TABLE,
            "compare q_idx - kv_idx with 0 and with the window at each call",
        )
    )
    return _grade("sliding_window_mask", fn, "mask_mod", cases, out)


_PREFIX_LM_FORMULA = """
mask_mod(b, h, q_idx, kv_idx) = (kv_idx <= q_idx) | (kv_idx < prefix_len)
"""


@grader("flashedu.flex.prefix_lm", formula=_PREFIX_LM_FORMULA)
def prefix_lm_mask(fn, *, seed=None, out=print):
    """Grade `fn(prefix_len) -> mask_mod`: every query sees keys 0 .. prefix_len - 1, and the
    others causally (kv_idx <= q_idx)."""
    rng = rng_for(seed)
    cases = []
    for N, p, hint in [
        (12, 0, "with prefix_len = 0 this is causal attention"),
        (int(rng.integers(16, 30)), 5, "queries in the prefix see the whole prefix"),
        (33, int(rng.integers(8, 12)), "kv_idx < prefix_len, or kv_idx <= q_idx"),
    ]:
        i, j = _grid(N)
        mistakes = {
            "the prefix is not bidirectional: all queries see every prefix key": j <= i,
            "off by one: the prefix is keys 0 .. prefix_len - 1": (j <= i) | (j <= p),
            "the prefix is a set of keys: prefix queries must not see the suffix": (j <= i)
            | (i < p),
            "`and` instead of `or`: visible if in the prefix OR not after the query": (j <= i)
            & (j < p),
            "the diagonal was hidden: a query sees its own key, kv_idx <= q_idx": (j < i) | (j < p),
        }
        want = (j <= i) | (j < p)
        cases.append(_mask_case(f"N={N}, prefix_len={p}", rng, (p,), want, mistakes, hint))
    N = int(rng.integers(4096, 6145))
    p = int(rng.integers(N // 4, N // 2))
    pts = _points(rng, N, 2, 4)
    pts[:8, 2] = p - 4 + np.arange(8)  # keys on both sides of the prefix's end
    _, i, j = pts.T
    cases.append(
        _long_case(
            f"N={N}, prefix_len={p}: single (query, key) pairs, no table",
            fn,
            "mask_mod",
            (p,),
            N,
            pts,
            ((j <= i) | (j < p)).astype(float),
            _MASK_TABLE,
            "kv_idx < prefix_len, or kv_idx <= q_idx, at each call",
        )
    )
    return _grade("prefix_lm_mask", fn, "mask_mod", cases, out)


_DOCUMENT_FORMULA = """
doc = torch.repeat_interleave(torch.arange(n), cu_seqlens.diff())   (once, outside)
mask_mod(b, h, q_idx, kv_idx) = (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)
"""


@grader("flashedu.flex.document", formula=_DOCUMENT_FORMULA)
def document_mask(fn, *, seed=None, out=print):
    """Grade `fn(cu_seqlens) -> mask_mod`: packed documents, causal within each; query i sees key j
    iff j <= i and both lie in the same document (cu_seqlens: (n + 1,) int32 prefix sums)."""
    rng = rng_for(seed)
    cases = []
    for lengths, hint in [
        ([int(rng.integers(8, 20))], "a single document is plain causal attention"),
        ([5, int(rng.integers(6, 12))], "never another document: compare the documents of both"),
        ([1, 17, 64, 3], "document s holds tokens cu[s] .. cu[s + 1] - 1"),
        ([4, 0, int(rng.integers(3, 9))], "lengths may be 0"),
    ]:
        cu = np.cumsum([0, *lengths])
        N = int(cu[-1])
        doc = np.repeat(np.arange(len(lengths)), lengths)
        early = np.searchsorted(cu[1:], np.arange(N), side="left")  # doc start -> previous doc
        (i, j), same = _grid(N), doc[:, None] == doc[None, :]
        mistakes = {
            "tokens see other documents: require the same document for both": j <= i,
            "not causal: within a document a token sees only earlier tokens": same,
            "document ids off by one: token cu_seqlens[s] starts document s": (j <= i)
            & (early[:, None] == early[None, :]),
            "the diagonal was hidden: a token sees itself, kv_idx <= q_idx": same & (j < i),
        }
        if len(lengths) > 1 and lengths[0] > 0:
            equal = np.arange(N) // lengths[0]  # every document as long as the first
            mistakes[
                "the documents were taken to be equally long: read each boundary from cu_seqlens"
            ] = (j <= i) & (equal[:, None] == equal[None, :])
        params = (torch.tensor(cu, dtype=torch.int32),)
        cases.append(_mask_case(f"lengths {lengths}", rng, params, same & (j <= i), mistakes, hint))
    lengths = [int(x) for x in rng.integers(1, 900, 9)]
    lengths.insert(int(rng.integers(1, 9)), 0)  # an empty document in the middle
    cu = np.cumsum([0, *lengths])
    N = int(cu[-1])
    doc = np.repeat(np.arange(len(lengths)), lengths)
    pts = _points(rng, N, 2, 4)
    edges = cu[1:-1][cu[1:-1] < N]
    starts = rng.choice(edges, 12)
    pts[:12, 1], pts[:12, 2] = starts + rng.integers(0, 3, 12), starts - rng.integers(1, 4, 12)
    pts[:, 1:] = np.clip(pts[:, 1:], 0, N - 1)
    _, i, j = pts.T
    cases.append(
        _long_case(
            f"{len(lengths)} documents, N={N}: single (query, key) pairs, no table",
            fn,
            "mask_mod",
            (torch.tensor(cu, dtype=torch.int32),),
            N,
            pts,
            ((doc[i] == doc[j]) & (j <= i)).astype(float),
            _DOC_TABLE,
            "each token's document id (N numbers, once), compared for q_idx and kv_idx",
        )
    )
    return _grade("document_mask", fn, "mask_mod", cases, out)
