"""Paged split-KV decoding (`kernels.paged`, `decoding.paged_forward`) against a float64 reference
built here by gathering each sequence's pages into contiguous K/V, with the sink as an explicit
extra column; every bad input one named error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from flashedu import decoding, reference
from flashedu.testing import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU tensors run under the interpreter

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0:DeprecationWarning"
)


def paged_cache(rng, lens, page_size, H_kv, d, d_v, dtype, spare=2):
    """A pool of pages in scrambled order: (k_cache, v_cache, block_table, cache_seqlens). Pages
    no sequence uses, slots past a length and table entries past a length hold NaN / -1, so a
    read the table does not name shows."""
    need = [-(-n // page_size) for n in lens]
    P = sum(need) + spare
    order = rng.permutation(P)
    width = max(need) + 1
    table = np.full((len(lens), width), -1, dtype=np.int32)
    k = np.full((P, page_size, H_kv, d), np.nan)
    v = np.full((P, page_size, H_kv, d_v), np.nan)
    at = 0
    for b, (n, m) in enumerate(zip(lens, need)):
        table[b, :m] = order[at : at + m]
        at += m
        rows = rng.standard_normal((m * page_size, H_kv, d + d_v))
        rows[n:] = np.nan
        k[table[b, :m]] = rows[:, :, :d].reshape(m, page_size, H_kv, d)
        v[table[b, :m]] = rows[:, :, d:].reshape(m, page_size, H_kv, d_v)
    dt = getattr(torch, dtype)
    kt, vt = (torch.from_numpy(x).to(DEVICE, dt) for x in (k, v))
    return kt, vt, torch.from_numpy(table).to(DEVICE), torch.tensor(lens, dtype=torch.int32,
                                                                     device=DEVICE)  # fmt: skip


def gathered(cache, table, n):
    """Sequence b's keys (H_kv, n, d) in float64: its pages gathered, in the test only."""
    ps = cache.shape[1]
    pages = table[: -(-n // ps)].long().cpu()
    return cache.cpu()[pages].reshape(-1, *cache.shape[2:])[:n].permute(1, 0, 2).double()


def paged_reference(q, k_cache, v_cache, table, lens, *, causal, sinks=None, scale=None):
    """float64 (o, lse): per sequence, the gathered K/V; the sink one more column of scores with
    a zero value row."""
    B, H, N_q, d = q.shape
    scale = 1 / np.sqrt(d) if scale is None else scale
    o = torch.zeros(B, H, N_q, v_cache.shape[-1], dtype=torch.float64)
    lse = torch.full((B, H, N_q), -np.inf, dtype=torch.float64)
    for b, n in enumerate(lens.tolist()):
        k, v = gathered(k_cache, table[b], n), gathered(v_cache, table[b], n)
        group = H // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)  # (H, n, d)
        s = q[b].cpu().double() @ k.transpose(-1, -2) * scale  # (H, N_q, n)
        if causal:
            hidden = torch.arange(n)[None, :] > torch.arange(N_q)[:, None] + n - N_q
            s = s.masked_fill(hidden, -np.inf)
        v = torch.cat([v, torch.zeros(H, 1, v.shape[-1], dtype=torch.float64)], 1)
        col = torch.full((H, N_q, 1), -np.inf, dtype=torch.float64)
        if sinks is not None:
            col = sinks.cpu().double()[:, None, None].expand(H, N_q, 1)
        s = torch.cat([s, col], -1)  # the sink: a column with no value
        lse[b] = torch.logsumexp(s, -1)
        p = torch.exp(s - torch.where(torch.isinf(lse[b]), 0.0, lse[b])[..., None])
        o[b] = p @ v
    return o, lse


def run_case(rng, *, lens, page_size, H, H_kv, N_q, d, d_v, dtype, causal, sinks, **kw):
    k_cache, v_cache, table, seqlens = paged_cache(rng, lens, page_size, H_kv, d, d_v, dtype)
    q = torch.from_numpy(rng.standard_normal((len(lens), H, N_q, d))).to(DEVICE, k_cache.dtype)
    s = torch.from_numpy(rng.standard_normal(H) * 2).to(DEVICE, torch.float32) if sinks else None
    o, lse = decoding.paged_forward(q, k_cache, v_cache, table, seqlens, causal=causal, sinks=s,
                                    **kw)  # fmt: skip
    o_ref, lse_ref = paged_reference(q, k_cache, v_cache, table, seqlens, causal=causal, sinks=s)
    assert o.dtype == q.dtype and lse.dtype == torch.float32
    assert o.shape == (len(lens), H, N_q, d_v) and lse.shape == (len(lens), H, N_q)
    assert_close(o, o_ref, dtype, name="o")
    assert_close(lse, lse_ref, "float32", name="lse")
    return o, lse


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("N_q", [1, 3])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_paged_forward_matches_the_gathered_reference(dtype, causal, N_q, page_size, sinks):
    # ragged: not a page multiple, empty, shorter than N_q, a page multiple, several pages
    rng = np.random.default_rng([page_size, N_q, int(causal), int(sinks), len(dtype)])
    lens = [37, 0, 2, 2 * page_size, 3 * page_size + 5]
    o, lse = run_case(rng, lens=lens, page_size=page_size, H=4, H_kv=2, N_q=N_q, d=16, d_v=16,
                      dtype=dtype, causal=causal, sinks=sinks, num_splits=3)  # fmt: skip
    if not sinks:
        assert (o[1] == 0).all() and torch.isneginf(lse[1]).all()  # len 0: nothing to attend


@pytest.mark.parametrize(
    "H,H_kv,N_q,d,d_v,page_size,block_n,num_splits",
    [
        (2, 2, 1, 40, 24, 64, 32, 2),  # padded head dims, d_v != d, BLOCK_N < page_size
        (8, 1, 2, 16, 16, 32, 16, 1),  # GQA 8 on 1, one split
        (3, 3, 1, 16, 16, 16, None, None),  # odd head count, default blocks and splits
        (4, 2, 1, 16, 16, 16, 16, 9),  # more splits than a short sequence fills
    ],
)
def test_paged_forward_shapes_blocks_and_splits(H, H_kv, N_q, d, d_v, page_size, block_n,
                                                num_splits):  # fmt: skip
    rng = np.random.default_rng(H * 100 + d)
    run_case(rng, lens=[page_size + 3, 1, 2 * page_size], page_size=page_size, H=H, H_kv=H_kv,
             N_q=N_q, d=d, d_v=d_v, dtype="float32", causal=True, sinks=True, block_n=block_n,
             num_splits=num_splits)  # fmt: skip


def test_huge_logits_and_a_minus_inf_sink_stay_exact():
    rng = np.random.default_rng(7)
    k_cache, v_cache, table, lens = paged_cache(rng, [50, 20], 16, 1, 16, 16, "float32")
    q = torch.from_numpy(rng.standard_normal((2, 2, 1, 16)) * 40).to(DEVICE, torch.float32)
    sinks = torch.tensor([-np.inf, 300.0], device=DEVICE)  # head 0 has no sink, head 1 dominates
    o, lse = decoding.paged_forward(q, k_cache, v_cache, table, lens, sinks=sinks)
    o_ref, lse_ref = paged_reference(q, k_cache, v_cache, table, lens, causal=False, sinks=sinks)
    assert torch.isfinite(o).all()
    assert_close(o, o_ref, "float32", name="o")
    assert_close(lse, lse_ref, "float32", name="lse")


def test_paged_equals_split_kv_on_a_contiguous_cache():
    """An identity block table over one sequence per batch row is the contiguous cache."""
    rng = np.random.default_rng(3)
    B, H, H_kv, N, d, ps = 2, 4, 2, 64, 16, 16
    k, v = (torch.from_numpy(rng.standard_normal((B, H_kv, N, d))).float() for _ in range(2))
    q = torch.from_numpy(rng.standard_normal((B, H, 2, d))).float()
    k_cache, v_cache = (x.permute(0, 2, 1, 3).reshape(B * N // ps, ps, H_kv, d) for x in (k, v))
    table = torch.arange(B * N // ps, dtype=torch.int32).reshape(B, N // ps)
    lens = torch.full((B,), N, dtype=torch.int32)
    sinks = torch.from_numpy(rng.standard_normal(H)).float()
    q, k, v, k_cache, v_cache, table, lens, sinks = (
        x.to(DEVICE) for x in (q, k, v, k_cache, v_cache, table, lens, sinks)
    )
    got = decoding.paged_forward(q, k_cache, v_cache, table, lens, causal=True, sinks=sinks)
    want = decoding.triton_forward(q, k, v, causal=True, sinks=sinks, num_splits=3)
    for a, b in zip(got, want):
        assert_close(a, b, "float32")


@pytest.mark.parametrize("causal", [False, True])
def test_triton_forward_sinks_are_an_extra_column(causal):
    rng = np.random.default_rng(11)
    q, k, v = (torch.from_numpy(rng.standard_normal(s)).float()
               for s in ((1, 4, 3, 16), (1, 2, 29, 16), (1, 2, 29, 16)))  # fmt: skip
    sinks = torch.from_numpy(rng.standard_normal(4) * 2).float()
    o, lse = decoding.triton_forward(
        q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), causal=causal, sinks=sinks.to(DEVICE)
    )
    k_cache, v_cache = (x[0].permute(1, 0, 2)[None] for x in (k, v))  # one page of 29 keys
    table = torch.zeros(1, 1, dtype=torch.int32)
    o_ref, lse_ref = paged_reference(
        q, k_cache, v_cache, table, torch.tensor([29]), causal=causal, sinks=sinks
    )
    assert_close(o, o_ref, "float32", name="o")
    assert_close(lse, lse_ref, "float32", name="lse")
    o0, lse0 = decoding.triton_forward(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), causal=causal)
    assert_close(o0, reference.forward(q, k, v, causal=causal)[0], "float32")


# ------------------------------------------------------------------------------------- errors
def _inputs():
    rng = np.random.default_rng(0)
    k_cache, v_cache, table, lens = paged_cache(rng, [20, 33], 16, 2, 16, 16, "float32")
    q = torch.zeros(2, 4, 1, 16, device=DEVICE)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_table=table, cache_seqlens=lens)


def _with(**change):
    args = _inputs()
    for key, fn in change.items():
        args[key] = fn(args[key]) if callable(fn) else fn
    return args


def _call(args, **kw):
    return decoding.paged_forward(
        args["q"], args["k_cache"], args["v_cache"], args["block_table"], args["cache_seqlens"],
        **kw,
    )  # fmt: skip


def _set(x, index, value):
    x = x.clone()
    x[index] = value
    return x


BAD = [
    (dict(block_table=lambda t: _set(t, (0, 0), 99)), {}, ValueError,
     r"block_table\[0\] names page 99, outside the pool's"),
    (dict(block_table=lambda t: _set(t, (1, 1), t[1, 0])), {}, ValueError,
     r"block_table\[1\] names page \d+ twice"),
    (dict(block_table=lambda t: t.long()), {}, TypeError, "block_table must be torch.int32, got "
     "torch.int64"),
    (dict(block_table=lambda t: t.float()), {}, TypeError, "block_table must hold integers"),
    (dict(cache_seqlens=lambda n: _set(n, 0, 70)), {}, ValueError,
     r"cache_seqlens\[0\] = 70 must lie in \[0, 64\]"),
    (dict(cache_seqlens=lambda n: n.long()), {}, TypeError, "cache_seqlens must be torch.int32"),
    (dict(cache_seqlens=lambda n: n[:1]), {}, ValueError, r"cache_seqlens must have shape \(B,\)"),
    (dict(block_table=lambda t: t[:1]), {}, ValueError, "block_table must have B = 2 rows"),
    (dict(block_table=None), {}, TypeError, "block_table must be a torch.Tensor, got None"),
    ({}, dict(sinks=torch.zeros(3)), ValueError, r"sinks must have shape \(H,\) = \(4,\)"),
    ({}, dict(sinks=torch.zeros(4, dtype=torch.float64)), TypeError,
     "sinks must be a torch.float32 tensor, got torch.float64"),
    ({}, dict(sinks=torch.zeros(4, dtype=torch.int32)), TypeError,
     "sinks must be floating point"),
    ({}, dict(sinks=torch.tensor([0.0, float("nan"), 0.0, 0.0])), ValueError,
     "sinks must be finite or -inf"),
    ({}, dict(block_n=32), ValueError,
     "page_size = 16 must be a multiple of the kernel's key block BLOCK_N = 32"),
    ({}, dict(block_n=24), ValueError, "block_n must be a power of two >= 16, got 24"),
    ({}, dict(num_splits=0), ValueError, "num_splits must be an int >= 1, got 0"),
    (dict(k_cache=lambda k: k[0]), {}, ValueError,
     r"k_cache must have shape \(num_pages, page_size, H_kv, d\), got \(16, 2, 16\)"),
    (dict(k_cache=lambda k: k[:, :, :, :8]), {}, ValueError,
     "k_cache's head dimension 8 must equal q's d = 16"),
    (dict(k_cache=lambda k: k[:, :, :1].expand(-1, -1, 3, -1).contiguous(),
          v_cache=lambda v: v[:, :, :1].expand(-1, -1, 3, -1).contiguous()), {}, ValueError,
     "q's H = 4 heads must be a multiple of the cache's H_kv = 3"),
    (dict(v_cache=lambda v: v[:, :8]), {}, ValueError,
     r"v_cache must have k_cache's \(num_pages, page_size, H_kv\)"),
    (dict(k_cache=lambda k: k.half()), {}, TypeError, "k_cache must have q's dtype"),
    (dict(q=lambda q: q.double(), k_cache=lambda k: k.double(), v_cache=lambda v: v.double()), {},
     TypeError, "float16, bfloat16 or float32, got torch.float64"),
    (dict(q=lambda q: q[0]), {}, ValueError, r"q must have shape \(B, H, N_q, d\)"),
    (dict(k_cache=lambda k: k.transpose(0, 1).contiguous().transpose(0, 1)), {}, ValueError,
     "k_cache must hold each page's rows one after another"),
    (dict(q=lambda q: q.expand(2, 4, 70, 16)), {}, ValueError,
     r"2 \* 70 query rows exceed the 128"),
    (dict(q=lambda q: torch.zeros(2, 4, 1, 300, device=DEVICE),
          k_cache=lambda k: torch.zeros(7, 16, 2, 300, device=DEVICE)), {}, ValueError,
     "head dimension d=300 is not supported"),
]  # fmt: skip


@pytest.mark.parametrize("change,kw,error,match", BAD)
def test_each_bad_input_is_one_named_error(change, kw, error, match):
    with pytest.raises(error, match=match):
        _call(_with(**change), **kw)


def test_triton_forward_sinks_errors_name_the_argument():
    q = torch.zeros(1, 2, 1, 16, device=DEVICE)
    k = torch.zeros(1, 2, 8, 16, device=DEVICE)
    with pytest.raises(TypeError, match="sinks must be a torch.float32 tensor"):
        decoding.triton_forward(q, k, k, sinks=torch.zeros(2, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match=r"sinks must have shape \(H,\) = \(2,\)"):
        decoding.triton_forward(q, k, k, sinks=torch.zeros(1, 2, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_paged_decoding_of_long_ragged_caches_on_a_gpu(dtype):
    rng = np.random.default_rng(1)
    run_case(rng, lens=[4095, 1, 777, 2048], page_size=64, H=16, H_kv=4, N_q=1, d=128, d_v=128,
             dtype=dtype, causal=True, sinks=True)  # fmt: skip


# ------------------------------------------------------------------- the GPU benchmark script
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "serving" / "h200_paged_decode.py"


def test_benchmark_script_has_help_and_a_dry_run(tmp_path):
    run = lambda *a: subprocess.run(
        [sys.executable, str(SCRIPT), *a], capture_output=True, text=True, timeout=300
    )
    helped = run("--help")
    assert helped.returncode == 0 and "--out" in helped.stdout and "--dry-run" in helped.stdout
    assert run().returncode == 2  # --out is required
    out = tmp_path / "dry.json"
    done = run("--out", str(out), "--dry-run")
    assert done.returncode == 0, done.stdout + done.stderr
    res = json.loads(out.read_text())
    assert {"date", "gpu", "torch", "triton", "cuda", "command", "hbm"} <= set(res)
    assert res["correctness"] and all(r["passed"] for r in res["correctness"])
    (row,) = res["rows"]
    assert row["bytes"] > 0 and row["ms"] > 0 and "sdpa_ms" in row and "frac_measured_hbm" in row


def test_kernels_compile_for_sm90_without_a_gpu():
    """The interpreter hides what only a compiler rejects: build both kernels for the H200."""
    code = (
        "import compile_check as c; "
        "c.ptxas(c.split('fp16', 128, 64, 8)); c.ptxas(c.combine('bf16', 128, 8, True))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=SCRIPT.parent, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
