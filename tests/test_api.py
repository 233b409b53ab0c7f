"""flashedu.attention and the SDPA drop-in: parity with
torch.nn.functional.scaled_dot_product_attention (forward and gradients) and with the float64
reference, and every documented refusal."""

from __future__ import annotations

import copy
import inspect
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import flashedu
from flashedu import api, reference
from flashedu.testing import assert_close


def _leaves(rng, *shapes, dtype=torch.float64):
    return [torch.from_numpy(rng.standard_normal(s)).to(dtype).requires_grad_() for s in shapes]


def _both(rng, shapes, *args, dtype=torch.float64, **kwargs):
    """Outputs and input gradients of PyTorch's SDPA and flashedu's on the same inputs and the same
    dO."""
    results = []
    for sdpa in (F.scaled_dot_product_attention, flashedu.scaled_dot_product_attention):
        rng_copy = copy.deepcopy(rng)
        ts = _leaves(rng_copy, *shapes, dtype=dtype)
        out = sdpa(*ts, *args, **kwargs)
        do = torch.from_numpy(rng_copy.standard_normal(tuple(out.shape))).to(dtype)
        results.append((out, torch.autograd.grad(out, ts, do)))
    return results


def _assert_same(results, dtype="float64"):
    (o_t, g_t), (o_f, g_f) = results
    assert o_f.shape == o_t.shape and o_f.dtype == o_t.dtype
    assert_close(o_f, o_t, dtype, name="output")
    for name, a, b in zip(("dquery", "dkey", "dvalue"), g_f, g_t):
        assert_close(a, b, dtype, grad=True, name=name)


def test_signature_is_pytorchs():
    params = inspect.signature(flashedu.scaled_dot_product_attention).parameters
    assert [(p.name, p.default, p.kind.name) for p in params.values()] == [
        ("query", inspect.Parameter.empty, "POSITIONAL_OR_KEYWORD"),
        ("key", inspect.Parameter.empty, "POSITIONAL_OR_KEYWORD"),
        ("value", inspect.Parameter.empty, "POSITIONAL_OR_KEYWORD"),
        ("attn_mask", None, "POSITIONAL_OR_KEYWORD"),
        ("dropout_p", 0.0, "POSITIONAL_OR_KEYWORD"),
        ("is_causal", False, "POSITIONAL_OR_KEYWORD"),
        ("scale", None, "KEYWORD_ONLY"),
        ("enable_gqa", False, "KEYWORD_ONLY"),
    ]


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("L,S", [(7, 7), (5, 9), (9, 5), (1, 6), (33, 17)])
def test_sdpa_matches_pytorch_including_top_left_causal(L, S, is_causal, rng):
    _assert_same(_both(rng, [(2, 3, L, 8), (2, 3, S, 8), (2, 3, S, 8)], is_causal=is_causal))


@pytest.mark.parametrize("scale", [0.05, 1.0, 3.0])
def test_sdpa_scale_matches_pytorch(scale, rng):
    _assert_same(
        _both(rng, [(1, 2, 6, 8), (1, 2, 11, 8), (1, 2, 11, 8)], is_causal=True, scale=scale)
    )


@pytest.mark.parametrize("H,H_kv", [(4, 2), (6, 1), (3, 3)])
def test_sdpa_enable_gqa_matches_pytorch(H, H_kv, rng):
    _assert_same(
        _both(
            rng, [(2, H, 9, 8), (2, H_kv, 5, 8), (2, H_kv, 5, 8)], is_causal=True, enable_gqa=True
        )
    )


@pytest.mark.parametrize(
    "shapes",
    [
        [(9, 8), (5, 8), (5, 8)],
        [(3, 7, 8), (3, 4, 8), (3, 4, 8)],
        [(3, 2, 4, 6, 8), (1, 2, 4, 5, 8), (1, 2, 4, 5, 8)],
        [(2, 4, 6, 8), (2, 1, 5, 8), (2, 1, 5, 8)],
    ],
    ids=str,
)
def test_sdpa_batch_dims_and_broadcasting_match_pytorch(shapes, rng):
    _assert_same(_both(rng, shapes))


