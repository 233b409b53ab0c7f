"""Head dims held in two power-of-two chunks (`tiles.chunk_dims`: 192 = 128 + 64) instead of one
padded tile: the chunk rule, the kernels against the float64 reference with the split switched on
(`launch.SPLIT_HEAD_DIMS`), and the tables' first entries at the two-chunk widths against the H200
sweep that chose them (notebooks/results/h200_headdims.json) and the sm_90a compile report
(notebooks/results/sm90_compile_headdims.json).

Under the interpreter (no CUDA) with 16x16 tiles.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from flashedu import _env, kernels, reference
from flashedu.kernels import bwd, fwd, launch
from flashedu.kernels import varlen as triton_varlen
from flashedu.kernels.tiles import chunk_dims, pad_dim
from flashedu.testing import assert_close, random_qkv

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0:DeprecationWarning"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REPORT = _env.ROOT / "notebooks" / "results" / "sm90_compile_headdims.json"


@pytest.fixture
def split_all(monkeypatch):
    """Every head dim that `chunk_dims` splits runs in two chunks."""
    monkeypatch.setattr(launch, "SPLIT_HEAD_DIMS", frozenset(range(1, 257)))


def test_chunks_are_powers_of_two_covering_d_with_fewer_columns_than_padding():
    assert [chunk_dims(d) for d in (1, 33, 40, 64, 80, 96, 111, 160, 192, 200, 256)] == [
        (16, 0), (32, 16), (32, 16), (64, 0), (64, 16), (64, 32), (128, 0), (128, 32), (128, 64),
        (256, 0), (256, 0),
    ]  # fmt: skip
    for d in range(1, 257):
        first, second = chunk_dims(d)
        if second == 0:
            assert first == pad_dim(d)
            continue
        assert first & (first - 1) == 0 and second & (second - 1) == 0 and second >= 16
        assert first < d <= first + second < pad_dim(d)  # only the second chunk is masked


def test_the_split_follows_split_head_dims_and_sets_the_second_chunk_when_on(monkeypatch):
    q = torch.empty(1, 1, 3, 192)
    v = torch.empty(1, 1, 3, 40)
    monkeypatch.setattr(launch, "SPLIT_HEAD_DIMS", frozenset())
    flags = launch.plan(q, q, v, False, None, None, None, None, "t").flags
    assert (flags["BLOCK_D"], flags["BLOCK_D2"], flags["BLOCK_DV"], flags["BLOCK_DV2"]) == (
        256, 0, 64, 0,
    )  # fmt: skip
    assert launch.tile_width(flags) == 256
    monkeypatch.setattr(launch, "SPLIT_HEAD_DIMS", frozenset({192, 40}))
    flags = launch.plan(q, q, v, False, None, None, None, None, "t").flags
    assert (flags["BLOCK_D"], flags["BLOCK_D2"], flags["BLOCK_DV"], flags["BLOCK_DV2"]) == (
        128, 64, 32, 16,
    )  # fmt: skip
    assert launch.tile_width(flags) == 192


def test_the_default_split_holds_the_head_dims_measured_faster_each_covered_exactly():
    """SPLIT_HEAD_DIMS is what the H200 sweep measured faster (h200_headdims.json), and each of
    its head dims fills both chunks: a masked second chunk (d = 40 = 32 + 16 with 8 columns
    masked) stopped on an illegal memory access on the H200, so none runs by default."""
    assert launch.SPLIT_HEAD_DIMS == {80, 96, 192}
    assert launch.SEPARATE_DKDV_DIMS == {192, 256}
    for d in launch.SPLIT_HEAD_DIMS:
        assert sum(chunk_dims(d)) == d
    q = torch.empty(1, 1, 3, 192)
    flags = launch.plan(q, q, q, False, None, None, None, None, "t").flags
    assert (flags["BLOCK_D"], flags["BLOCK_D2"]) == (128, 64) and launch.separate_dkdv(flags)


# (B, H, H_kv, N_q, N_k, d, d_v, dtype, causal, window): both chunks of k and v, ragged lengths,
# GQA, N_q != N_k, and key and value dims split differently or only one of them split
CASES = [
    (1, 2, 1, 21, 37, 192, 192, "float32", True, None),
    (1, 2, 2, 19, 18, 192, 192, "bfloat16", False, None),
    (1, 2, 2, 17, 30, 80, 96, "float16", True, None),
    (2, 2, 1, 20, 20, 40, 192, "float32", False, (5, 3)),
    (1, 4, 2, 23, 19, 96, 64, "bfloat16", True, None),
    (1, 2, 1, 18, 22, 128, 160, "float32", True, (-1, 2)),
]


@pytest.mark.parametrize("B,H,H_kv,N_q,N_k,d,d_v,dtype,causal,window", CASES)
def test_two_chunk_kernels_match_reference(
    B, H, H_kv, N_q, N_k, d, d_v, dtype, causal, window, split_all, rng
):
    q, k, v = random_qkv(B, H, N_q, N_k, d, dtype, H_kv=H_kv, seed=rng, kind="torch", device=DEVICE)
    if d_v != d:
        v = torch.from_numpy(rng.standard_normal((B, H_kv, N_k, d_v))).to(DEVICE, q.dtype)
    opts = dict(causal=causal, window_size=window)
    o, lse = kernels.forward(q, k, v, **opts)
    o_ref, lse_ref = reference.forward(q, k, v, **opts)
    assert_close(o, o_ref, dtype=dtype, name="o")
    assert_close(lse, lse_ref, dtype="float32", name="lse")
    do = torch.from_numpy(rng.standard_normal(tuple(o.shape))).to(o)
    grads = kernels.backward(do, q, k, v, o, lse, **opts)
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, reference.backward(do, q, k, v, **opts)):
        assert_close(g, g_ref, dtype=dtype, grad=True, name=name)


def test_second_chunk_padding_is_never_read(split_all, rng):
    """d = 40 as 32 + 16: the second chunk's last 8 columns lie past d. The inputs are views into
    buffers 64 wide whose other columns hold NaN, so a load that touched them would show."""

    def view(x):
        buf = torch.full((*x.shape[:3], 64), float("nan"), device=x.device, dtype=x.dtype)
        buf[..., : x.shape[-1]] = x
        return buf[..., : x.shape[-1]]

    q, k, v = random_qkv(1, 2, 25, 31, 40, "float32", seed=rng, kind="torch", device=DEVICE)
    o, lse = kernels.forward(view(q), view(k), view(v), causal=True)
    assert_close(o, reference.forward(q, k, v, causal=True)[0], "float32", name="o")
    do = torch.from_numpy(rng.standard_normal(tuple(o.shape))).to(o)
    grads = kernels.backward(view(do), view(q), view(k), view(v), view(o), lse, causal=True)
    for name, g, r in zip(("dq", "dk", "dv"), grads, reference.backward(do, q, k, v, causal=True)):
        assert_close(g, r, "float32", grad=True, name=name)


def test_packed_sequences_run_in_two_chunks(split_all, rng):
    lens_q, lens_k = [5, 17, 1], [9, 17, 4]
    cu_q, cu_k = (torch.tensor(np.cumsum([0, *n]), dtype=torch.int32, device=DEVICE)
                  for n in (lens_q, lens_k))  # fmt: skip
    q, k, v = (torch.from_numpy(rng.standard_normal(s)).to(DEVICE, torch.float32)
               for s in ((23, 2, 96), (30, 1, 96), (30, 1, 96)))  # fmt: skip
    args = (q, k, v, cu_q, cu_k, max(lens_q), max(lens_k))
    o, lse = triton_varlen.forward(*args, causal=True)
    do = torch.from_numpy(rng.standard_normal(tuple(o.shape))).to(o)
    grads = triton_varlen.backward(do, q, k, v, o, lse, *args[3:], causal=True)
    for s in range(3):
        rows = slice(int(cu_q[s]), int(cu_q[s + 1]))
        keys = slice(int(cu_k[s]), int(cu_k[s + 1]))
        one = [x.transpose(0, 1)[None] for x in (q[rows], k[keys], v[keys], do[rows])]
        assert_close(o[rows], reference.forward(*one[:3], causal=True)[0][0].transpose(1, 0, 2),
                     "float32", name="o")  # fmt: skip
        g_ref = reference.backward(one[3], *one[:3], causal=True)
        for g, r, sl in zip(grads, g_ref, (rows, keys, keys)):
            assert_close(g[sl], r[0].transpose(1, 0, 2), "float32", grad=True)


def test_autotune_keeps_the_first_entry_of_a_two_chunk_width(monkeypatch):
    monkeypatch.setattr(launch, "SPLIT_HEAD_DIMS", frozenset({192}))
    q = torch.empty(1, 1, 3, 192, dtype=torch.bfloat16)
    flags = launch.plan(q, q, q, True, None, None, None, None, "t").flags
    for table in (fwd.fwd_table, bwd.dkdv_table, bwd.dq_table):
        configs = launch._all_configs(table)
        kept = launch._prune(table)(configs, {"Q": q}, **flags)
        got = [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in kept]
        assert got == table(192, False)[:1]


def _report():
    with open(REPORT) as f:
        return json.load(f)["rows"]


SWEEP = _env.ROOT / "notebooks" / "results" / "h200_headdims.json"


def _fastest(d, split, separate, kernel):
    """The config of `kernel` with the least non-causal + causal time in the H200 sweep, among
    those it checked correct in both."""
    with open(SWEEP) as f:
        sweep = json.load(f)["sweep"]
    times = {}
    for r in sweep:
        key = (r["d"], r["split"], r.get("separate", False), r["kernel"])
        if key == (d, split, separate, kernel) and r["ok"] and r["ms"] == r["ms"]:
            times.setdefault(tuple(r["config"]), {})[r["causal"]] = r["ms"]
    both = {c: sum(t.values()) for c, t in times.items() if len(t) == 2}
    return min(both, key=both.get)


@pytest.mark.parametrize("d", sorted(launch.SPLIT_HEAD_DIMS))
def test_two_chunk_tables_start_with_the_h200_sweeps_fastest_config(d):
    """At each head dim that runs in two chunks by default, each kernel's first table entry (the
    one that runs untuned) is the fastest of its entries in notebooks/results/h200_headdims.json,
    and the compile report (scripts/hopper/compile_fa2.py, sm_90a, bf16) holds it within shared
    memory, causal and not."""
    width = sum(chunk_dims(d))
    rows = [r for r in _report() if r["d"] == d and r["split"] and r["parts"] == 3]
    sep = d in launch.SEPARATE_DKDV_DIMS
    dkdv = bwd.dkdv_parts_table if sep else bwd.dkdv_table
    for kern, table in (("fwd", fwd.fwd_table), ("dkdv", dkdv), ("dq", bwd.dq_table)):
        first = table(width, False)[0]
        assert first == _fastest(d, True, sep and kern == "dkdv", kern), (kern, d)
        if kern == "dkdv" and sep:
            continue  # the two-launch kernel's compiles are rows with parts 1 and 2
        for causal in (False, True):
            key = (kern, list(first), causal)
            found = [r for r in rows if (r["kernel"], r["config"], r["causal"]) == key]
            assert found, f"{kern} {first} d={d} causal={causal} is not in the compile report"
            assert found[0]["smem"] <= 227 * 1024, found[0]


# (B, H, H_kv, N_q, N_k, d, d_v, dtype, causal, split): dV and dK in two launches, padded and in
# two chunks, GQA, N_q != N_k
SEPARATE = [
    (1, 4, 2, 21, 37, 192, 192, "float32", True, True),
    (2, 2, 1, 19, 18, 256, 256, "bfloat16", False, False),
    (1, 2, 2, 23, 17, 96, 40, "float16", True, True),
]


@pytest.mark.parametrize("B,H,H_kv,N_q,N_k,d,d_v,dtype,causal,split", SEPARATE)
def test_dk_and_dv_in_two_launches_match_reference(
    B, H, H_kv, N_q, N_k, d, d_v, dtype, causal, split, monkeypatch, rng
):
    monkeypatch.setattr(launch, "SEPARATE_DKDV_DIMS", frozenset({d}))
    monkeypatch.setattr(launch, "SPLIT_HEAD_DIMS", frozenset({d, d_v} if split else ()))
    q, k, v = random_qkv(B, H, N_q, N_k, d, dtype, H_kv=H_kv, seed=rng, kind="torch", device=DEVICE)
    if d_v != d:
        v = torch.from_numpy(rng.standard_normal((B, H_kv, N_k, d_v))).to(DEVICE, q.dtype)
    o, lse = kernels.forward(q, k, v, causal=causal)
    do = torch.from_numpy(rng.standard_normal(tuple(o.shape))).to(o)
    grads = kernels.backward(do, q, k, v, o, lse, causal=causal)
    g_ref = reference.backward(do, q, k, v, causal=causal)
    for name, g, r in zip(("dq", "dk", "dv"), grads, g_ref):
        assert_close(g, r, dtype=dtype, grad=True, name=name)
