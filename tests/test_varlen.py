"""flashedu.varlen: packed sequences against the float64 reference, per sequence and as one call
with the explicit document mask; forward and backward, causal and not; every misuse named."""

import numpy as np
import pytest
import torch

from flashedu import flex, reference
from flashedu.testing import Tolerance, assert_close
from flashedu.varlen import PACKED, attention_varlen, check_varlen

F64, F64_GRAD = Tolerance(1e-12, 1e-12), Tolerance(1e-11, 1e-11)
LENGTHS = [  # (query lengths, key lengths)
    ([1, 17, 64, 3], [1, 17, 64, 3]),
    ([1, 17, 64, 3], [9, 17, 20, 70]),  # N_q != N_k per sequence: bottom-right causal differs
    ([5, 0, 12, 1], [5, 3, 0, 2]),  # an empty query sequence, an empty key sequence
]


def _pack(rng, lens_q, lens_k, H=4, H_kv=2, d=16, dtype=torch.float64):
    cu_q = torch.tensor(np.cumsum([0, *lens_q]), dtype=torch.int32)
    cu_k = torch.tensor(np.cumsum([0, *lens_k]), dtype=torch.int32)
    q, k, v = (
        torch.from_numpy(rng.standard_normal(s)).to(dtype).requires_grad_()
        for s in ((sum(lens_q), H, d), (sum(lens_k), H_kv, d), (sum(lens_k), H_kv, d))
    )
    return q, k, v, cu_q, cu_k


def _bhnd(x: torch.Tensor) -> np.ndarray:
    """(total, heads, d) -> (1, heads, total, d) float64 NumPy."""
    return x.detach().transpose(0, 1)[None].double().numpy()


def _per_sequence_reference(q, k, v, do, cu_q, cu_k, causal):
    """(o, dq, dk, dv) in the packed layout from reference.forward/backward on each sequence."""
    outs = [np.zeros(tuple(x.shape)) for x in (q, q, k, v)]
    for q0, q1, k0, k1 in zip(cu_q.tolist(), cu_q[1:].tolist(), cu_k.tolist(), cu_k[1:].tolist()):
        if q1 == q0 or k1 == k0:
            continue  # no rows, or rows that see nothing (o = 0, zero gradients)
        args = [_bhnd(x[a:b]) for x, a, b in ((q, q0, q1), (k, k0, k1), (v, k0, k1))]
        o, _ = reference.forward(*args, causal=causal)
        grads = reference.backward(_bhnd(do[q0:q1]), *args, causal=causal)
        for out, value, (a, b) in zip(outs, (o, *grads), ((q0, q1), (q0, q1), (k0, k1), (k0, k1))):
            out[a:b] = value[0].transpose(1, 0, 2)
    return outs


@pytest.mark.parametrize("impl", ["auto", "torch_tiled", "naive"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens_q,lens_k", LENGTHS)
def test_forward_and_backward_match_reference_per_sequence(lens_q, lens_k, causal, impl, rng):
    q, k, v, cu_q, cu_k = _pack(rng, lens_q, lens_k)
    o = attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal, impl=impl)
    do = torch.from_numpy(rng.standard_normal(tuple(o.shape)))
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    o_ref, dq_ref, dk_ref, dv_ref = _per_sequence_reference(q, k, v, do, cu_q, cu_k, causal)
    assert_close(o, o_ref, tol=F64, name="o")
    for name, g, g_ref in (("dq", dq, dq_ref), ("dk", dk, dk_ref), ("dv", dv, dv_ref)):
        assert_close(g, g_ref, tol=F64_GRAD, name=name)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens_q,lens_k", LENGTHS)
def test_varlen_is_one_attention_with_the_document_mask(lens_q, lens_k, causal, rng):
    """The FlexAttention twin: one (1, H, total_q, total_k) reference call with the explicit
    document mask gives the packed output (rows without keys are 0 in both)."""
    q, k, v, cu_q, cu_k = _pack(rng, lens_q, lens_k, H=2, H_kv=2)
    o = attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal)
    mask = flex.mask_array(flex.document(cu_q, cu_k, causal=causal), 1, 1, sum(lens_q), sum(lens_k))
    o_ref, _ = reference.forward(_bhnd(q), _bhnd(k), _bhnd(v), attn_mask=mask)
    assert_close(o, o_ref[0].transpose(1, 0, 2), tol=F64)


def test_float32_matches_within_its_tolerance(rng):
    q, k, v, cu_q, cu_k = _pack(rng, [1, 17, 64, 3], [1, 17, 64, 3], dtype=torch.float32)
    o = attention_varlen(q, k, v, cu_q, cu_k, 64, 64, causal=True)
    assert o.dtype == torch.float32
    o_ref = _per_sequence_reference(q, k, v, torch.zeros(o.shape), cu_q, cu_k, True)[0]
    assert_close(o, o_ref, dtype="float32")


