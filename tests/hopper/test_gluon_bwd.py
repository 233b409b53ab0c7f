"""The Gluon Hopper backward: its logic on CPU, its schedule as compiled for sm_90a, and (marked
`gpu`) its numbers and determinism on an sm_90 GPU.

Gluon kernels do not run under the interpreter. So on CPU:
  * a tile-by-tile model in float64 walks the blocks exactly as the two kernels do (the block
    ranges from the module's `kv_query_blocks` / `dq_key_blocks`, which repeat the kernels' integer
    arithmetic; zero-filled tiles past the ends; lse = -inf turned to +inf; the causal mask only on
    the blocks the ranges call masked; GQA summed over the group on the host) and must match the
    float64 reference on ragged, causal, GQA and N_q != N_k shapes, rows that see no key included;
  * the kernels are compiled for GPUTarget("cuda", 90, 64) in a fresh process and the PTX and
    ptxas's report are read: asynchronous wgmma with a wait that leaves one group in flight, TMA
    copies, no serialised wgmma pipeline, no spills at the shipped tiles.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from flashedu import reference
from flashedu.hopper import dispatch as hopper_dispatch
from flashedu.hopper import gluon_bwd as gb
from flashedu.hopper import triton_fwd as th
from flashedu.kernels import bwd as triton_backward
from flashedu.testing import random_qkv

on_hopper = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
    reason="needs an sm_90 GPU (H100/H200)",
)


# ------------------------------------------------------------------------------------------------
# Host-side checks
# ------------------------------------------------------------------------------------------------
def _grads_inputs(N_q=40, N_k=40, d=64, dtype="bfloat16", H_kv=None, device="cpu"):
    q, k, v = random_qkv(1, 2, N_q, N_k, d, dtype, H_kv=H_kv, seed=0, kind="torch", device=device)
    do = torch.randn_like(q)
    o = torch.zeros_like(q)
    lse = torch.zeros(q.shape[:3], dtype=torch.float32, device=device)
    return do, q, k, v, o, lse


def test_configs_cover_every_head_dim_and_mask_and_pass_the_check():
    for d in th.HEAD_DIMS:
        for causal in (False, True):
            assert gb.check_config(gb.KV_CONFIGS[(d, causal)], "kv")
            assert gb.check_config(gb.DQ_CONFIGS[(d, causal)], "dq")
    for d, causal in hopper_dispatch.BWD_MEASURED_FASTER:
        assert (d, causal) in gb.KV_CONFIGS


@pytest.mark.parametrize(
    "cfg, kind, match",
    [
        ((64, 64, 2, 2), "kv", "num_warps must be 4 or 8"),
        ((64, 48, 4, 2), "kv", "powers of two >= 32"),
        ((64, 32, 4, 2), "kv", "BLOCK_N must be >= 64"),
        ((32, 64, 4, 2), "dq", "BLOCK_M must be >= 64"),
        ((64, 64, 4, 0), "dq", "num_stages must be >= 1"),
        ((64, 64, 4), "kv", "4 ints"),
    ],
)
def test_bad_configs_are_named(cfg, kind, match):
    with pytest.raises(ValueError, match=match):
        gb.check_config(cfg, kind)


def test_bad_options_and_cpu_tensors_are_refused_by_name():
    args = _grads_inputs()
    with pytest.raises(ValueError, match="dq_mode must be one of"):
        gb.backward(*args, dq_mode="tma")
    with pytest.raises(ValueError, match="deterministic=True needs dq_mode='separate'"):
        gb.backward(*args, dq_mode="atomic", deterministic=True)
    with pytest.raises(th.HopperUnsupported, match="got device cpu"):
        gb.backward(*args)
    with pytest.raises(th.HopperUnsupported, match="head dim must be one of"):
        gb.backward(*_grads_inputs(d=96))


def test_dispatch_backward_off_the_gpu_is_the_fa2_backward():
    """Under the interpreter the registry's hopper entry hands the backward to the FA2 kernels."""
    q, k, v = random_qkv(1, 2, 33, 47, 64, "float32", H_kv=1, seed=1, kind="torch")
    do = torch.randn_like(q)
    o, lse = hopper_dispatch.forward(q, k, v, causal=True)
    got = hopper_dispatch.backward(do, q, k, v, o, lse, causal=True)
    want = triton_backward.backward(do, q, k, v, o, lse, causal=True)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------
