"""The Gluon Hopper forward: host checks on CPU, the schedule as compiled for sm_90a without a GPU,
and (marked `gpu`) the numbers on an sm_90 GPU.

Gluon kernels do not run under the interpreter, so on CPU the test compiles the kernel for
`GPUTarget("cuda", 90, 64)` and reads the PTX and the bundled ptxas's report: the overlap the
module exists for (the Q K^T of block j + 1 in flight while block j's softmax runs) shows as a
`wgmma.wait_group` that leaves one group pending, and the tile must fit the registers unspilled.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from flashedu import reference
from flashedu.hopper import gluon_fwd as gh
from flashedu.hopper import triton_fwd as th
from flashedu.testing import assert_close, random_qkv

on_hopper = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
    reason="needs an sm_90 GPU (H100/H200)",
)


def _qkv(N_q=40, N_k=40, d=64, dtype="bfloat16", device="cpu", H_kv=None):
    return random_qkv(1, 2, N_q, N_k, d, dtype, H_kv=H_kv, seed=0, kind="torch", device=device)


def test_configs_cover_every_head_dim_and_mask_and_pass_the_check():
    for d in th.HEAD_DIMS:
        for causal in (False, True):
            assert gh.check_config(gh.config_for(d, causal)) == gh.CONFIGS[(d, causal)]


@pytest.mark.parametrize(
    "config, match",
    [
        ((64, 64, 8, 2), "multiple of 16 \\* num_warps"),
        ((64, 64, 2, 2), "num_warps 4 or 8"),
        ((64, 48, 4, 2), "powers of two"),
        ((64, 64, 4, 1), "num_stages must be >= 2"),
        ((64, 64, 4), "4 ints"),
    ],
)
def test_bad_configs_are_named(config, match):
    with pytest.raises(ValueError, match=match):
        gh.forward(*_qkv(), config=config)


def test_cpu_tensors_are_refused_by_name_for_callers_that_hand_over():
    with pytest.raises(th.HopperUnsupported, match="got device cpu"):
        gh.forward(*_qkv())
    with pytest.raises(th.HopperUnsupported, match="head dim must be one of"):
        gh.forward(*_qkv(d=96))


def test_descriptor_tiles_rows_of_one_head():
    x3 = torch.zeros(6, 100, 64, dtype=torch.bfloat16)
    desc = gh.descriptor(x3, 64)
    assert list(desc.block_shape) == [1, 64, 64] and list(desc.shape) == [6, 100, 64]


_COMPILE = """
import json, os, re, subprocess, sys, tempfile
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from flashedu.hopper import gluon_fwd as gh

d, causal = int(sys.argv[1]), sys.argv[2] == "causal"
bm, bn, warps, stages = gh.config_for(d, causal)
desc = {r: f"tensordesc<bf16[1, {r}, {d}],{gh.shared_layout(r, d, torch.bfloat16)!r}>"
        for r in (bm, bn)}
sig = dict(desc_q=desc[bm], desc_k=desc[bn], desc_v=desc[bn], O="*bf16", LSE="*fp32",
           qk_scale="fp32", H="i32", GROUP="i32", N_q="i32", N_k="i32", CAUSAL="constexpr",
           SCALE_POS="constexpr", NUM_STAGES="constexpr")
fn = gh._gluon_fwd
const = {"CAUSAL": causal, "SCALE_POS": True, "NUM_STAGES": stages}
src = GluonASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
kernel = triton.compile(src, target=GPUTarget("cuda", 90, 64), options=dict(num_warps=warps))
ptx = kernel.asm["ptx"]
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
report = None
if os.path.exists(ptxas):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        open(path, "w").write(ptx)
        r = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", path[:-3] + "cubin"],
                           capture_output=True, text=True)
        report = dict(rc=r.returncode, text=r.stdout + r.stderr)
print(json.dumps(dict(ptx=ptx, ptxas=report)))
"""


@pytest.mark.parametrize("d, causal", [(64, False), (128, True)])
def test_the_schedule_compiles_for_sm90_with_softmax_beside_the_next_matmul(d, causal):
    """Compiled in a fresh process with TRITON_INTERPRET=0 (a kernel defined under the
    interpreter cannot be compiled)."""
    pytest.importorskip("triton.experimental.gluon._runtime")
    env = dict(os.environ, TRITON_INTERPRET="0")
    run = subprocess.run(
        [sys.executable, "-c", _COMPILE, str(d), "causal" if causal else "full"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    ptx = out["ptx"]
    assert re.search(r"wgmma\.wait_group\.sync\.aligned\s+1;", ptx), (
        "no wait leaves S_j+1 in flight"
    )
    assert len(re.findall(r"wgmma\.mma_async", ptx)) >= 8
    assert len(re.findall(r"cp\.async\.bulk\.tensor", ptx)) >= 3  # Q, K and V through TMA
    if out["ptxas"] is not None:
        text = out["ptxas"]["text"]
        assert out["ptxas"]["rc"] == 0, text[-500:]
        assert "0 bytes spill stores" in text, text[-500:]
        assert "serialized" not in text, "ptxas serialised the wgmma pipeline: " + text[-500:]


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_forward_matches_reference(dtype, d, causal):
    q, k, v = _qkv(1000, 1300, d, dtype, device="cuda", H_kv=1)
    o, lse = gh.forward(q, k, v, causal=causal)
    o_ref, lse_ref = reference.forward(q, k, v, causal=causal)
    assert_close(o, o_ref, dtype=dtype)
    assert_close(lse, lse_ref, dtype="float32")