@pytest.mark.parametrize("variant", [causal_upper_left, causal_lower_right])
@pytest.mark.parametrize("L,S", [(5, 9), (9, 9), (4, 11)])
def test_sdpa_causal_bias_objects_match_pytorch(variant, L, S, rng):
    _assert_same(_both(rng, [(1, 2, L, 8), (1, 2, S, 8), (1, 2, S, 8)], variant(L, S)))


def test_causal_lower_right_with_more_queries_than_keys_gives_zero_rows(rng):
    """PyTorch warns this case may produce NaN; flashedu's answer is the reference's: zero rows,
    zero gradients."""
    q, k, v = _leaves(rng, (1, 2, 9, 8), (1, 2, 4, 8), (1, 2, 4, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        mask = causal_lower_right(9, 4)
    out = flashedu.scaled_dot_product_attention(q, k, v, mask)
    assert_close(out, reference.forward(q, k, v, causal=True)[0], "float64")
    out.sum().backward()
    assert torch.all(out[:, :, :5] == 0) and torch.all(q.grad[:, :, :5] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_sdpa_low_precision_error_is_at_most_twice_pytorchs(dtype, rng):
    """flash-attn's rule: against the float64 reference, no worse than 2x PyTorch's own
    same-precision error."""
    (o_t, _), (o_f, _) = _both(
        rng, [(2, 2, 33, 16), (2, 2, 47, 16), (2, 2, 47, 16)], is_causal=True, dtype=dtype
    )
    q, k, v = _leaves(
        copy.deepcopy(rng), (2, 2, 33, 16), (2, 2, 47, 16), (2, 2, 47, 16), dtype=dtype
    )
    o_ref = reference.forward(q, k, v, attn_mask=np.tril(np.ones((33, 47), dtype=bool)))[
        0
    ]  # top-left causal
    err_t, err_f = (np.abs(o.detach().double().numpy() - o_ref).max() for o in (o_t, o_f))
    print(f"{dtype}: max error PyTorch {err_t:.1e}, flashedu {err_f:.1e}")
    assert o_f.dtype == dtype and err_f <= 2 * err_t + 1e-6


def test_attention_matches_reference_and_picks_torch_tiled_on_cpu(make_qkv):
    q, k, v = (
        t.requires_grad_() for t in make_qkv(1, 4, 17, 29, 16, "float32", H_kv=2, kind="torch")
    )
    assert api._auto_impl(q) == "torch_tiled"
    o = flashedu.attention(q, k, v, causal=True, softmax_scale=0.3)
    assert_close(o, reference.forward(q, k, v, causal=True, softmax_scale=0.3)[0], "float32")
    do = torch.randn_like(o)
    o.backward(do)
    for t, g in zip((q, k, v), reference.backward(do, q, k, v, causal=True, softmax_scale=0.3)):
        assert_close(t.grad, g, "float32", grad=True)


def test_attention_accepts_any_registered_implementation_but_the_oracle(make_qkv):
    q, k, v = make_qkv(1, 2, 5, 7, 8, "float64", kind="torch")
    o_ref = reference.forward(q, k, v, causal=True)[0]
    for impl in ("auto", "torch_tiled", "naive"):
        assert_close(flashedu.attention(q, k, v, causal=True, impl=impl), o_ref, "float64")
    with pytest.raises(ValueError, match="the float64 oracle is flashedu.reference"):
        flashedu.attention(q, k, v, impl="reference")
    with pytest.raises(ValueError, match=r"impl must be one of \['auto', "):
        flashedu.attention(q, k, v, impl="flash3")
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        flashedu.attention(q.numpy(), k, v)


def test_unsupported_sdpa_arguments_raise_not_implemented(rng):
    q, k, v = _leaves(rng, (1, 2, 5, 8), (1, 2, 6, 8), (1, 2, 6, 8))
    with pytest.raises(NotImplementedError, match="dropout_p must be 0.0"):
        flashedu.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
    for mask in (torch.ones(5, 6, dtype=torch.bool), torch.zeros(1, 2, 5, 6)):
        with pytest.raises(NotImplementedError, match="attn_mask must be None or a CausalBias"):
            flashedu.scaled_dot_product_attention(q, k, v, mask)


def test_sdpa_errors_where_pytorch_errors(rng):
    q, k, v = _leaves(rng, (1, 4, 5, 8), (1, 2, 6, 8), (1, 2, 6, 8))
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, k, v)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        flashedu.scaled_dot_product_attention(q, k, v)
    q3 = q[:, :3]
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q3, k, v, enable_gqa=True)
    with pytest.raises(ValueError, match="must be a multiple of key's 2"):
        flashedu.scaled_dot_product_attention(q3, k, v, enable_gqa=True)
    for sdpa in (F.scaled_dot_product_attention, flashedu.scaled_dot_product_attention):
        with pytest.raises(ValueError, match="CausalBias should not be used with"):
            sdpa(q, k, v, causal_upper_left(5, 6), is_causal=True, enable_gqa=True)
        with pytest.raises(TypeError):
            sdpa(q, k, v, None, 0.0, False, 0.5)  # scale is keyword-only in both
    with pytest.raises(ValueError, match=r"causal bias for \(L, S\) = \(5, 7\)"):
        flashedu.scaled_dot_product_attention(q, k, v, causal_lower_right(5, 7), enable_gqa=True)
    with pytest.raises(TypeError, match="query must be a torch.Tensor"):
        flashedu.scaled_dot_product_attention(q.detach().numpy(), k, v)


# ---- the edges: empty dims, and the argument types PyTorch rejects ----------------------------
EMPTY = [
    ((0, 2, 3, 4), (0, 2, 5, 4), {}),  # empty batch
    ((1, 0, 3, 4), (1, 0, 5, 4), {}),  # no heads
    ((1, 2, 0, 4), (1, 2, 5, 4), {}),  # L = 0
    ((1, 2, 3, 4), (1, 2, 0, 4), {}),  # S = 0: zeros
    ((1, 2, 3, 4), (1, 2, 0, 4), {"is_causal": True}),
    ((1, 2, 0, 4), (1, 2, 0, 4), {"is_causal": True}),
    ((1, 4, 3, 4), (1, 2, 0, 4), {"enable_gqa": True}),
    ((0, 4, 3, 4), (0, 2, 5, 4), {"enable_gqa": True, "is_causal": True}),
    ((2, 0, 3, 7, 4), (2, 0, 3, 5, 4), {}),
    ((3, 4), (0, 4), {"scale": 0.5}),
]


@pytest.mark.parametrize("q_shape,k_shape,kwargs", EMPTY, ids=str)
def test_sdpa_empty_dims_match_pytorch(q_shape, k_shape, kwargs, rng):
    """PyTorch returns an empty tensor (no rows) or zeros (no keys), with zero or empty
    gradients."""
    _assert_same(_both(rng, [q_shape, k_shape, k_shape], **kwargs))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"is_causal": "False"},
        {"is_causal": 1},
        {"is_causal": None},
        {"scale": "0.5"},
        {"dropout_p": "0"},
    ],
    ids=str,
)
def test_sdpa_rejects_the_types_pytorch_rejects(kwargs, rng):
    q, k, v = _leaves(rng, (1, 2, 5, 8), (1, 2, 6, 8), (1, 2, 6, 8))
    with pytest.raises(TypeError):
        F.scaled_dot_product_attention(q, k, v, **kwargs)
    arg = next(iter(kwargs))
    with pytest.raises(TypeError, match=f"scaled_dot_product_attention: {arg} must be"):
        flashedu.scaled_dot_product_attention(q, k, v, **kwargs)


