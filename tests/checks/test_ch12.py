"""Chapter 12 graders: a learner's solutions pass, flashedu's own are refused, and each planted bug
fails with a line that names it."""

import numpy as np
import pytest

from flashedu import checks, serving
from flashedu.testing import run_grader

SEEDS = [0, 1, 2]

# ---------------------------------------------------------------------------- 12.1 the cache


def append(cache, seq, k, v, *, every=False, early=False):
    """A learner's append, with switches that plant mistakes."""
    ps = cache.page_size
    n = cache.lengths.get(seq, 0)
    table = cache.tables.setdefault(seq, [])
    for i in range(len(k)):
        pos = n + i
        full = (pos % ps == ps - 1 and pos > 0) if early else pos % ps == 0
        if full or (every and i == 0) or not table:
            table.append(cache.free_pages.pop())
        cache.k_pages[table[-1], pos % ps] = k[i]
        cache.v_pages[table[-1], pos % ps] = v[i]
    cache.lengths[seq] = n + len(k)


def free(cache, seq, *, give_back=True, forget=True):
    pages = cache.tables[seq]
    if give_back:
        cache.free_pages.extend(pages)
    if forget:
        del cache.tables[seq], cache.lengths[seq]


def test_paged_cache_accepts_a_learners_append_and_free():
    for seed in SEEDS:
        report = checks.paged_cache(append, free, seed=seed, out=lambda *a: None)
        assert report.passed, report.text


@pytest.mark.parametrize(
    "kw,free_kw,words",
    [
        ({"every": True}, {}, "a new page was taken at every append"),
        ({"early": True}, {}, "counted full one token early"),
        ({}, {"give_back": False}, "free did not give the sequence's pages back"),
        ({}, {"forget": False}, "free left the sequence in cache.tables"),
    ],
    ids=["page per append", "off by one", "pages not returned", "sequence kept"],
)
def test_paged_cache_names_each_planted_bug(kw, free_kw, words):
    lines = []
    report = checks.paged_cache(
        lambda c, s, k, v: append(c, s, k, v, **kw),
        lambda c, s: free(c, s, **free_kw),
        seed=4,
        out=lines.append,
    )
    assert not report.passed
    assert words in report.diagnosis, "\n".join(lines)


def test_paged_cache_refuses_flashedus_own_functions():
    report = checks.paged_cache(
        serving.append_tokens, serving.free_sequence, seed=0, out=lambda *a: None
    )
    assert report.diagnosis.startswith("called flashedu.serving.append_tokens")


def test_paged_cache_needs_free_and_reports_a_stub():
    lines = []

    def stub(cache, seq, k, v):
        raise NotImplementedError("Exercise 12.1: about 10 lines")

    report = checks.paged_cache(stub, stub, out=lines.append)
    assert lines == ["paged_cache: not attempted yet"] and not report.attempted
    report = checks.paged_cache(append, None, seed=0, out=lambda *a: None)
    assert not report.passed and "needs both functions" in report.text


# ----------------------------------------------------------------------- 12.2 paged attention


def paged(q, k_pages, v_pages, block_table, cache_seqlens, *, logical=False, whole=False,
          drop=False, mod=False, rescale=True, gqa="div", lse_m=True):  # fmt: skip
    """A learner's paged attention, one sequence and one page at a time, with switches."""
    B, H, N_q, d = q.shape
    ps, H_kv = k_pages.shape[1], k_pages.shape[2]
    g = H // H_kv
    heads = np.arange(H) // g if gqa == "div" else np.arange(H) % H_kv
    o = np.zeros((B, H, N_q, v_pages.shape[3]))
    lse = np.full((B, H, N_q), -np.inf)
    for b in range(B):
        n = int(cache_seqlens[b])
        m, l = np.full((H, N_q), -np.inf), np.zeros((H, N_q))
        acc = np.zeros((H, N_q, v_pages.shape[3]))
        pages = n // ps if drop else -(-n // ps)
        for j in range(pages):
            page = j if logical else block_table[b, j]
            valid = ps if whole else min(ps, n - j * ps)
            if mod and j == pages - 1:
                valid = n % ps
            k = k_pages[page, :valid][:, heads].transpose(1, 0, 2)  # (H, valid, d)
            v = v_pages[page, :valid][:, heads].transpose(1, 0, 2)
            s = q[b] @ k.transpose(0, 2, 1) / np.sqrt(d)
            m_new = np.maximum(m, s.max(-1, initial=-np.inf))
            alpha = np.exp(m - m_new) if rescale else 1.0
            p = np.exp(s - m_new[..., None])
            l = alpha * l + p.sum(-1)
            acc = (alpha[..., None] if rescale else 1.0) * acc + p @ v
            m = m_new
        if pages:
            o[b] = acc / l[..., None]
            lse[b] = (m if lse_m else 0) + np.log(l)
    return o, lse


