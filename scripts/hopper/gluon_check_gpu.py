"""Check, then time, the Gluon FlashAttention forward (gluon_fwd.py) on an H200.

Usage, on the GPU machine, from a folder holding this script, gluon_fwd.py (flashedu/hopper/gluon_fwd.py
as it was when this ran, with its first tile table) and a copy of flashedu/hopper/triton_fwd.py:
    timeout 330 python3 gluon_check_gpu.py --out gluon_check.json --budget 240

Phases (the JSON file is rewritten after every result, so a crash or a hang loses nothing):
  0. environment; a tiny smoke run (a hang there means a pipeline deadlock in the kernel);
  1. correctness against a float64 reference, for several shapes (GQA, N_q != N_k, fully masked
     rows), d = 64 and 128, bf16 and fp16. A case passes when max |o - ref| <= 2 * SDPA's error
     on the same inputs + 1e-6 (rows that see at least one key), lse error < 1e-3, fully masked
     rows give exactly o = 0 and lse = -inf, and everything else is finite;
  2. timing (triton.testing.do_bench, median) beside triton_hopper.forward (plain Triton) and
     SDPA's cuDNN backend, for each Gluon config in GLUON_CONFIGS; TFLOP/s = 4 B H N^2 d / time,
     halved for causal.
Every case runs under try/except: a failure is recorded and the script goes on. After --budget
seconds it starts nothing new.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402

BF16, FP16 = torch.bfloat16, torch.float16
DT_NAME = {BF16: "bf16", FP16: "fp16"}

# (B, H, H_kv, N_q, N_k, causal)
CASES = [
    (2, 4, 4, 1000, 1000, False),
    (2, 4, 4, 1000, 1000, True),
    (1, 8, 2, 777, 1301, True),
    (1, 4, 1, 1300, 500, True),  # rows 0..799 see no key: o = 0, lse = -inf
    (1, 4, 4, 2048, 2048, True),
    (1, 2, 1, 1, 300, True),
]
# timing shapes: (B, H, N, d)
BENCH_SHAPES = [(2, 16, 8192, 128), (4, 16, 4096, 64)]
# Gluon configs to time, (BLOCK_M, BLOCK_N, num_warps, num_stages), per head dim (6 in all; each
# is compiled for 2 dtypes x 2 masks, about 3 s a compile). The first of each list is gluon_fwd's
# default. BLOCK_N = 128 at d = 128 does not fit the registers (two S tiles in flight + O).
GLUON_CONFIGS = {
    128: [(128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 2)],  # the last: 2 CTAs per SM
    64: [(128, 128, 8, 3), (64, 128, 4, 3), (128, 64, 8, 3)],
}

T0 = time.time()
RESULTS: dict = {}
OUT = "gluon_check.json"
BUDGET = 240.0


def save():
    tmp = OUT + ".tmp"
    with open(tmp, "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)
    os.replace(tmp, OUT)


def over_budget() -> bool:
    return time.time() - T0 > BUDGET


def err_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}\n" + "".join(traceback.format_tb(e.__traceback__)[-4:])


def rand(shape, dtype, seed):
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    return torch.randn(shape, device="cuda", generator=g).to(dtype)


def causal_keep(n_q, n_k, device):
    """(N_q, N_k) bool: query i sees key j iff j <= i + N_k - N_q (bottom-right aligned)."""
    i = torch.arange(n_q, device=device)[:, None]
    j = torch.arange(n_k, device=device)[None, :]
    return j <= i + (n_k - n_q)


def reference(q, k, v, causal, scale):
    """float64 attention. Returns o (B, H, N_q, d), lse (B, H, N_q) (natural log) and the
    (N_q,) bool mask of rows that see no key (o = 0, lse = -inf there)."""
    B, H, n_q, d = q.shape
    group = H // k.shape[1]
    kf = k.double().repeat_interleave(group, dim=1)
    vf = v.double().repeat_interleave(group, dim=1)
    s = (q.double() @ kf.transpose(-1, -2)) * scale
    n_k = k.shape[2]
    if causal:
        keep = causal_keep(n_q, n_k, q.device)
        s = s.masked_fill(~keep, float("-inf"))
        empty = ~keep.any(1)
    else:
        empty = torch.zeros(n_q, dtype=torch.bool, device=q.device)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None])
    p = torch.where(empty[None, None, :, None], torch.zeros_like(p), p)
    return p @ vf, lse, empty


def sdpa_out(q, k, v, causal, scale):
    """SDPA in the input dtype, on K/V expanded to H heads, with an explicit bottom-right mask."""
    group = q.shape[1] // k.shape[1]
    ke = k.repeat_interleave(group, dim=1)
    ve = v.repeat_interleave(group, dim=1)
    mask = causal_keep(q.shape[2], k.shape[2], q.device) if causal else None
    return F.scaled_dot_product_attention(q, ke, ve, attn_mask=mask, scale=scale)


# ------------------------------------------------------------------------------------------------
def phase_env():
    RESULTS["env"] = dict(
        python=platform.python_version(), torch=torch.__version__, triton=triton.__version__,
        device=torch.cuda.get_device_name(0), capability=list(torch.cuda.get_device_capability(0)),
        gluon_default_configs={str(k): v for k, v in gf.CONFIGS.items()},
        gluon_bench_configs={str(k): v for k, v in GLUON_CONFIGS.items()},
    )
    save()


def phase_smoke():
    """One tiny call: if the kernel deadlocks (an mbarrier phase or a wgmma wait gone wrong),
    the JSON shows smoke 'started' and nothing after it."""
    RESULTS["smoke"] = {"status": "started"}
    save()
    print("smoke: started", flush=True)
    try:
        q, k, v = (rand((1, 1, 200, 64), BF16, s) for s in (1, 2, 3))
        o, lse = gf.forward(q, k, v)
        torch.cuda.synchronize()
        ref, ref_lse, _ = reference(q, k, v, False, 1 / 8)
        RESULTS["smoke"] = dict(status="ok", max_err=(o.double() - ref).abs().max().item(),
                                lse_err=(lse.double() - ref_lse).abs().max().item())
    except Exception as e:
        RESULTS["smoke"] = dict(status="error", error=err_text(e))
    print("smoke:", json.dumps(RESULTS["smoke"])[:300], flush=True)
    save()


def check_case(B, H, H_kv, n_q, n_k, causal, d, dtype, seed):
    scale = 1.0 / math.sqrt(d)
    q = rand((B, H, n_q, d), dtype, seed)
    k = rand((B, H_kv, n_k, d), dtype, seed + 1)
    v = rand((B, H_kv, n_k, d), dtype, seed + 2)
    ref, ref_lse, empty = reference(q, k, v, causal, scale)
    seen = ~empty
    r = dict(case=[B, H, H_kv, n_q, n_k, causal], d=d, dtype=DT_NAME[dtype],
             config=list(gf.config_for(d, causal)), empty_rows=int(empty.sum()))
    sd = sdpa_out(q, k, v, causal, scale).double()
    r["sdpa_err"] = (sd - ref)[:, :, seen].abs().max().item()
    t = time.time()
    o, lse = gf.forward(q, k, v, causal=causal, softmax_scale=scale)
    torch.cuda.synchronize()
    r["first_call_s"] = round(time.time() - t, 2)
    od, ld = o.double(), lse.double()
    r["dtype_ok"] = o.dtype == dtype and lse.dtype == torch.float32
    r["shape_ok"] = tuple(o.shape) == tuple(q.shape) and tuple(lse.shape) == (B, H, n_q)
    r["o_finite"] = bool(torch.isfinite(od).all())
    r["max_err"] = (od - ref)[:, :, seen].abs().max().item() if seen.any() else 0.0
    r["lse_err"] = (ld - ref_lse)[:, :, seen].abs().max().item() if seen.any() else 0.0
    r["lse_finite_on_seen"] = bool(torch.isfinite(ld[:, :, seen]).all())
    if empty.any():
        r["empty_exact"] = bool((od[:, :, empty] == 0).all()
                                and torch.isneginf(ld[:, :, empty]).all())
    else:
        r["empty_exact"] = True
    r["tol"] = 2 * r["sdpa_err"] + 1e-6
    r["pass"] = bool(r["dtype_ok"] and r["shape_ok"] and r["o_finite"] and r["lse_finite_on_seen"]
                     and r["empty_exact"] and r["max_err"] <= r["tol"] and r["lse_err"] < 1e-3)
    return r


def phase_correctness():
    out = RESULTS.setdefault("correctness", [])
    seed = 1000
    for dtype in (BF16, FP16):
        for d in (128, 64):
            for case in CASES:
                seed += 10
                name = f"{DT_NAME[dtype]} d={d} {case}"
                if over_budget():
                    out.append(dict(name=name, skipped="budget"))
                    save()
                    continue
                try:
                    r = check_case(*case, d, dtype, seed)
                except Exception as e:
                    r = {"pass": False, "error": err_text(e)}
                r["name"] = name
                out.append(r)
                keys = ("pass", "max_err", "tol", "lse_err", "empty_exact", "error")
                print("check", name, {k: r[k] for k in keys if k in r}, flush=True)
                save()
                torch.cuda.empty_cache()
    ok = [r.get("pass") for r in out if "skipped" not in r]
    RESULTS["correctness_summary"] = dict(run=len(ok), passed=sum(bool(x) for x in ok))
    save()


def tflops(B, H, N, d, causal, ms):
    return 4 * B * H * N * N * d * (0.5 if causal else 1.0) / (ms * 1e-3) / 1e12


def bench_one(name, fn, B, H, N, d, causal, ref_o=None):
    """Time fn (compiled first, outside the timing); optionally its max error against ref_o."""
    r = dict(name=name)
    if over_budget():
        r["skipped"] = "budget"
        return r
    try:
        t = time.time()
        o = fn()
        torch.cuda.synchronize()
        r["first_call_s"] = round(time.time() - t, 2)
        if isinstance(o, tuple):
            o = o[0]
        if ref_o is not None:
            r["max_diff_vs_cudnn"] = (o.float() - ref_o.float()).abs().max().item()
        ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        r["ms"] = ms
        r["tflops"] = tflops(B, H, N, d, causal, ms)
    except Exception as e:
        r["error"] = err_text(e)
    return r


def phase_bench():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        import triton_hopper as th
    except Exception as e:  # the comparison row is left out, Gluon still timed
        th = None
        RESULTS["triton_hopper_import_error"] = err_text(e)
    out = RESULTS.setdefault("bench", [])
    for dtype in (BF16, FP16):
        for B, H, N, d in BENCH_SHAPES:
            for causal in (False, True):
                tag = f"{DT_NAME[dtype]} B={B} H={H} N={N} d={d} {'causal' if causal else 'full'}"
                if over_budget():
                    out.append(dict(shape=tag, skipped="budget"))
                    save()
                    continue
                q, k, v = (rand((B, H, N, d), dtype, 7 + i) for i in range(3))
                rows = []

                def cudnn():
                    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

                r = bench_one("cudnn", cudnn, B, H, N, d, causal)
                rows.append(r)
                ref_o = None
                try:
                    ref_o = cudnn() if "error" not in r and "skipped" not in r else None
                except Exception:
                    ref_o = None
                if th is not None:
                    rows.append(bench_one(
                        "triton_hopper", lambda: th.forward(q, k, v, causal=causal),
                        B, H, N, d, causal, ref_o))
                for cfg in GLUON_CONFIGS[d]:
                    rows.append(bench_one(
                        f"gluon {cfg}",
                        lambda cfg=cfg: gf.forward(q, k, v, causal=causal, config=cfg),
                        B, H, N, d, causal, ref_o))
                for r in rows:
                    r["shape"] = tag
                    out.append(r)
                    shown = {k: (round(v, 4) if isinstance(v, float) else v)
                             for k, v in r.items() if k in ("tflops", "ms", "max_diff_vs_cudnn",
                                                           "skipped", "first_call_s")}
                    if "error" in r:
                        shown["error"] = r["error"].splitlines()[0][:200]
                    print("bench", tag, r["name"], shown, flush=True)
                save()
                q = k = v = ref_o = None  # free the inputs before the next shape
                torch.cuda.empty_cache()


def main():
    global OUT, BUDGET, gf
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gluon_check.json")
    ap.add_argument("--budget", type=float, default=240.0,
                    help="seconds after which nothing new is started")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--skip-check", action="store_true")
    args = ap.parse_args()
    OUT, BUDGET = args.out, args.budget
    RESULTS["started"] = time.strftime("%Y-%m-%d %H:%M:%S")
    try:
        import gluon_fwd as gf_mod
    except Exception as e:
        RESULTS["import_error"] = err_text(e)
        save()
        print("import gluon_fwd failed:", e, flush=True)
        return
    gf = gf_mod
    phase_env()
    phase_smoke()
    if not args.skip_check:
        phase_correctness()
    if not args.skip_bench:
        phase_bench()
    RESULTS["finished_s"] = round(time.time() - T0, 1)
    save()
    print("done in", RESULTS["finished_s"], "s; results in", OUT, flush=True)


gf = None

if __name__ == "__main__":
    main()