@pytest.mark.parametrize("scale", [True, 1j, [0.5]], ids=repr)
def test_sdpa_scale_must_be_a_real_number(scale, rng):
    q, k, v = _leaves(rng, (1, 2, 5, 8), (1, 2, 6, 8), (1, 2, 6, 8))
    with pytest.raises(TypeError, match="scale must be a real number"):
        flashedu.scaled_dot_product_attention(q, k, v, scale=scale)


def test_attention_impl_must_be_a_string(make_qkv):
    q, k, v = make_qkv(1, 2, 5, 5, 8, "float32", kind="torch")
    with pytest.raises(TypeError, match=r"impl must be a str .* got list \['torch_tiled'\]"):
        flashedu.attention(q, k, v, impl=["torch_tiled"])


@st.composite
def _signatures(draw):
    """Random SDPA calls: batch dims, heads (grouped or not), lengths and head dims, 0 included."""
    B = draw(st.integers(0, 2))
    H_kv = draw(st.integers(0, 2))
    gqa = draw(st.booleans()) and H_kv > 0
    H = H_kv * draw(st.integers(1, 3)) if gqa else H_kv
    L, S, E = draw(st.integers(0, 9)), draw(st.integers(0, 9)), draw(st.integers(1, 8))
    kwargs = {"is_causal": draw(st.booleans()), "enable_gqa": gqa}
    if draw(st.booleans()):
        kwargs["scale"] = draw(st.floats(-2.0, 2.0, allow_nan=False))
    return [(B, H, L, E), (B, H_kv, S, E), (B, H_kv, S, E)], kwargs