def test_softmax_scale_and_int64_cu_seqlens(rng):
    q, k, v, cu_q, cu_k = _pack(rng, [3, 8], [3, 8])
    o = attention_varlen(q, k, v, cu_q.long(), cu_k.long(), 8, 8, softmax_scale=0.7)
    ref = reference.forward(_bhnd(q[3:]), _bhnd(k[3:]), _bhnd(v[3:]), softmax_scale=0.7)[0]
    assert_close(o[3:], ref[0].transpose(1, 0, 2), tol=F64)


def test_all_sequences_empty_gives_an_empty_output(rng):
    q, k, v, cu_q, cu_k = _pack(rng, [0, 0], [2, 0])
    o = attention_varlen(q, k, v, cu_q, cu_k, 0, 2)
    assert tuple(o.shape) == (0, 4, 16)


def test_a_registered_packed_kernel_is_used_for_its_name(rng, monkeypatch):
    calls = []

    def one_launch(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, softmax_scale):
        calls.append((max_q, max_k, causal, softmax_scale))
        return torch.zeros_like(q)

    monkeypatch.setitem(PACKED, "one-launch", one_launch)
    q, k, v, cu_q, cu_k = _pack(rng, [2, 3], [2, 3])
    attention_varlen(q, k, v, cu_q, cu_k, 3, 3, causal=True, impl="one-launch")
    assert calls == [(3, 3, True, 0.25)]  # the default scale 1/sqrt(16), resolved before the call


def _valid(rng):
    q, k, v, cu_q, cu_k = _pack(rng, [2, 5], [4, 1])
    return dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5, max_seqlen_k=4)


@pytest.mark.parametrize(
    "change,error,words",
    [
        (dict(q=torch.zeros(7, 4)), ValueError, "q must have shape (total, heads, d)"),
        (
            dict(k=torch.zeros(5, 2, 8), v=torch.zeros(5, 2, 8)),
            ValueError,
            "head dimension d differs",
        ),
        (dict(k=torch.zeros(5, 3, 16), v=torch.zeros(5, 3, 16)), ValueError, "not a multiple"),
        (dict(v=torch.zeros(5, 2, 17)), ValueError, "k and v must have the same shape"),
        (dict(cu_seqlens_q=torch.tensor([0.0, 2.0, 7.0])), TypeError, "dtype int32"),
        (
            dict(cu_seqlens_q=torch.tensor([1, 2, 7], dtype=torch.int32)),
            ValueError,
            "must start at 0",
        ),
        (
            dict(cu_seqlens_q=torch.tensor([0, 5, 2, 7], dtype=torch.int32)),
            ValueError,
            "non-decreasing",
        ),
        (
            dict(cu_seqlens_q=torch.tensor([0, 2, 6], dtype=torch.int32)),
            ValueError,
            "ends at 6, but the packed tensor holds 7 tokens",
        ),
        (
            dict(cu_seqlens_k=torch.tensor([0, 5], dtype=torch.int32)),
            ValueError,
            "cu_seqlens_q describes 2 sequences and cu_seqlens_k 1",
        ),
        (
            dict(cu_seqlens_k=torch.tensor([[0, 4, 5]], dtype=torch.int32)),
            ValueError,
            "must be 1-D",
        ),
        (
            dict(max_seqlen_q=4),
            ValueError,
            "max_seqlen_q=4 is shorter than the longest sequence, 5",
        ),
        (dict(max_seqlen_k=4.0), TypeError, "max_seqlen_k must be an int"),
        (dict(cu_seqlens_q=[0, 2, 7]), TypeError, "cu_seqlens_q must be a torch.Tensor"),
    ],
)
def test_misuse_is_named(change, error, words, rng):
    kwargs = {**_valid(rng), **change}
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        attention_varlen(**kwargs)


def test_dtype_mismatch_and_causal_type_are_named(rng):
    kwargs = _valid(rng)
    with pytest.raises(TypeError, match="share one floating dtype"):
        attention_varlen(**{**kwargs, "q": kwargs["q"].float()})
    with pytest.raises(TypeError, match="causal must be a bool"):
        attention_varlen(**kwargs, causal=1)


def test_check_varlen_returns_the_boundaries(rng):
    kwargs = _valid(rng)
    assert check_varlen(*kwargs.values()) == ([0, 2, 7], [0, 4, 5])


def test_attention_varlen_is_exported_from_the_package():
    import flashedu
    from flashedu import varlen

    assert flashedu.attention_varlen is varlen.attention_varlen
    assert "attention_varlen" in flashedu.__all__