# The kernels' logic, tile by tile, in float64
# ------------------------------------------------------------------------------------------------
def _tile(x, start, rows):
    """Rows [start, start + rows) of x (N, d), zero-filled past the end, as TMA loads them."""
    out = np.zeros((rows, x.shape[1]))
    part = x[start : start + rows]
    out[: len(part)] = part
    return out


def model_backward(do, q, k, v, lse, delta, causal, kv_cfg, dq_cfg, scale):
    """The separate-mode backward as the kernels compute it, program by program."""
    B, H, N_q, d = q.shape
    H_kv, N_k = k.shape[1], k.shape[2]
    G = H // H_kv
    bm, bn = kv_cfg[:2]
    offset = N_k - N_q
    dk_h = np.zeros((B, H, N_k, d))
    dv_h = np.zeros((B, H, N_k, d))
    dq = np.zeros((B, H, N_q, d))
    lse2 = np.where(np.isneginf(lse), np.inf, lse)  # a row that sees no key: P = 0
    for b in range(B):
        for h in range(H):
            kh, vh = k[b, h // G], v[b, h // G]
            for n0 in range(0, N_k, bn):  # one dK/dV program
                kt, vt = _tile(kh, n0, bn), _tile(vh, n0, bn)
                cols = n0 + np.arange(bn)
                dk_t, dv_t = np.zeros((bn, d)), np.zeros((bn, d))
                first, full, end = gb.kv_query_blocks(n0, N_q, N_k, causal, bm, bn)
                for blk in range(first, end):
                    rows = blk * bm + np.arange(bm)
                    qt, dot = _tile(q[b, h], blk * bm, bm), _tile(do[b, h], blk * bm, bm)
                    lrow = np.where(rows < N_q, lse2[b, h, np.minimum(rows, N_q - 1)], np.inf)
                    drow = np.where(rows < N_q, delta[b, h, np.minimum(rows, N_q - 1)], 0.0)
                    z = scale * kt @ qt.T - lrow[None, :]
                    if blk < full:  # the causal diagonal only
                        z = np.where(cols[:, None] <= rows[None, :] + offset, z, -np.inf)
                    p_t = np.exp(z)
                    dv_t += p_t @ dot
                    ds_t = p_t * (vt @ dot.T - drow[None, :])
                    dk_t += ds_t @ qt
                keep = cols < N_k
                dk_h[b, h, cols[keep]] = scale * dk_t[keep]
                dv_h[b, h, cols[keep]] = dv_t[keep]
            qm, qn = dq_cfg[:2]
            for m0 in range(0, N_q, qm):  # one dQ program
                rows = m0 + np.arange(qm)
                qt, dot = _tile(q[b, h], m0, qm), _tile(do[b, h], m0, qm)
                lrow = np.where(rows < N_q, lse2[b, h, np.minimum(rows, N_q - 1)], np.inf)
                drow = np.where(rows < N_q, delta[b, h, np.minimum(rows, N_q - 1)], 0.0)
                acc = np.zeros((qm, d))
                n_full, n_blocks = gb.dq_key_blocks(m0, N_q, N_k, causal, qm, qn)
                for j in range(n_blocks):
                    kt, vt = _tile(kh, j * qn, qn), _tile(vh, j * qn, qn)
                    cols = j * qn + np.arange(qn)
                    z = scale * qt @ kt.T - lrow[:, None]
                    if j >= n_full:
                        z = np.where(cols[None, :] <= rows[:, None] + offset, z, -np.inf)
                    p = np.exp(z)
                    acc += (p * (dot @ vt.T - drow[:, None])) @ kt
                keep = rows < N_q
                dq[b, h, rows[keep]] = scale * acc[keep]
    # GQA: the host sums the query heads of each group
    dk = dk_h.reshape(B, H_kv, G, N_k, d).sum(2)
    dv = dv_h.reshape(B, H_kv, G, N_k, d).sum(2)
    return dq, dk, dv


@pytest.mark.parametrize(
    "B, H, H_kv, N_q, N_k, causal, kv_cfg, dq_cfg",
    [
        (1, 2, 2, 100, 100, False, (32, 64), (64, 32)),
        (1, 2, 2, 100, 100, True, (32, 64), (64, 32)),
        (1, 4, 2, 77, 130, True, (32, 64), (64, 64)),  # GQA, N_q < N_k
        (1, 2, 1, 130, 50, True, (32, 64), (64, 32)),  # rows that see no key
        (2, 2, 2, 65, 129, False, (64, 64), (64, 128)),  # ragged both ways
        (1, 2, 1, 1, 70, True, (32, 64), (64, 32)),  # one query row
    ],
)
def test_tile_model_of_the_kernels_matches_the_reference(B, H, H_kv, N_q, N_k, causal, kv_cfg,
                                                         dq_cfg):  # fmt: skip
    d = 16
    q, k, v = random_qkv(B, H, N_q, N_k, d, "float64", H_kv=H_kv, seed=N_q + N_k)
    do = np.random.default_rng(3).standard_normal(q.shape)
    o, lse = reference.forward(q, k, v, causal=causal)
    delta = (o * do).sum(-1)
    got = model_backward(do, q, k, v, lse, delta, causal, kv_cfg, dq_cfg, 1 / math.sqrt(d))
    want = reference.backward(do, q, k, v, causal=causal)
    for name, a, r in zip(("dq", "dk", "dv"), got, want):
        assert np.isfinite(a).all(), name
        np.testing.assert_allclose(a, r, atol=1e-12, rtol=1e-10, err_msg=name)
    if causal and N_q > N_k:  # rows that see no key get exactly zero
        assert (got[0][:, :, : N_q - N_k] == 0).all()


def test_block_ranges_skip_what_no_row_sees_and_mask_only_the_diagonal():
    # causal, N_q == N_k: keys 64..127 are seen from query 64 on; block 1 (rows 64..127) is the
    # diagonal (masked), blocks from 2 on are full
    assert gb.kv_query_blocks(64, 256, 256, True, 64, 64) == (1, 2, 4)
    assert gb.kv_query_blocks(64, 256, 256, False, 64, 64) == (0, 0, 4)
    # queries 0..63 see keys 0..63: one block, masked; none unmasked
    assert gb.dq_key_blocks(0, 256, 256, True, 64, 64) == (0, 1)
    assert gb.dq_key_blocks(128, 256, 256, True, 64, 64) == (2, 3)
    assert gb.dq_key_blocks(0, 100, 130, False, 64, 64) == (3, 3)
    # a key block no query sees (causal, N_q < N_k is fine; here N_q > N_k, rows 0..79 see none)
    assert gb.dq_key_blocks(0, 130, 50, True, 64, 32) == (0, 0)


# ------------------------------------------------------------------------------------------------
# Compiled for sm_90a without a GPU
# ------------------------------------------------------------------------------------------------
_COMPILE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from scripts.hopper.compile_gluon_bwd import compile_kernel
from flashedu.hopper import gluon_bwd as gb
out = []
cases = [("kv", 64, True), ("dq", 64, False), ("kv", 128, False), ("dq", 128, True)]
for which, d, causal in cases:
    table = gb.KV_CONFIGS if which == "kv" else gb.DQ_CONFIGS
    r = compile_kernel(which, d, causal, *table[(d, causal)], atomic=False)
    r.pop("ptxas_tail")
    out.append(r)
print(json.dumps(out))
"""


def test_shipped_tiles_compile_for_sm90_with_the_overlap_and_no_spills():
    """Compiled in a fresh process with TRITON_INTERPRET=0 (a kernel defined under the
    interpreter cannot be compiled)."""
    pytest.importorskip("triton.experimental.gluon._runtime")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="0")
    run = subprocess.run([sys.executable, "-c", _COMPILE, root], capture_output=True, text=True,
                         env=env, timeout=600, cwd=root)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    for r in json.loads(run.stdout.strip().splitlines()[-1]):
        label = f"{r['kernel']} d={r['d']} causal={r['causal']} {r['config']}"
        assert r["wgmma"] >= 6, label
        assert r["wait1"] >= 1, label + ": no wait leaves a wgmma in flight"
        assert r["tma"] >= 4, label
        assert not r["serialized"], label + ": ptxas serialised the wgmma pipeline"
        assert r["spill_stores"] == [0], label + f": {r['spill_stores']} bytes spilled"
        assert r["smem"] <= 232448 // 2, label + ": two programs no longer fit an SM"


def test_the_source_has_no_stray_device_synchronisation():
    src = open(gb.__file__).read()
    assert not re.search(r"torch\.cuda\.synchronize", src)


# ------------------------------------------------------------------------------------------------
# On an sm_90 GPU
# ------------------------------------------------------------------------------------------------
def _close_to_reference(g, want, dtype):
    tol = {"bfloat16": 3e-2, "float16": 4e-3}[dtype]
    for a, r in zip(g, want):
        r = torch.as_tensor(r, device=a.device)
        scale = r.abs().max().item() or 1.0
        assert (a.double() - r).abs().max().item() <= tol * scale


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mode", ["separate", "atomic"])
def test_gpu_backward_matches_reference(dtype, d, causal, mode):
    from flashedu.hopper import gluon_fwd as gh

    q, k, v = random_qkv(1, 4, 1000, 1300, d, dtype, H_kv=2, seed=0, kind="torch", device="cuda")
    do = torch.randn_like(q)
    o, lse = gh.forward(q, k, v, causal=causal)
    g = gb.backward(do, q, k, v, o, lse, causal=causal, dq_mode=mode)
    want = reference.backward(*(x.double().cpu().numpy() for x in (do, q, k, v)), causal=causal)
    _close_to_reference(g, want, dtype)


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_deterministic_mode_gives_the_same_bits_every_run(causal):
    from flashedu.hopper import gluon_fwd as gh

    q, k, v = random_qkv(1, 8, 2048, 2048, 128, "bfloat16", H_kv=2, seed=1, kind="torch",
                         device="cuda")  # fmt: skip
    do = torch.randn_like(q)
    o, lse = gh.forward(q, k, v, causal=causal)
    runs = [gb.backward(do, q, k, v, o, lse, causal=causal, deterministic=True) for _ in range(3)]
    for r in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], r))


# ------------------------------------------------------------------------------------------------
# The recorded results and the ladder table
# ------------------------------------------------------------------------------------------------
def test_backward_results_load_and_the_ladder_table_reads_the_file(tmp_path):
    from flashedu.hopper import results as hr

    assert hr.load_backward(tmp_path / "absent.json") is None
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="lacks ladder, correctness"):
        hr.load_backward(bad)
    res = hr.load_backward()
    assert res is not None and all(r["passed"] for r in res["correctness"])
    assert all(r["bitwise_identical"] for r in res["determinism"] if r["variant"] != "atomic")
    table = hr.ladder_table(res)
    lines = table.splitlines()
    assert max(map(len, lines)) < 100
    assert lines[1].startswith("fa2") and lines[1].count("1.00x") == 4
    first = next(r for r in res["ladder"] if r["kernel"] == "gluon_overlap" and r["d"] == 128
                 and not r["causal"])  # fmt: skip
    assert f"{first['tflops']:5.0f}" in next(x for x in lines if x.startswith("gluon_overlap"))
    assert "not built - warp_specialize" in table