@settings(max_examples=60, deadline=None)
@given(signature=_signatures(), seed=st.integers(0, 2**32 - 1))
def test_sdpa_agrees_with_pytorch_on_random_signatures(signature, seed):
    shapes, kwargs = signature
    _assert_same(_both(np.random.default_rng(seed), shapes, **kwargs))


# ------------------------------------------------------------- paged KV cache and sinks (ch. 12)
def _paged_inputs(dtype=torch.float32):
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 1, 16, generator=gen).to(dtype)
    k_cache, v_cache = (torch.randn(6, 16, 2, 16, generator=gen).to(dtype) for _ in range(2))
    table = torch.tensor([[4, 1, -1], [0, 5, 2]], dtype=torch.int32)
    lens = torch.tensor([20, 40], dtype=torch.int32)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: under the interpreter
    return (x.to(device) for x in (q, k_cache, v_cache, table, lens))


def test_attention_reads_a_paged_cache_through_the_triton_kernel():
    from flashedu import decoding

    q, k_cache, v_cache, table, lens = _paged_inputs()
    sinks = torch.randn(4, device=q.device)
    o = flashedu.attention(
        q, k_cache, v_cache, block_table=table, cache_seqlens=lens, sinks=sinks, causal=True
    )
    want, _ = decoding.paged_forward(q, k_cache, v_cache, table, lens, causal=True, sinks=sinks)
    assert torch.equal(o, want)
    k = k_cache[table[1].long()].reshape(48, 2, 16)[:40].permute(1, 0, 2)[None]  # sequence 1
    v = v_cache[table[1].long()].reshape(48, 2, 16)[:40].permute(1, 0, 2)[None]
    o_sink = flashedu.attention(q[1:], k, v, sinks=sinks, impl="triton")
    assert_close(o_sink, o[1:], "float32")


def test_attention_paged_errors_name_what_is_missing():
    q, k_cache, v_cache, table, lens = _paged_inputs()
    with pytest.raises(ValueError, match="block_table was given without cache_seqlens"):
        flashedu.attention(q, k_cache, v_cache, block_table=table)
    with pytest.raises(ValueError, match="cache_seqlens was given without block_table"):
        flashedu.attention(q, k_cache, v_cache, cache_seqlens=lens)
    with pytest.raises(ValueError, match="impl='torch_tiled' cannot read a paged KV cache"):
        flashedu.attention(
            q, k_cache, v_cache, block_table=table, cache_seqlens=lens, impl="torch_tiled"
        )
    with pytest.raises(ValueError, match="impl='naive' cannot read a paged KV cache"):
        flashedu.attention(q, k_cache, v_cache, block_table=table, cache_seqlens=lens, impl="naive")
    with pytest.raises(NotImplementedError, match="forward only"):
        flashedu.attention(
            q.requires_grad_(), k_cache, v_cache, block_table=table, cache_seqlens=lens
        )


