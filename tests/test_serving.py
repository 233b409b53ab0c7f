"""flashedu.serving against the float64 reference: the paged cache's bookkeeping, attention through
a scrambled block table (ragged lengths, an empty sequence, GQA, causal, sinks, several page
sizes), the sinks' gradients by gradcheck, MLA's absorbed step against the naive one, the decode
loop against the GPT's own forward, the byte model against the measured copies, and one named
error for every bad input."""

import numpy as np
import pytest
import torch

from flashedu import gpt, masks, reference, serving
from flashedu.testing import assert_close, tolerance

# ------------------------------------------------------------------------------------ helpers


def fill(rng, lens, page_size, H_kv, d, d_v, dtype="float64", spare=3):
    """A pool with the sequences' pages in scrambled order, the unused slots full of garbage:
    (k_pages, v_pages, block_table, cache_seqlens, contiguous K list, V list)."""
    need = [-(-n // page_size) for n in lens]
    num_pages = sum(need) + spare
    order = rng.permutation(num_pages)
    k_pages = rng.standard_normal((num_pages, page_size, H_kv, d)) * 50  # garbage everywhere
    v_pages = rng.standard_normal((num_pages, page_size, H_kv, d_v)) * 50
    table = np.full((len(lens), max(need + [1]) + 1), -1, np.int32)
    ks, vs, used = [], [], 0
    for b, n in enumerate(lens):
        k, v = rng.standard_normal((n, H_kv, d)), rng.standard_normal((n, H_kv, d_v))
        for j in range(need[b]):
            p = int(order[used])
            used += 1
            table[b, j] = p
            rows = slice(j * page_size, min(n, (j + 1) * page_size))
            k_pages[p, : rows.stop - rows.start] = k[rows]
            v_pages[p, : rows.stop - rows.start] = v[rows]
        ks.append(k)
        vs.append(v)
    cast = lambda a: a.astype(dtype)
    return cast(k_pages), cast(v_pages), table, np.array(lens, np.int32), ks, vs


def attention_with_sink_column(q, k, v, sinks, *, causal=False, scale=None):
    """float64 attention of q (H, N_q, d) against contiguous k (N, H_kv, d), v (N, H_kv, d_v), with
    the sink added explicitly as one more score column whose value row is zero."""
    H, N_q, d = q.shape
    N, H_kv, d_v = v.shape
    scale = 1 / np.sqrt(d) if scale is None else scale
    kk = np.repeat(k.transpose(1, 0, 2).astype(np.float64), H // H_kv, axis=0)  # (H, N, d)
    vv = np.repeat(v.transpose(1, 0, 2).astype(np.float64), H // H_kv, axis=0)
    s = q.astype(np.float64) @ kk.swapaxes(-1, -2) * scale  # (H, N_q, N)
    if causal and N:
        s = np.where(masks.visible(N_q, N, causal=True), s, -np.inf)
    sink = np.full(H, -np.inf) if sinks is None else np.asarray(sinks, np.float64)
    sink_col = np.broadcast_to(sink[:, None, None], (H, N_q, 1))
    s = np.concatenate([sink_col, s], axis=-1)
    vv = np.concatenate([np.zeros((H, 1, d_v)), vv], axis=1)  # the sink has no value
    with np.errstate(invalid="ignore", divide="ignore"):
        lse = np.logaddexp.reduce(s, axis=-1)
        p = np.where(np.isneginf(lse)[..., None], 0.0, np.exp(s - lse[..., None]))
    return p @ vv, lse


def expected(q, ks, vs, sinks, causal, scale=None):
    outs = [
        attention_with_sink_column(q[b], ks[b], vs[b], sinks, causal=causal, scale=scale)
        for b in range(q.shape[0])
    ]
    return np.stack([o for o, _ in outs]), np.stack([lse for _, lse in outs])


# --------------------------------------------------------------------------- the paged cache


def test_pages_are_taken_only_when_the_last_one_is_full(rng):
    cache = serving.PagedKVCache(8, 4, 2, 3)
    for n in range(1, 14):
        cache.append("a", rng.standard_normal((1, 2, 3)), rng.standard_normal((1, 2, 3)))
        assert cache.pages_used == len(cache.tables["a"]) == -(-n // 4)
        assert cache.lengths["a"] == n


def test_append_keeps_written_pages_in_place_and_the_pool_is_never_reallocated(rng):
    cache = serving.PagedKVCache(10, 3, 1, 4)
    pool_k, pool_v = cache.k_pages, cache.v_pages
    k, v = rng.standard_normal((11, 1, 4)), rng.standard_normal((11, 1, 4))
    cache.append(0, k[:5], v[:5])
    first = list(cache.tables[0])
    snapshot = cache.k_pages[first].copy()
    cache.append(0, k[5:], v[5:])  # several pages at once
    assert cache.k_pages is pool_k and cache.v_pages is pool_v
    assert cache.tables[0][:2] == first
    np.testing.assert_array_equal(cache.k_pages[first][:, :2], snapshot[:, :2])
    table, lens = cache.block_table([0])
    got = cache.k_pages[table[0, :4]].reshape(-1, 1, 4)[: lens[0]]
    np.testing.assert_array_equal(got, k.astype(np.float32))


def test_freed_pages_are_reused_and_the_pool_can_run_out(rng):
    cache = serving.PagedKVCache(4, 2, 1, 2)
    row = lambda n: rng.standard_normal((n, 1, 2))
    cache.append("a", row(5), row(5))  # 3 pages
    pages_a = set(cache.tables["a"])
    cache.append("b", row(1), row(1))
    with pytest.raises(MemoryError, match="all 4 pages are in use"):
        cache.append("b", row(2), row(2))
    cache.free("a")
    assert "a" not in cache.tables and "a" not in cache.lengths
    assert set(cache.free_pages) == pages_a
    cache.append("c", row(6), row(6))
    assert set(cache.tables["c"]) == pages_a and cache.pages_used == 4


def test_fork_shares_pages_and_copies_the_last_one_on_write(rng):
    cache = serving.PagedKVCache(8, 4, 1, 2)
    k = rng.standard_normal((6, 1, 2))
    cache.append("p", k, k)
    cache.fork("p", "q")
    assert cache.tables["q"] == cache.tables["p"] and cache.pages_used == 2
    cache.append("q", k[:1], k[:1])  # the shared half-full page is copied, the full one shared
    assert cache.tables["q"][0] == cache.tables["p"][0]
    assert cache.tables["q"][1] != cache.tables["p"][1] and cache.pages_used == 3
    table, lens = cache.block_table(["p", "q"])
    for b, rows in enumerate([k, np.concatenate([k, k[:1]])]):
        got = cache.k_pages[table[b, : -(-lens[b] // 4)]].reshape(-1, 1, 2)[: lens[b]]
        np.testing.assert_allclose(got, rows.astype(np.float32))
    cache.free("p")
    assert cache.pages_used == 2  # the shared first page stays: "q" still holds it
    cache.free("q")
    assert cache.pages_used == 0


# -------------------------------------------------------------------------- paged attention


@pytest.mark.parametrize("page_size", [1, 3, 4, 16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("H,H_kv,N_q", [(4, 2, 1), (3, 3, 2), (4, 1, 5)])
def test_paged_attention_matches_the_reference(rng, page_size, causal, with_sinks, H, H_kv, N_q):
    lens = [int(rng.integers(2 * page_size + 1, 5 * page_size + 2)), 0, page_size, 3, 17]
    k_pages, v_pages, table, seqlens, ks, vs = fill(rng, lens, page_size, H_kv, 8, 5)
    q = rng.standard_normal((len(lens), H, N_q, 8))
    sinks = rng.standard_normal(H) * 2 if with_sinks else None
    o, lse = serving.paged_attention(
        q, k_pages, v_pages, table, seqlens, causal=causal, sinks=sinks
    )
    o_ref, lse_ref = expected(q, ks, vs, sinks, causal)
    assert_close(o, o_ref, "float64", name="o")
    assert_close(lse, lse_ref, "float64", name="lse")
    if not with_sinks:  # the sink-free case is exactly the float64 oracle's
        for b, n in enumerate(lens):
            if n:
                k = ks[b].transpose(1, 0, 2)[None]
                o_b, lse_b = reference.forward(q[b : b + 1], k, vs[b].transpose(1, 0, 2)[None],
                                               causal=causal)  # fmt: skip
                assert_close(o[b : b + 1], o_b, "float64")
                assert_close(lse[b : b + 1], lse_b, "float64")


def test_paged_attention_in_float32_and_with_a_scale(rng):
    k_pages, v_pages, table, seqlens, ks, vs = fill(rng, [9, 30, 1], 8, 2, 16, 16, "float32")
    q = rng.standard_normal((3, 4, 1, 16)).astype(np.float32)
    sinks = rng.standard_normal(4).astype(np.float32)
    o, lse = serving.paged_attention(
        q, k_pages, v_pages, table, seqlens, softmax_scale=0.3, sinks=sinks
    )
    assert o.dtype == np.float32 and lse.dtype == np.float32
    o_ref, lse_ref = expected(q, ks, vs, sinks, False, scale=0.3)
    assert_close(o, o_ref, "float32")
    assert_close(lse, lse_ref, "float32")


def test_empty_sequences_and_rows_that_see_nothing(rng):
    k_pages, v_pages, table, seqlens, ks, vs = fill(rng, [0, 2], 4, 1, 4, 4)
    q = rng.standard_normal((2, 2, 4, 4))
    o, lse = serving.paged_attention(q, k_pages, v_pages, table, seqlens, causal=True)
    assert (o[0] == 0).all() and np.isneginf(lse[0]).all()
    assert (o[1, :, :2] == 0).all() and np.isneginf(lse[1, :, :2]).all()  # N_q = 4 > 2 keys
    sinks = np.array([1.5, -np.inf])
    o, lse = serving.paged_attention(q, k_pages, v_pages, table, seqlens, causal=True, sinks=sinks)
    assert np.isfinite(o).all() and (o[0] == 0).all()
    assert (lse[0, 0] == 1.5).all() and np.isneginf(lse[0, 1]).all()


def test_huge_sinks_stay_finite_in_float32(rng):
    k_pages, v_pages, table, seqlens, ks, vs = fill(rng, [20], 4, 1, 8, 8, "float32")
    q = rng.standard_normal((1, 2, 1, 8)).astype(np.float32)
    sinks = np.array([100.0, -100.0], np.float32)  # exp(100) overflows float32
    o, lse = serving.paged_attention(q, k_pages, v_pages, table, seqlens, sinks=sinks)
    assert np.isfinite(o).all() and np.isfinite(lse).all()
    o_ref, lse_ref = expected(q, ks, vs, sinks, False)
    assert_close(o, o_ref, "float32")
    assert_close(lse, lse_ref, "float32")


# ----------------------------------------------------------------------------------- sinks


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_n", [1, 4, 16])
def test_sink_forward_matches_the_explicit_sink_column(rng, causal, block_n):
    B, H, H_kv, N_q, N_k = 2, 4, 2, 5, 11
    q = rng.standard_normal((B, H, N_q, 8))
    k, v = rng.standard_normal((B, H_kv, N_k, 8)), rng.standard_normal((B, H_kv, N_k, 3))
    sinks = np.array([0.5, -np.inf, 3.0, -2.0])
    o, lse = serving.sink_forward(q, k, v, sinks, causal=causal, block_n=block_n)
    o_ref, lse_ref = expected(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), sinks, causal)
    assert_close(o, o_ref, "float64")
    assert_close(lse, lse_ref, "float64")
    o0, lse0 = serving.sink_forward(q, k, v, None, causal=causal, block_n=block_n)
    o_plain, lse_plain = reference.forward(q, k, v, causal=causal)
    assert_close(o0, o_plain, "float64")
    assert_close(lse0, lse_plain, "float64")


@pytest.mark.parametrize("causal", [False, True])
def test_sink_gradients_pass_gradcheck_in_float64(causal):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 3, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 6, 8, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(2, 2, 6, 5, dtype=torch.float64, generator=g, requires_grad=True)
    sinks = torch.randn(4, dtype=torch.float64, generator=g, requires_grad=True)
    fn = lambda *a: serving.attention_with_sinks(*a, causal=causal, softmax_scale=0.4)
    assert torch.autograd.gradcheck(fn, (q, k, v, sinks))


def test_dsink_is_minus_the_sink_probability_times_D(rng):
    q, k, v = rng.standard_normal((1, 2, 4, 8)), rng.standard_normal((1, 2, 6, 8)), None
    v = rng.standard_normal((1, 2, 6, 8))
    sinks, do = np.array([0.3, -1.0]), rng.standard_normal((1, 2, 4, 8))
    o, lse = serving.sink_forward(q, k, v, sinks)
    dsinks = serving.sink_backward(do, q, k, v, o, lse, sinks)[3]
    eps = 1e-6
    for h in range(2):
        up, down = sinks.copy(), sinks.copy()
        up[h] += eps
        down[h] -= eps
        f = lambda s: (serving.sink_forward(q, k, v, s)[0] * do).sum()
        assert dsinks[h] == pytest.approx((f(up) - f(down)) / (2 * eps), rel=1e-6, abs=1e-9)


# --------------------------------------------------------------------------------------- MLA


def mla_inputs(rng, B=2, H=4, N_q=1, N=37, d_c=16, d_rope=64, d_nope=128, d_v=128):
    return (
        rng.standard_normal((B, H, N_q, d_nope)),
        rng.standard_normal((B, H, N_q, d_rope)),
        rng.standard_normal((B, N, d_c)),
        rng.standard_normal((B, N, d_rope)),
        rng.standard_normal((H, d_c, d_nope)) / 8,
        rng.standard_normal((H, d_c, d_v)),
    )


@pytest.mark.parametrize("N_q,causal", [(1, False), (3, True), (3, False)])
@pytest.mark.parametrize("d_c", [16, 64])
def test_mla_absorbed_equals_naive_in_float64(rng, N_q, causal, d_c):
    args = mla_inputs(rng, N_q=N_q, d_c=d_c)
    o_naive, lse_naive = serving.mla_naive(*args, causal=causal)
    o_abs, lse_abs = serving.mla_absorbed(*args, causal=causal)
    assert o_abs.shape == (2, 4, N_q, 128)
    assert_close(o_abs, o_naive, "float64")
    assert_close(lse_abs, lse_naive, "float64")


def test_mla_naive_is_attention_with_192_wide_keys(rng):
    q_nope, q_rope, c, k_rope, w_uk, w_uv = mla_inputs(rng, B=1, H=2, N=9)
    k = np.concatenate(
        [np.einsum("nc,hce->hne", c[0], w_uk), np.broadcast_to(k_rope[0], (2, 9, 64))], -1
    )
    v = np.einsum("nc,hce->hne", c[0], w_uv)
    q = np.concatenate([q_nope, q_rope], -1)
    o_ref, _ = reference.forward(q, k[None], v[None])  # scale 1/sqrt(192)
    assert_close(serving.mla_naive(q_nope, q_rope, c, k_rope, w_uk, w_uv)[0], o_ref, "float64")


def test_mla_cache_bytes_per_token():
    sizes = serving.mla_cache_bytes(128, 512, 64, 128, 128, itemsize=2)
    assert sizes == {"MLA latent": 576 * 2, "expanded K and V": 128 * 320 * 2}


# ------------------------------------------------------------------------- the decode loop


@pytest.fixture(scope="module")
def model():
    tok = gpt.CharTokenizer(gpt.load_text())
    torch.manual_seed(0)
    return gpt.GPT(gpt.GPTConfig(vocab_size=tok.vocab_size)).eval(), tok


@pytest.mark.parametrize("kind", ["paged", "contiguous"])
def test_cached_decoding_gives_the_models_own_logits(model, kind):
    net, tok = model
    make = {
        "paged": lambda: serving.PagedKVCache(40, 4, 4, 16),
        "contiguous": lambda: serving.ContiguousKVCache(4, 16),
    }[kind]
    prompts = [tok.encode("The "), tok.encode("Once upon a"), tok.encode("A")]
    tokens, caches, logits = serving.generate(
        net, prompts, [12, 5, 20], cache=make, generator=torch.Generator().manual_seed(1)
    )
    assert [len(t) for t in tokens] == [16, 16, 21]
    for t, lg in zip(tokens, logits):
        full, _ = net(torch.tensor([t[:-1]]))
        torch.testing.assert_close(lg, full[0], atol=2e-5, rtol=2e-5)
    if kind == "paged":
        assert all(c.pages_used == 0 and not c.tables for c in caches)  # every sequence freed


def test_greedy_decoding_is_the_same_with_either_cache(model):
    net, tok = model
    prompts = [tok.encode("The "), tok.encode("It")]
    a = serving.generate(
        net, prompts, 10, cache=lambda: serving.PagedKVCache(16, 2, 4, 16), greedy=True
    )[0]
    b = serving.generate(net, prompts, 10, cache=lambda: serving.ContiguousKVCache(4, 16),
                         greedy=True)[0]  # fmt: skip
    assert a == b


def test_the_byte_model_counts_the_measured_copies(model):
    net, tok = model
    _, caches, _ = serving.generate(
        net, [tok.encode("The")], 30, cache=lambda: serving.ContiguousKVCache(4, 16)
    )
    per_token = 2 * 4 * 16 * 4  # K and V, H_kv = 4, d = 16, float32
    assert caches[0].bytes_copied == serving.copy_bytes(32, per_token)


def test_reserved_bytes_for_buffers_and_pages():
    assert serving.reserved_bytes([3, 10, 0], 8, max_len=16) == (3 * 16 * 8, 13 * 8)
    assert serving.reserved_bytes([3, 10, 0], 8, page_size=4) == ((4 + 12) * 8, 13 * 8)
    with pytest.raises(ValueError, match="exactly one of max_len and page_size"):
        serving.reserved_bytes([3], 8)


# --------------------------------------------------------------------------------- bad input


def _paged_args(rng):
    k_pages, v_pages, table, seqlens, _, _ = fill(rng, [5, 3], 4, 2, 8, 8)
    return rng.standard_normal((2, 4, 1, 8)), k_pages, v_pages, table, seqlens


@pytest.mark.parametrize(
    "change,error,words",
    [
        (lambda a: {"q": a["q"][0]}, ValueError, "q must be a 4-dim NumPy array"),
        (lambda a: {"v_pages": a["v_pages"][:, :2]}, ValueError, r"must share \(num_pages"),
        (lambda a: {"k_pages": a["k_pages"][..., :4]}, ValueError, "head dim"),
        (lambda a: {"q": a["q"][:, :3]}, ValueError, "not a multiple of the pages' H_kv"),
        (lambda a: {"q": a["q"].astype(np.float32)}, TypeError, "one float dtype"),
        (lambda a: {"block_table": a["block_table"] + 99}, ValueError, "outside the pool"),
        (lambda a: {"block_table": a["block_table"][:1]}, ValueError, "block_table must have B"),
        (lambda a: {"cache_seqlens": np.array([5, 99])}, ValueError, r"cache_seqlens\[1\]"),
        (lambda a: {"block_table": a["block_table"].astype(float)}, TypeError, "integers"),
        (lambda a: {"sinks": np.zeros(3)}, ValueError, "sinks must have shape"),
        (lambda a: {"sinks": np.array([0, 0, np.nan, 0])}, ValueError, "finite or -inf"),
        (lambda a: {"softmax_scale": "0.5"}, TypeError, "softmax_scale"),
        (lambda a: {"causal": "yes"}, TypeError, "causal must be a bool"),
    ],
)
def test_paged_attention_names_each_bad_input(rng, change, error, words):
    q, k_pages, v_pages, table, seqlens = _paged_args(rng)
    args = dict(q=q, k_pages=k_pages, v_pages=v_pages, block_table=table, cache_seqlens=seqlens)
    args.update(change(args))
    with pytest.raises(error, match=words) as e:
        serving.paged_attention(**args)
    assert str(e.value).startswith("serving.paged_attention:")


def test_a_repeated_page_in_a_row_is_refused(rng):
    q, k_pages, v_pages, table, seqlens = _paged_args(rng)
    table[0, 1] = table[0, 0]
    with pytest.raises(ValueError, match="twice"):
        serving.paged_attention(q, k_pages, v_pages, table, seqlens)


def test_cache_and_sink_functions_name_bad_input(rng):
    with pytest.raises(ValueError, match="serving.PagedKVCache: page_size"):
        serving.PagedKVCache(4, 0, 1, 2)
    with pytest.raises(TypeError, match="num_pages"):
        serving.PagedKVCache(4.5, 2, 1, 2)
    cache = serving.PagedKVCache(2, 2, 1, 2)
    cache.append("a", np.zeros((1, 1, 2)), np.zeros((1, 1, 2)))
    with pytest.raises(KeyError, match="cannot fork"):
        cache.fork("nobody", "b")
    with pytest.raises(KeyError, match="serving.PagedKVCache.free: no sequence 'b'"):
        cache.free("b")
    with pytest.raises(ValueError, match=r"append: k must have shape \(n, 1, 2\), got \(1, 2\)"):
        cache.append("a", np.zeros((1, 2)), np.zeros((1, 1, 2)))
    with pytest.raises(ValueError, match="the same number of rows"):
        cache.append("a", np.zeros((2, 1, 2)), np.zeros((1, 1, 2)))
    with pytest.raises(ValueError, match="serving.copy_bytes: n_tokens"):
        serving.copy_bytes(-1, 8)
    q, k, v = rng.standard_normal((3, 1, 2, 2, 4))
    with pytest.raises(ValueError, match="serving.sink_forward: sinks must have shape"):
        serving.sink_forward(q, k, v, np.zeros(5))
    with pytest.raises(TypeError, match="serving.sink_forward: q must be a numpy.ndarray"):
        serving.sink_forward(torch.zeros(1, 2, 2, 4), k, v, None)
    with pytest.raises(ValueError, match="serving.sink_forward: block_n"):
        serving.sink_forward(q, k, v, None, block_n=0)
    o, lse = serving.sink_forward(q, k, v, np.zeros(2))
    with pytest.raises(ValueError, match="serving.sink_backward: sinks must have shape"):
        serving.sink_backward(q, q, k, v, o, lse, np.zeros(3))
    with pytest.raises(ValueError, match="serving.sink_forward: sinks must have shape"):
        serving.attention_with_sinks(*(torch.from_numpy(x) for x in (q, k, v)), torch.zeros(3))


@pytest.mark.parametrize(
    "i,shape,words",
    [
        (0, (2, 4, 1), "q_nope must have shape"),
        (2, (2, 37, 8), "w_uk must have shape .* to match"),
        (4, (4, 16, 64), "w_uk must have shape"),
        (3, (2, 36, 64), "k_rope must have shape"),
    ],
)
def test_mla_names_each_bad_input(rng, i, shape, words):
    args = list(mla_inputs(rng))
    args[i] = np.zeros(shape)
    for fn, name in [(serving.mla_naive, "mla_naive"), (serving.mla_absorbed, "mla_absorbed")]:
        with pytest.raises(ValueError, match=f"serving.{name}: {words}"):
            fn(*args)
    args = list(mla_inputs(rng))
    args[5] = args[5].astype(int)
    with pytest.raises(TypeError, match="w_uv must be a float NumPy array"):
        serving.mla_absorbed(*args)


def test_generate_refuses_more_tokens_than_the_context(model):
    net, tok = model
    with pytest.raises(ValueError, match="exceed block_size"):
        serving.generate(
            net, [tok.encode("The")], 80, cache=lambda: serving.ContiguousKVCache(4, 16)
        )


def test_dtype_rule_for_float32_input(rng):
    k_pages, v_pages, table, seqlens, _, _ = fill(rng, [4], 2, 1, 4, 4, "float32")
    q = rng.standard_normal((1, 1, 1, 4)).astype(np.float32)
    o, lse = serving.paged_attention(q, k_pages, v_pages, table, seqlens)
    assert o.dtype == np.float32 and lse.dtype == np.float32
    assert tolerance("float32").atol > 0