def paged_by_page_index(q, k_pages, v_pages, block_table, cache_seqlens):
    """Honest, written another way: page j of every sequence at once, the whole batch in one
    step; the running state kept for all sequences together, and in log space for lse."""
    B, H, N_q, d = q.shape
    ps, H_kv = k_pages.shape[1], k_pages.shape[2]
    lens = np.asarray(cache_seqlens)
    m = np.full((B, H, N_q), -np.inf)
    l = np.zeros((B, H, N_q))
    acc = np.zeros((B, H, N_q, v_pages.shape[3]))
    for j in range(int(-(-lens.max() // ps))):
        pages = block_table[:, j]  # (B,), -1 where a sequence has no page j
        k = k_pages[pages]  # (B, ps, H_kv, d): page j of each sequence
        v = v_pages[pages]
        k = np.repeat(k.transpose(0, 2, 1, 3), H // H_kv, axis=1)  # (B, H, ps, d)
        v = np.repeat(v.transpose(0, 2, 1, 3), H // H_kv, axis=1)
        s = np.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(d)
        keys = j * ps + np.arange(ps)
        s = np.where((keys[None, :] < lens[:, None])[:, None, None, :], s, -np.inf)
        m_new = np.maximum(m, s.max(-1))
        safe = np.where(np.isinf(m_new), 0.0, m_new)
        alpha = np.exp(m - safe)
        p = np.exp(s - safe[..., None])
        l = alpha * l + p.sum(-1)
        acc = alpha[..., None] * acc + np.einsum("bhqk,bhkd->bhqd", p, v)
        m = m_new
    with np.errstate(divide="ignore", invalid="ignore"):
        o = np.where(l[..., None] > 0, acc / l[..., None], 0.0)
        lse = np.where(l > 0, np.where(np.isinf(m), 0, m) + np.log(l), -np.inf)
    return o, lse


@pytest.mark.parametrize("fn", [paged, paged_by_page_index], ids=["per sequence", "per page"])
def test_paged_attention_accepts_honest_solutions(fn):
    for seed in SEEDS:
        report, text = run_grader(checks.paged_attention, fn, seed=seed)
        assert report.passed, text


@pytest.mark.parametrize(
    "kw,words",
    [
        ({"logical": True}, "instead of through the block table"),
        ({"whole": True}, "all page_size slots of the last page were read"),
        ({"drop": True}, "the last, partly filled page was skipped"),
        ({"mod": True}, "counted as len % page_size"),
        ({"rescale": False}, "not rescaled when the row max grew"),
        ({"lse_m": False}, "lse is log l without the running max"),
        ({"gqa": "mod"}, "read K/V head h % H_kv"),
    ],
    ids=["page j not block_table", "last page whole", "last page dropped", "len % ps", "no rescale",
         "lse without m", "gqa mapping"],
)  # fmt: skip
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_paged_attention_names_each_planted_bug(kw, words):
    report, text = run_grader(checks.paged_attention, lambda *a: paged(*a, **kw), seed=5)
    assert not report.passed
    assert words in report.diagnosis, text


def test_paged_attention_refuses_flashedus_own():
    report, _ = run_grader(checks.paged_attention, serving.paged_attention, seed=0)
    assert report.diagnosis.startswith("called flashedu.serving.paged_attention")


# ------------------------------------------------------------------------------- 12.4 sinks


def sinks(q, k, v, sink, block_n, *, post_hoc=False, unshifted=False, every_tile=False,
          lse_sink=True, after_norm=False):  # fmt: skip
    """A learner's tiled attention with a sink, with switches that plant mistakes."""
    N_q = q.shape[0]
    start = post_hoc or unshifted or after_norm or every_tile
    m = np.full(N_q, -np.inf if start else sink, q.dtype)
    l = np.zeros(N_q, q.dtype) if start or np.isinf(sink) else np.ones(N_q, q.dtype)
    o = np.zeros((N_q, v.shape[1]), q.dtype)
    states = []
    for c0 in range(0, k.shape[0], block_n):
        s = q @ k[c0 : c0 + block_n].T / np.sqrt(q.shape[1]).astype(q.dtype)
        m_new = np.maximum(m, s.max(1))
        if every_tile:
            m_new = np.maximum(m_new, sink)
        a = np.exp(m - m_new)
        p = np.exp(s - m_new[:, None])
        l = a * l + p.sum(1) + (np.exp(sink - m_new) if every_tile else 0)
        o = a[:, None] * o + p @ v[c0 : c0 + block_n]
        m = m_new
        states.append((m.copy(), l.copy(), o.copy()))
    if post_hoc:  # merge the sink's state (sink, 1, 0) after the loop: right numbers
        m_all = np.maximum(m, sink)
        l = l * np.exp(m - m_all) + np.exp(sink - m_all)
        o, m = o * np.exp(m - m_all)[:, None], m_all
    if unshifted:
        l = l + np.exp(sink)
    if after_norm:
        lse_keys = m + np.log(l)
        return o / l[:, None], np.logaddexp(lse_keys, sink), states
    lse = m + np.log(l)
    if not lse_sink:
        lse = np.log(np.exp(lse) - np.exp(sink))
    return o / l[:, None], lse, states


def sinks_merge(q, k, v, sink, block_n):
    """Honest, another way: the sink as a first state (sink, 1, 0), each tile's own state merged
    into the running one with the chapter 02 merge rule."""
    d = q.shape[1]
    state = (np.full(q.shape[0], sink, q.dtype), np.ones(q.shape[0], q.dtype) * np.isfinite(sink),
             np.zeros((q.shape[0], v.shape[1]), q.dtype))  # fmt: skip
    states = []
    for c0 in range(0, k.shape[0], block_n):
        s = q @ k[c0 : c0 + block_n].T / np.sqrt(d).astype(q.dtype)
        m_t = s.max(1)
        p = np.exp(s - m_t[:, None])
        m = np.maximum(state[0], m_t)
        wa, wb = np.exp(state[0] - m), np.exp(m_t - m)
        state = (
            m,
            wa * state[1] + wb * p.sum(1),
            wa[:, None] * state[2] + wb[:, None] * (p @ v[c0 : c0 + block_n]),
        )
        states.append(state)
    m, l, o = state
    return o / l[:, None], m + np.log(l), states


@pytest.mark.parametrize("fn", [sinks, sinks_merge], ids=["running state", "merge"])
def test_sink_attention_accepts_honest_solutions(fn):
    for seed in SEEDS:
        report, text = run_grader(checks.sink_attention, fn, seed=seed)
        assert report.passed, text


@pytest.mark.parametrize(
    "kw,words",
    [
        ({"post_hoc": True}, "the sink is not in the running state"),
        ({"unshifted": True}, "exp(sink) was added without subtracting the running max"),
        ({"every_tile": True}, "the sink joined the sum at every tile"),
        ({"lse_sink": False}, "lse leaves the sink out"),
        ({"after_norm": True}, "the sink was added after normalisation"),
    ],
    ids=["post hoc", "unshifted", "every tile", "lse without sink", "after normalisation"],
)
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_sink_attention_names_each_planted_bug(kw, words):
    report, text = run_grader(checks.sink_attention, lambda *a: sinks(*a, **kw), seed=6)
    assert not report.passed
    assert words in report.diagnosis, text


def test_sink_attention_refuses_the_shown_solution():
    report, _ = run_grader(checks.sink_attention, checks.ch12.sink_states, seed=0)
    assert report.diagnosis.startswith("called flashedu.checks.ch12.sink_states")


# --------------------------------------------------------------------------------- 12.5 MLA


def absorbed(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, *, scale_dc=False, rope=True):
    """A learner's absorbed MLA step in plain NumPy, with switches that plant mistakes."""
    d = c_kv.shape[-1] + q_rope.shape[-1] if scale_dc else q_nope.shape[-1] + q_rope.shape[-1]
    q_lat = np.einsum("bhqe,hce->bhqc", q_nope, w_uk)  # (B, H, N_q, d_c)
    s = np.einsum("bhqc,bnc->bhqn", q_lat, c_kv)
    if rope:
        s = s + np.einsum("bhqr,bnr->bhqn", q_rope, k_rope)
    s = s / np.sqrt(d)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o_lat = np.einsum("bhqn,bnc->bhqc", p, c_kv)
    return np.einsum("bhqc,hce->bhqe", o_lat, w_uv)


def absorbed_with_decoding(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv):
    """Honest, another way: the folded query and the latent cache handed to decoding.forward as
    MQA (one K/V head), which the grader allows."""
    from flashedu import decoding

    q = np.concatenate([q_nope @ w_uk.transpose(0, 2, 1)[None], q_rope], -1)
    k = np.concatenate([c_kv, k_rope], -1)[:, None]
    o_lat, _ = decoding.forward(q, k, c_kv[:, None], softmax_scale=192**-0.5)
    return o_lat @ w_uv[None]


@pytest.mark.parametrize("fn", [absorbed, absorbed_with_decoding], ids=["numpy", "decoding"])
def test_mla_absorbed_accepts_honest_solutions(fn):
    for seed in SEEDS:
        report, text = run_grader(checks.mla_absorbed, fn, seed=seed)
        assert report.passed, text


@pytest.mark.parametrize(
    "kw,words",
    [
        ({"scale_dc": True}, "scaled by 1/sqrt(d_c + d_rope)"),
        ({"rope": False}, "the RoPE part was left out"),
    ],
    ids=["latent scale", "no rope"],
)
def test_mla_absorbed_names_each_planted_bug(kw, words):
    report, text = run_grader(checks.mla_absorbed, lambda *a: absorbed(*a, **kw), seed=7)
    assert not report.passed
    assert words in report.diagnosis, text


def test_mla_absorbed_refuses_flashedus_own():
    report, _ = run_grader(checks.mla_absorbed, serving.mla_absorbed, seed=0)
    assert report.diagnosis.startswith("called flashedu.serving.mla_absorbed")