# ---- sinks in training: any implementation, differentiable ---------------------------------------
def _sink_reference(q, k, v, sinks, causal):
    """float64 attention with the sink as an explicit extra key whose value row is zero."""
    q, k, v, sinks = (x.double() for x in (q, k, v, sinks))
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        N_q, N_k = s.shape[-2:]
        keep = torch.ones(N_q, N_k, dtype=torch.bool).tril(N_k - N_q)
        s = s.masked_fill(~keep, float("-inf"))
    sink_col = sinks[None, :, None, None].expand(*s.shape[:-1], 1)
    p = torch.softmax(torch.cat([s, sink_col], -1), -1)
    return p[..., :-1] @ v


@pytest.mark.parametrize("impl", ["torch_tiled", "naive", "tiled", "triton"])
@pytest.mark.parametrize("N_q,N_k", [(5, 7), (6, 3)])  # (6, 3) causal: rows 0-2 see no key
def test_sinks_train_through_every_implementation(impl, N_q, N_k):
    dtype = torch.float32 if impl == "triton" else torch.float64
    gen = torch.Generator().manual_seed(N_q * 10 + N_k)
    q = torch.randn(2, 4, N_q, 16, generator=gen, dtype=dtype)
    k, v = (torch.randn(2, 2, N_k, 16, generator=gen, dtype=dtype) for _ in range(2))
    sinks = torch.tensor([0.5, float("-inf"), 3.0, -2.0], dtype=dtype)
    do = torch.randn(2, 4, N_q, 16, generator=gen, dtype=dtype)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    o = flashedu.attention(*leaves[:3], sinks=leaves[3], causal=True, impl=impl)
    o.backward(do)
    ref_leaves = [x.clone().double().requires_grad_() for x in (q, k, v, sinks)]
    o_ref = _sink_reference(*ref_leaves, causal=True)
    o_ref.backward(do.double())
    kind = "float32" if impl == "triton" else "float64"
    assert_close(o, o_ref, kind)
    for got, want in zip(leaves, ref_leaves):
        assert_close(got.grad, want.grad, kind, grad=True)
    assert leaves[3].grad[1] == 0  # a sink of -inf takes no weight and gets no gradient


def test_sinks_pass_gradcheck_and_lse_includes_the_sink():
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(1, 2, 4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 1, 6, 8, generator=gen, dtype=torch.float64, requires_grad=True)
            for _ in range(2))  # fmt: skip
    sinks = torch.tensor([0.3, -1.2], dtype=torch.float64, requires_grad=True)
    f = lambda *a: flashedu.autograd.flash_attention(*a[:3], sinks=a[3], causal=True)
    assert torch.autograd.gradcheck(f, (q, k, v, sinks))
    _, lse = flashedu.autograd.flash_attention(q, k, v, sinks=sinks, return_lse=True)
    s = q @ k.transpose(-1, -2).repeat_interleave(2, 1) * 8**-0.5
    want = torch.logsumexp(torch.cat([s, sinks[None, :, None, None].expand(1, 2, 4, 1)], -1), -1)
    assert torch.allclose(lse, want, atol=1e-12)


def test_bad_sinks_are_named():
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    with pytest.raises(ValueError, match=r"sinks must have shape \(H,\) = \(2,\)"):
        flashedu.attention(q, k, v, sinks=torch.zeros(3))
    with pytest.raises(TypeError, match="sinks must be floating point"):
        flashedu.attention(q, k, v, sinks=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(TypeError, match="sinks must be a torch.Tensor"):
        flashedu.attention(q, k, v, sinks=[0.0, 1.0])
    with pytest.raises(ValueError, match="sinks must be finite or -inf"):
        flashedu.attention(q, k, v, sinks=torch.tensor([0.0, float("nan")]))
