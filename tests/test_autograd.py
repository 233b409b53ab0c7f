"""flashedu.autograd: gradcheck in float64, float32 against the reference, what autograd saves, and
errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flashedu import autograd, reference
from flashedu.registry import IMPLEMENTATIONS
from flashedu.testing import assert_close


def _leaf(*tensors):
    return tuple(t.requires_grad_() for t in tensors)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "B,H,H_kv,N_q,N_k,d",
    [(1, 2, 2, 5, 7, 4), (1, 2, 2, 7, 3, 4), (2, 4, 2, 6, 6, 3), (1, 3, 1, 1, 5, 4)],
    ids=str,
)
def test_gradcheck_torch_tiled_float64(B, H, H_kv, N_q, N_k, d, causal, make_qkv):
    q, k, v = _leaf(*make_qkv(B, H, N_q, N_k, d, "float64", H_kv=H_kv, kind="torch"))

    def f(q, k, v):
        return autograd.flash_attention(
            q, k, v, causal=causal, softmax_scale=0.7, block_m=2, block_n=3
        )

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("impl", ["torch_tiled", "naive"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "B,H,H_kv,N_q,N_k,d", [(2, 2, 2, 17, 33, 16), (1, 4, 2, 65, 17, 32)], ids=str
)
def test_float32_gradients_match_reference(impl, B, H, H_kv, N_q, N_k, d, causal, make_qkv):
    q, k, v = _leaf(*make_qkv(B, H, N_q, N_k, d, "float32", H_kv=H_kv, kind="torch"))
    o, lse = autograd.flash_attention(q, k, v, causal=causal, impl=impl, return_lse=True)
    o_ref, lse_ref = reference.forward(q, k, v, causal=causal)
    assert_close(o, o_ref, "float32", name="o")
    assert_close(lse, lse_ref, "float32", name="lse")
    assert not lse.requires_grad
    do = torch.randn_like(o)
    o.backward(do)
    for name, t, g_ref in zip(
        ("dq", "dk", "dv"), (q, k, v), reference.backward(do, q, k, v, causal=causal)
    ):
        assert t.grad.dtype == torch.float32
        assert_close(t.grad, g_ref, "float32", grad=True, name=name)


def test_fully_masked_rows_get_zero_gradients_not_nan(make_qkv):
    q, k, v = _leaf(
        *make_qkv(1, 2, 9, 4, 8, "float32", kind="torch")
    )  # causal: rows 0..4 see no key
    o = autograd.flash_attention(q, k, v, causal=True, block_m=4, block_n=2)
    o.sum().backward()
    assert torch.all(o[:, :, :5] == 0)
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert torch.all(q.grad[:, :, :5] == 0)


def test_forward_saves_only_q_k_v_o_lse(make_qkv):
    q, k, v = _leaf(*make_qkv(1, 2, 96, 80, 8, "float32", kind="torch"))
    saved = autograd.saved_tensor_bytes(autograd.flash_attention, q, k, v, causal=True)
    assert [s for s, _ in saved.shapes] == [
        (1, 2, 96, 8),
        (1, 2, 80, 8),
        (1, 2, 80, 8),
        (1, 2, 96, 8),
        (1, 2, 96),
    ]
    assert saved.nbytes == 4 * (2 * 96 * 8 + 2 * 2 * 80 * 8 + 2 * 96 * 8 + 2 * 96)


def test_saved_bytes_grow_linearly_for_flash_and_quadratically_for_plain_attention(make_qkv):
    def plain(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) / 8**0.5, dim=-1) @ v

    flash, naive = [], []
    for N in (64, 128, 256):
        q, k, v = _leaf(*make_qkv(1, 1, N, N, 8, "float32", kind="torch"))
        flash.append(autograd.saved_tensor_bytes(autograd.flash_attention, q, k, v).nbytes)
        naive.append(autograd.saved_tensor_bytes(plain, q, k, v).nbytes)
    assert flash[1] == 2 * flash[0] and flash[2] == 2 * flash[1]
    assert naive[2] - 3 * 256 * 8 * 4 == 256 * 256 * 4  # q, k, v plus P, kept once
    assert naive[2] / flash[2] > 4


def test_lse_output_carries_no_gradient_and_o_can_be_reused(make_qkv):
    q, k, v = _leaf(*make_qkv(1, 1, 6, 6, 4, "float64", kind="torch"))
    o, lse = autograd.flash_attention(q, k, v, return_lse=True)
    (o.sum() + (o * o).sum() + lse.detach().sum()).backward()
    do = torch.ones_like(o) + 2 * o.detach()
    for t, g_ref in zip((q, k, v), reference.backward(do, q, k, v)):
        assert_close(t.grad, g_ref, "float64", grad=True)


def test_errors_name_the_argument(make_qkv, monkeypatch):
    q, k, v = make_qkv(1, 2, 5, 5, 8, "float32", kind="torch")
    with pytest.raises(ValueError, match="impl must be one of"):
        autograd.flash_attention(q, k, v, impl="cuDNN")
    with pytest.raises(TypeError, match="torch.Tensor"):
        autograd.flash_attention(q.numpy(), k, v)
    with pytest.raises(TypeError, match="causal must be a bool"):
        autograd.flash_attention(q, k, v, causal="yes")
    with pytest.raises(TypeError, match=r"impl='naive' supports dtypes .* got bfloat16"):
        autograd.flash_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), impl="naive")
    with pytest.raises(NotImplementedError, match="does not support window_size"):
        autograd.flash_attention(q, k, v, window_size=(2, 0))
    with pytest.raises(NotImplementedError, match="does not support alibi_slopes"):
        autograd.flash_attention(q, k, v, impl="naive", alibi_slopes=torch.ones(2))
    assert (
        autograd.flash_attention(q, k, v, window_size=None).shape == q.shape
    )  # None means "not asked for"
    no_gqa = dataclasses.replace(IMPLEMENTATIONS["torch_tiled"], features=frozenset())
    monkeypatch.setitem(IMPLEMENTATIONS, "torch_tiled", no_gqa)
    with pytest.raises(NotImplementedError, match="H=2 and H_kv=1"):
        autograd.flash_attention(q, k[:, :1], v[:, :1])


def test_a_missing_module_is_an_import_error_only_when_asked_for(make_qkv, monkeypatch):
    def load():
        import flashedu._no_such_module as missing

        return missing

    ghost = dataclasses.replace(IMPLEMENTATIONS["torch_tiled"], name="ghost", load=load)
    monkeypatch.setitem(IMPLEMENTATIONS, "ghost", ghost)
    q, k, v = make_qkv(1, 1, 3, 3, 4, "float32", kind="torch")
    assert autograd.flash_attention(q, k, v).shape == q.shape
    with pytest.raises(ImportError, match="impl='ghost' is not available"):
        autograd.flash_attention(q, k, v, impl="ghost")


# ---- torch.func transforms, torch.compile and double backward -----------------------------------
def _plain(q, k, v, causal):
    """Attention by the plain formulas in torch ops (bottom-right causal), to differentiate
    against."""
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        N_q, N_k = q.shape[-2], k.shape[-2]
        keep = torch.ones(N_q, N_k, dtype=torch.bool).tril(N_k - N_q)
        s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


@pytest.mark.parametrize("impl", ["torch_tiled", "naive", "tiled"])
def test_vmap_folds_the_mapped_dim_into_the_batch(impl, make_qkv):
    q, k, v = make_qkv(3, 2, 5, 7, 4, "float64", kind="torch")  # dim 0 is the mapped one

    def f(q, k, v):
        return autograd.flash_attention(q, k, v, causal=True, impl=impl)

    o = torch.func.vmap(f, in_dims=(0, None, None))(q[:, None], k[0:1], v[0:1])
    assert o.shape == (3, 1, 2, 5, 4)
    assert_close(o[:, 0], _plain(q, k[0:1], v[0:1], True), "float64")


@pytest.mark.parametrize("impl", ["torch_tiled", "naive"])
def test_jacrev_and_per_sample_grad_match_plain_attention(impl, make_qkv):
    q, k, v = make_qkv(1, 2, 4, 6, 3, "float64", H_kv=1, kind="torch")

    def f(q):
        return autograd.flash_attention(q, k, v, causal=True, impl=impl).sum(-1)

    assert_close(
        torch.func.jacrev(f)(q),
        torch.func.jacrev(lambda q: _plain(q, k, v, True).sum(-1))(q),
        "float64",
        grad=True,
    )
    qs = torch.randn(3, *q.shape, dtype=torch.float64)
    grads = torch.func.vmap(torch.func.grad(lambda q: f(q).pow(2).sum()))(qs)
    for i in range(3):
        want = torch.func.grad(lambda q: _plain(q, k, v, True).sum(-1).pow(2).sum())(qs[i])
        assert_close(grads[i], want, "float64", grad=True)


def test_double_backward_raises_not_implemented(make_qkv):
    q, k, v = _leaf(*make_qkv(1, 2, 5, 5, 4, "float64", kind="torch"))
    o = autograd.flash_attention(q, k, v)
    (dq,) = torch.autograd.grad(o.sum(), q, create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward"):
        dq.sum().backward()
    with pytest.raises(NotImplementedError, match="double backward"):
        torch.func.jacrev(torch.func.jacrev(lambda q: autograd.flash_attention(q, k, v).sum()))(
            q.detach()
        )
    with pytest.raises(NotImplementedError, match="forward mode AD"):
        torch.func.hessian(lambda q: autograd.flash_attention(q, k, v).sum())(q.detach())


def test_torch_compile_fullgraph_traces_forward_and_backward(make_qkv):
    """fullgraph=True fails on any graph break (an import, a data-dependent branch) in the call
    path. The "aot_eager" backend traces forward and backward exactly as inductor would, without
    spending a minute generating C++ on a CPU."""
    q, k, v = _leaf(*make_qkv(1, 2, 9, 7, 4, "float32", kind="torch"))

    def f(q, k, v):
        return autograd.flash_attention(q, k, v, causal=True, block_m=4, block_n=4)

    torch._dynamo.reset()
    o = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    assert_close(o, reference.forward(q, k, v, causal=True)[0], "float32")
    do = torch.randn_like(o)
    o.backward(do)
    for t, g in zip((q, k, v), reference.backward(do, q, k, v, causal=True)):
        assert_close(t.grad, g, "float32", grad=True)


def test_the_functions_keep_their_signature_so_apply_binds_without_recomputing_it():
    """torch's Function.apply calls inspect.signature(forward) each call; the signature kept on
    forward (computed once at import) is the one inspect would compute."""
    import inspect

    from flashedu import autograd

    for fn in (autograd.FlashAttention, autograd.FlashAttentionBackward,
               autograd.FlashAttentionWithSinks):  # fmt: skip
        kept = fn.forward.__signature__
        del fn.forward.__signature__
        try:
            assert inspect.signature(fn.forward) == kept
        finally:
            fn.forward.__signature__ = kept
