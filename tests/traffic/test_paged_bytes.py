"""traffic.paged_decode_bytes equals, tensor by tensor, the bytes `traffic.measure()` counts for
paged split-KV decoding under the interpreter."""

from __future__ import annotations

import pytest
import torch

from flashedu import decoding, traffic

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0:DeprecationWarning"
)


def _cache(lens, page_size, H_kv, d, d_v, dtype, gen):
    need = [-(-n // page_size) for n in lens]
    P = sum(need) + 1
    order = torch.randperm(P, generator=gen)
    table = torch.full((len(lens), max(need) + 1), -1, dtype=torch.int32)
    at = 0
    for b, m in enumerate(need):
        table[b, :m] = order[at : at + m]
        at += m
    k = torch.randn(P, page_size, H_kv, d, generator=gen).to(dtype)
    v = torch.randn(P, page_size, H_kv, d_v, generator=gen).to(dtype)
    return k, v, table, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.skipif(torch.cuda.is_available(), reason="traffic.measure watches the interpreter")
@pytest.mark.parametrize(
    "lens,H,H_kv,N_q,d,d_v,page_size,block_n,num_splits,dtype,causal,sinks",
    [
        ([37, 0, 16], 4, 2, 1, 16, 16, 16, 16, 3, torch.float32, False, False),
        ([70, 5], 4, 1, 3, 24, 40, 32, 16, 2, torch.float16, True, True),
        ([64, 33, 1, 0], 2, 2, 2, 16, 16, 32, 32, 4, torch.float32, True, False),
        ([100], 8, 2, 1, 32, 32, 64, 16, 8, torch.bfloat16, False, True),  # splits past the end
    ],
)
def test_closed_form_equals_measured_bytes(
    lens, H, H_kv, N_q, d, d_v, page_size, block_n, num_splits, dtype, causal, sinks
):
    gen = torch.Generator().manual_seed(len(lens) * 31 + d)
    k, v, table, seqlens = _cache(lens, page_size, H_kv, d, d_v, dtype, gen)
    q = torch.randn(len(lens), H, N_q, d, generator=gen).to(dtype)
    s = torch.randn(H, generator=gen) if sinks else None
    with traffic.measure() as m:
        decoding.paged_forward(q, k, v, table, seqlens, causal=causal, sinks=s,
                               num_splits=num_splits, block_n=block_n)  # fmt: skip
    model = traffic.paged_decode_bytes(
        lens, H=H, H_kv=H_kv, N_q=N_q, d=d, d_v=d_v, block_n=block_n, num_splits=num_splits,
        itemsize=q.element_size(), sinks=sinks,
    )  # fmt: skip
    assert m.traffic() == model, m.traffic().table() + "\n" + model.table()
    # the pages are read once, only up to each length: the whole cache is never gathered
    assert model.reads["K"] == H_kv * sum(lens) * d * q.element_size()


def test_closed_form_names_bad_arguments():
    with pytest.raises(ValueError, match=r"lens\[i\] must be an int >= 0, got -1"):
        traffic.paged_decode_bytes([-1], H=1, H_kv=1, N_q=1, d=16, block_n=16, num_splits=1)
    with pytest.raises(ValueError, match="block_n must be an int >= 1, got 0"):
        traffic.paged_decode_bytes([5], H=1, H_kv=1, N_q=1, d=16, block_n=0, num_splits=1)
    with pytest.raises(ValueError, match="lens must list at least one"):
        traffic.paged_decode_bytes([], H=1, H_kv=1, N_q=1, d=16, block_n=16, num_splits=1)


def test_paged_split_is_whole_tiles():
    assert traffic.paged_split([100, 3], 3, 16) == 48
    assert traffic.paged_split([0], 4, 16) == 16
