"""The Gluon Hopper backward on an H200: correctness against float64 (beside SDPA's error on the
same inputs), bitwise determinism, then timings beside the FA2 backward and SDPA's FLASH and cuDNN
backends, and the ablation ladder, all written to one JSON file.

Usage (repository root, on an sm_90 GPU):
    python3 scripts/hopper/h200_backward.py --out RESULT.json [--phases ...] [--budget SECONDS]
then `python3 scripts/hopper/make_backward_results.py` (after copying the raw runs into
notebooks/results/h200_backward_runs/) rebuilds notebooks/results/h200_backward.json.
Phases (default: all, in this order): correct, determinism, sweep, compare, ladder, auto,
headdims.
The JSON is rewritten after every phase, and no phase starts after --budget seconds, so a run cut
short still leaves what it measured. About 6 minutes on an H200 for every phase.

Correctness rule (as the Hopper forward's checks): fresh random inputs for every case, float64
autograd reference on the GPU, SDPA's gradients on the same inputs (explicit bottom-right mask, K/V
heads repeated for GQA); each of dq, dk, dv passes when its max error is at most 2x SDPA's plus one
unit in the last place of the largest reference entry, and nothing is non-finite; rows that see no
key must get dq = 0 exactly.
TFLOP/s (traffic.attention_flops): backward 2.5 x forward = 10 B H N^2 d (x0.5 causal); forward +
backward 3.5 x forward.
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from flashedu.hopper import gluon_fwd as gh  # noqa: E402
from flashedu.hopper import gluon_bwd as gb  # noqa: E402
from flashedu.kernels import bwd as fa2b  # noqa: E402
from flashedu.hopper import triton_bwd as thb  # noqa: E402

BF16, FP16 = torch.bfloat16, torch.float16
DT = {BF16: "bf16", FP16: "fp16"}
# (B, H, H_kv, N_q, N_k, causal): ragged, GQA, N_q != N_k both ways, rows that see no key, N_q = 1
CASES = [
    (2, 4, 4, 1000, 1000, False),
    (2, 4, 4, 1000, 1000, True),
    (1, 8, 2, 777, 1301, True),
    (1, 4, 1, 1300, 500, True),
    (1, 4, 4, 2048, 2048, True),
    (1, 2, 1, 1, 300, True),
    (1, 4, 2, 300, 700, False),
    (1, 2, 2, 129, 65, False),
]
# Gluon backward variants: name -> backward() keyword arguments (None: the module's defaults)
VARIANTS = {
    "atomic": dict(dq_mode="atomic"),
    "deterministic": dict(deterministic=True),
}
SWEEP = {
    128: [
        dict(config=(64, 64, 4, 2), dq_config=(64, 64, 4, 2)),
        dict(config=(32, 64, 4, 2), dq_config=(64, 64, 4, 2)),
        dict(config=(32, 64, 4, 3), dq_config=(64, 64, 4, 2)),
        dict(config=(32, 128, 8, 2), dq_config=(64, 64, 4, 2)),
        dict(config=(64, 64, 4, 2), dq_config=(128, 64, 8, 2)),
        dict(config=(64, 64, 4, 2), dq_config=(64, 64, 4, 3)),
        dict(config=(32, 64, 4, 2), dq_config=(64, 32, 4, 3)),
        dict(config=(64, 64, 4, 2), dq_config=(64, 64, 4, 2), dq_mode="atomic"),
        dict(config=(32, 64, 4, 2), dq_config=(64, 64, 4, 2), dq_mode="atomic"),
    ],
    64: [
        dict(config=(64, 64, 4, 2), dq_config=(64, 128, 4, 2)),
        dict(config=(32, 64, 4, 2), dq_config=(64, 128, 4, 2)),
        dict(config=(64, 64, 4, 3), dq_config=(64, 128, 4, 3)),
        dict(config=(64, 128, 8, 2), dq_config=(64, 128, 4, 2)),
        dict(config=(64, 128, 8, 2), dq_config=(128, 128, 8, 2)),
        dict(config=(64, 64, 4, 2), dq_config=(64, 64, 4, 2)),
        dict(config=(64, 64, 4, 2), dq_config=(64, 128, 4, 2), dq_mode="atomic"),
    ],
}
# the fastest swept variant per (d, causal), filled in by the sweep phase; compare times it
BEST = {}


def _kw(kw):
    return {k_: str(x) for k_, x in kw.items()}


def rand(shape, dtype, gen):
    return torch.randn(shape, device="cuda", generator=gen).to(dtype)


def bench(fn):
    try:
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    except Exception as e:  # a variant that fails to compile or launch is recorded, not fatal
        print("bench failed:", type(e).__name__, str(e)[:300], flush=True)
        return float("nan")


def flops(B, H, N, d, causal, pass_):
    mult = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[pass_]
    return 4 * B * H * N * N * d * (0.5 if causal else 1.0) * mult


def mask_of(Nq, Nk):
    i = torch.arange(Nq, device="cuda")[:, None]
    return torch.arange(Nk, device="cuda")[None, :] <= i + Nk - Nq


def ref_grads(q, k, v, do, causal):
    """float64 o, lse and (dq, dk, dv) by autograd through the plain formulas."""
    G = q.shape[1] // k.shape[1]
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    s = q64 @ k64.repeat_interleave(G, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(~mask_of(q.shape[2], k.shape[2]), -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    o = p @ v64.repeat_interleave(G, 1)
    o.backward(do.double())
    return o.detach(), lse.detach(), (q64.grad, k64.grad, v64.grad)


def sdpa_grads(q, k, v, do, causal):
    G = q.shape[1] // k.shape[1]
    qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))
    mask = mask_of(q.shape[2], k.shape[2]) if causal else None
    o = torch.nn.functional.scaled_dot_product_attention(
        qs, ks.repeat_interleave(G, 1), vs.repeat_interleave(G, 1), attn_mask=mask
    )
    o.backward(do)
    return (qs.grad, ks.grad, vs.grad)


def ulp(r, dtype):
    return r.abs().max().item() * (2.0**-8 if dtype == BF16 else 2.0**-11) if r.numel() else 0.0


def err(a, r):
    return (a.double() - r).abs().max().item() if a.numel() else 0.0


def check(case, d, dtype, kwargs, gen, name):
    B, H, Hk, Nq, Nk, causal = case
    q = rand((B, H, Nq, d), dtype, gen)
    k, v = rand((B, Hk, Nk, d), dtype, gen), rand((B, Hk, Nk, d), dtype, gen)
    do = rand((B, H, Nq, d), dtype, gen)
    _, rl, rg = ref_grads(q, k, v, do, causal)
    sg = sdpa_grads(q, k, v, do, causal)
    o, lse = gh.forward(q, k, v, causal=causal)
    torch.full((B, H, Nq, d), float("nan"), device="cuda", dtype=dtype)  # poison the allocator
    g = gb.backward(do, q, k, v, o, lse, causal=causal, **kwargs)
    torch.cuda.synchronize()
    row = dict(
        variant=name,
        kwargs={k_: str(v_) for k_, v_ in kwargs.items()},
        case=list(case),
        d=d,
        dtype=DT[dtype],
    )
    ok = True
    for gname, a, r, s in zip(("dq", "dk", "dv"), g, rg, sg):
        row[f"{gname}_err"], row[f"{gname}_sdpa_err"] = err(a, r), err(s, r)
        row[f"{gname}_finite"] = bool(torch.isfinite(a).all())
        ok = ok and row[f"{gname}_finite"]
        ok = ok and row[f"{gname}_err"] <= 2 * row[f"{gname}_sdpa_err"] + ulp(r, dtype)
    empty = torch.isinf(rl)
    row["masked_rows"] = int(empty.sum())
    row["masked_ok"] = bool((g[0][empty] == 0).all())
    row["passed"] = bool(ok and row["masked_ok"])
    return row


def phase_correct(res, gen):
    rows = res["correctness"]
    variants = dict(VARIANTS)
    for d in (128, 64):  # every swept config on two hard cases too, when the sweep runs
        for i, kw in enumerate(SWEEP[d] if "sweep" in PHASES_RUN else []):
            variants[f"sweep{d}_{i}"] = kw
    for name, kw in variants.items():
        ds = (128, 64) if not name.startswith("sweep") else (int(name[5:].split("_")[0]),)
        for dtype in (BF16, FP16):
            if name.startswith("sweep") and dtype == FP16:
                continue
            for d in ds:
                cases = CASES if not name.startswith("sweep") else CASES[2:4]
                for case in cases:
                    try:
                        rows.append(check(case, d, dtype, kw, gen, name))
                    except Exception:
                        rows.append(
                            dict(
                                variant=name,
                                case=list(case),
                                d=d,
                                dtype=DT[dtype],
                                passed=False,
                                error=traceback.format_exc()[-800:],
                            )
                        )
                    if not rows[-1]["passed"]:
                        print("FAILED", json.dumps(rows[-1])[:1500], flush=True)
    n = sum(r["passed"] for r in rows)
    print(f"correctness: {n}/{len(rows)} passed", flush=True)


def phase_determinism(res, gen):
    """Same inputs, three runs each: deterministic mode must give the same bits every time."""
    out = res["determinism"]
    for d in (128, 64):
        for causal in (False, True):
            B, H, Hk, N = 1, 8, 2, 2048
            q, do = rand((B, H, N, d), BF16, gen), rand((B, H, N, d), BF16, gen)
            k, v = rand((B, Hk, N, d), BF16, gen), rand((B, Hk, N, d), BF16, gen)
            o, lse = gh.forward(q, k, v, causal=causal)
            for name, kw in VARIANTS.items():
                runs = [gb.backward(do, q, k, v, o, lse, causal=causal, **kw) for _ in range(3)]
                same = all(torch.equal(a, b) for r in runs[1:] for a, b in zip(runs[0], r))
                out.append(
                    dict(
                        variant=name,
                        d=d,
                        causal=causal,
                        shape=[B, H, Hk, N],
                        bitwise_identical=same,
                    )
                )
                print("determinism", name, d, causal, same, flush=True)


def setting(d):
    return (2, 16, 8192) if d == 128 else (2, 32, 8192)


def sdpa_bwd(backend, q, k, v, do, causal):
    qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))
    with sdpa_kernel([backend]):
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
    return lambda: torch.autograd.grad(o, (qs, ks, vs), do, retain_graph=True)


def sdpa_fb(backend, q, k, v, do, causal):
    qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))

    def run():
        with sdpa_kernel([backend]):
            o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
        return torch.autograd.grad(o, (qs, ks, vs), do)

    return run


def _inputs(d, dtype, gen):
    B, H, N = setting(d)
    return (B, H, N), [rand((B, H, N, d), dtype, gen) for _ in range(4)]


def _add(res, key, kernel, pass_, ms, shape, d, dtype, causal, **extra):
    B, H, N = shape
    tf = flops(B, H, N, d, causal, pass_) / ms * 1e-9
    res[key].append(
        dict(
            kernel=kernel,
            dtype=DT[dtype],
            d=d,
            causal=causal,
            B=B,
            H=H,
            N=N,
            **{"pass": pass_},
            ms=ms,
            tflops=tf,
            **extra,
        )
    )
    print(
        f"{key:8s} {kernel:28s} {DT[dtype]} d={d} causal={causal!s:5s} {pass_:7s} "
        f"{ms:8.3f} ms {tf:6.1f} TF/s",
        flush=True,
    )


def _kernel_ms(q, k, v, do, o, lse, causal, kw):
    """The dK/dV kernel and the dQ kernel timed alone (separate mode)."""
    B, H, N_q, d = q.shape
    scale = d**-0.5
    q3, k3, v3, do3 = gb.views(q, k, v, do)
    delta = fa2b.preprocess(o, do)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    dq = torch.empty_like(q)
    kv = bench(lambda: gb.launch_kv(q3, k3, v3, do3, lse, delta, None, dk, dv, scale, H, causal,
                                    kw["config"], True, False))  # fmt: skip
    dqm = bench(lambda: gb.launch_dq(q3, k3, v3, do3, lse, delta, dq, scale, H, causal,
                                     kw["dq_config"], True))  # fmt: skip
    pre = bench(lambda: fa2b.preprocess(o, do))
    return kv, dqm, pre


def phase_sweep(res, gen):
    """Backward alone, bf16, each swept Gluon config; the separate-mode ones also kernel by
    kernel. The fastest correct-looking variant per (d, causal) goes to BEST."""
    for d in (128, 64):
        shape, (q, k, v, do) = _inputs(d, BF16, gen)
        for causal in (False, True):
            o, lse = gh.forward(q, k, v, causal=causal)
            for i, kw in enumerate(SWEEP[d]):
                ms = bench(lambda: gb.backward(do, q, k, v, o, lse, causal=causal, **kw))
                extra = {}
                if kw.get("dq_mode", "separate") == "separate":
                    extra = dict(zip(("kv_ms", "dq_ms", "preprocess_ms"),
                                     _kernel_ms(q, k, v, do, o, lse, causal, kw)))  # fmt: skip
                _add(res, "sweep", f"gluon_sweep{d}_{i}", "bwd", ms, shape, d, BF16, causal,
                     kwargs={k_: str(v_) for k_, v_ in kw.items()}, **extra)  # fmt: skip
                if ms == ms and (ms < BEST.get((d, causal), (float("inf"),))[0]):
                    if kw.get("dq_mode", "separate") == "separate":
                        BEST[(d, causal)] = (ms, kw)
    res["best"] = [dict(d=d, causal=c, ms=v_[0], kwargs={k_: str(x) for k_, x in v_[1].items()})
                   for (d, c), v_ in BEST.items()]  # fmt: skip


def phase_compare(res, gen):
    """Backward alone and forward + backward, module defaults, beside FA2, FLASH and cuDNN."""
    for dtype in (BF16, FP16):
        for d in (128, 64):
            shape, (q, k, v, do) = _inputs(d, dtype, gen)
            for causal in (False, True):
                o, lse = gh.forward(q, k, v, causal=causal)
                variants = dict(VARIANTS)
                if (d, causal) in BEST:
                    variants["tuned"] = BEST[(d, causal)][1]
                for name, kw in variants.items():
                    _add(res, "rows", f"gluon_{name}", "bwd", bench(
                        lambda: gb.backward(do, q, k, v, o, lse, causal=causal, **kw)),
                        shape, d, dtype, causal, kwargs=_kw(kw))  # fmt: skip
                _add(res, "rows", "fa2", "bwd",
                     bench(lambda: fa2b.backward(do, q, k, v, o, lse, causal=causal)),
                     shape, d, dtype, causal)  # fmt: skip
                for name, be in (
                    ("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                    ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
                ):
                    _add(res, "rows", name, "bwd", bench(sdpa_bwd(be, q, k, v, do, causal)),
                         shape, d, dtype, causal)  # fmt: skip

                def fb(bwd):
                    o_, lse_ = gh.forward(q, k, v, causal=causal)
                    return bwd(do, q, k, v, o_, lse_, causal=causal)

                best = BEST.get((d, causal), (None, {}))[1]
                _add(res, "rows", "gluon_fwd+gluon_bwd", "fwd_bwd",
                     bench(lambda: fb(lambda *a, **k_: gb.backward(*a, **k_, **best))),
                     shape, d, dtype, causal, kwargs=_kw(best))  # fmt: skip
                _add(res, "rows", "gluon_fwd+fa2_bwd", "fwd_bwd", bench(lambda: fb(fa2b.backward)),
                     shape, d, dtype, causal)  # fmt: skip
                for name, be in (
                    ("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                    ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
                ):
                    _add(res, "rows", name, "fwd_bwd", bench(sdpa_fb(be, q, k, v, do, causal)),
                         shape, d, dtype, causal)  # fmt: skip


# The backward's ablation ladder: each step one configuration of the same Gluon source (switches
# of `hopper.gluon_bwd.backward`), after the two Triton kernels it grew from.
LADDER = [
    ("fa2", "FA2 Triton kernels: dK/dV pass + dQ pass, pointer loads (autotuned)", None),
    ("tma_one_pass", "Triton, tensor descriptors (TMA), one pass, dQ by TMA reductions", None),
    (
        "gluon_stages1_serial",
        "Gluon, TMA, 1 stage (each load waited for), every wgmma waited for",
        dict(deterministic=True, overlap=False, stages=1),
    ),
    (
        "gluon_stages2_serial",
        "+ pipelining: 2-stage Q/dO and K/V rings",
        dict(deterministic=True, overlap=False, stages=2),
    ),
    (
        "gluon_stages3_serial",
        "+ pipelining: 3 stages",
        dict(deterministic=True, overlap=False, stages=3),
    ),
    (
        "gluon_overlap",
        "+ intra-warpgroup overlap: exp and dS under the next wgmma",
        dict(deterministic=True, overlap=True, stages=2),
    ),
    (
        "gluon_dq_atomic",
        "dQ strategy: fp32 atomics in the same pass (5 matmuls, not 7)",
        dict(dq_mode="atomic", overlap=True, stages=2),
    ),
]


def _ladder_kwargs(d, causal, spec):
    kw = dict(spec)
    stages = kw.pop("stages")
    bm, bn, w, _ = gb.KV_CONFIGS[(d, causal)]
    qm, qn, qw, _ = gb.DQ_CONFIGS[(d, causal)]
    kw["config"] = (bm, bn, w, stages)
    kw["dq_config"] = (qm, qn, qw, stages)
    return kw


def phase_ladder(res, gen):
    for d in (128, 64):
        shape, (q, k, v, do) = _inputs(d, BF16, gen)
        for causal in (False, True):
            o, lse = gh.forward(q, k, v, causal=causal)
            for step, what, spec in LADDER:
                if step == "fa2":
                    fn = lambda: fa2b.backward(do, q, k, v, o, lse, causal=causal)  # noqa: E731
                    cfg = "autotuned"
                elif step == "tma_one_pass":
                    fn = lambda: thb.backward(do, q, k, v, o, lse, causal=causal)  # noqa: E731
                    cfg = str(thb.config_for(d, causal))
                else:
                    kw = _ladder_kwargs(d, causal, spec)
                    fn = lambda kw=kw: gb.backward(do, q, k, v, o, lse, causal=causal, **kw)  # noqa: E731
                    cfg = {k_: str(v_) for k_, v_ in kw.items()}
                _add(
                    res,
                    "ladder",
                    step,
                    "bwd",
                    bench(fn),
                    shape,
                    d,
                    BF16,
                    causal,
                    what=what,
                    config=cfg,
                )


def check_auto(case, d, dtype, gen):
    """flashedu.attention(impl="auto") through autograd: o and the three gradients."""
    import flashedu

    B, H, Hk, Nq, Nk, causal = case
    q = rand((B, H, Nq, d), dtype, gen)
    k, v = rand((B, Hk, Nk, d), dtype, gen), rand((B, Hk, Nk, d), dtype, gen)
    do = rand((B, H, Nq, d), dtype, gen)
    ro, rl, rg = ref_grads(q, k, v, do, causal)
    sg = sdpa_grads(q, k, v, do, causal)
    qs, ks, vs = (x.clone().requires_grad_() for x in (q, k, v))
    o = flashedu.attention(qs, ks, vs, causal=causal)
    g = torch.autograd.grad(o, (qs, ks, vs), do)
    row = dict(variant="auto", case=list(case), d=d, dtype=DT[dtype])
    ok = True
    for gname, a, r, s_ in zip(("dq", "dk", "dv"), g, rg, sg):
        row[f"{gname}_err"], row[f"{gname}_sdpa_err"] = err(a, r), err(s_, r)
        ok = ok and bool(torch.isfinite(a).all())
        ok = ok and row[f"{gname}_err"] <= 2 * row[f"{gname}_sdpa_err"] + ulp(r, dtype)
    row["passed"] = bool(ok)
    return row


def phase_auto(res, gen):
    """flashedu.attention(impl="auto"), forward + backward through autograd: correct on the hard
    cases, then timed beside FLASH and cuDNN at N = 8192."""
    import flashedu

    for dtype in (BF16, FP16):
        for d in (128, 64):
            for case in (CASES[2], CASES[3], CASES[1], CASES[0]):
                try:
                    res["correctness"].append(check_auto(case, d, dtype, gen))
                except Exception:
                    tb = traceback.format_exc()[-800:]
                    row = dict(variant="auto", case=list(case), d=d, dtype=DT[dtype],
                               passed=False, error=tb)  # fmt: skip
                    res["correctness"].append(row)
                if not res["correctness"][-1]["passed"]:
                    print("FAILED", json.dumps(res["correctness"][-1])[:1500], flush=True)
    for dtype in (BF16, FP16):
        for d in (128, 64):
            shape, (q, k, v, do) = _inputs(d, dtype, gen)
            for causal in (False, True):
                qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))

                def fb():
                    o = flashedu.attention(qs, ks, vs, causal=causal)
                    return torch.autograd.grad(o, (qs, ks, vs), do)

                def fwd():
                    return flashedu.attention(q, k, v, causal=causal)

                _add(res, "auto", "flashedu_auto", "fwd", bench(fwd), shape, d, dtype, causal)
                _add(res, "auto", "flashedu_auto", "fwd_bwd", bench(fb), shape, d, dtype, causal)
                for name, be in (
                    ("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                    ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
                ):

                    def sf(be=be):
                        with sdpa_kernel([be]):
                            return torch.nn.functional.scaled_dot_product_attention(
                                q, k, v, is_causal=causal
                            )

                    _add(res, "auto", name, "fwd", bench(sf), shape, d, dtype, causal)
                    _add(res, "auto", name, "fwd_bwd", bench(sdpa_fb(be, q, k, v, do, causal)),
                         shape, d, dtype, causal)  # fmt: skip


def phase_headdims(res, gen):
    """flashedu.attention(impl="auto") at head dims outside 64/128 beside FLASH and cuDNN."""
    import flashedu

    for d in (96, 192, 256):
        shape = (4, 16, 4096)
        B, H, N = shape
        q, k, v, do = (rand((B, H, N, d), BF16, gen) for _ in range(4))
        for causal in (False, True):

            def fwd():
                return flashedu.attention(q, k, v, causal=causal)

            qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))

            def fb():
                o = flashedu.attention(qs, ks, vs, causal=causal)
                return torch.autograd.grad(o, (qs, ks, vs), do)

            _add(res, "headdims", "flashedu_auto", "fwd", bench(fwd), shape, d, BF16, causal)
            _add(res, "headdims", "flashedu_auto", "fwd_bwd", bench(fb), shape, d, BF16, causal)
            for name, be in (
                ("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
            ):

                def sf(be=be):
                    with sdpa_kernel([be]):
                        return torch.nn.functional.scaled_dot_product_attention(
                            q, k, v, is_causal=causal
                        )

                _add(res, "headdims", name, "fwd", bench(sf), shape, d, BF16, causal)
                _add(res, "headdims", name, "fwd_bwd", bench(sdpa_fb(be, q, k, v, do, causal)),
                     shape, d, BF16, causal)  # fmt: skip


WIDE = dict(
    fwd=[(64, 32, 4, 3), (64, 64, 4, 2), (128, 32, 8, 2), (64, 64, 8, 2), (128, 64, 8, 2)],
    dkdv=[(32, 64, 8, 2), (32, 32, 4, 2), (64, 64, 8, 1), (32, 64, 8, 1), (64, 32, 8, 2),
          (16, 64, 4, 2)],
    dq=[(32, 32, 4, 2), (64, 32, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2), (64, 32, 8, 2)],
)  # fmt: skip


def phase_wide(res, gen):
    """FA2 kernels at d = 192 and 256, bf16, non-causal: each kernel's candidate tiles timed alone
    (the other kernels at their table's first entry), each checked on a ragged causal case."""
    from flashedu.kernels import fwd as fa2
    from flashedu.kernels.launch import plan

    def cfg(t):
        return dict(BLOCK_M=t[0], BLOCK_N=t[1], num_warps=t[2], num_stages=t[3])

    for d in (192, 256):
        shape = (4, 16, 4096)
        B, H, N = shape
        q, k, v, do = (rand((B, H, N, d), BF16, gen) for _ in range(4))
        cq, ck, cv = rand((1, 4, 777, d), BF16, gen), rand((1, 2, 1301, d), BF16, gen), rand(
            (1, 2, 1301, d), BF16, gen)  # fmt: skip
        cdo = rand((1, 4, 777, d), BF16, gen)
        _, _, rg = ref_grads(cq, ck, cv, cdo, True)
        sg = sdpa_grads(cq, ck, cv, cdo, True)
        for kind, cands in WIDE.items():
            for t in cands:
                row = dict(kernel=kind, d=d, config=list(t))
                try:
                    if kind == "fwd":
                        fn = lambda t=t: fa2.forward(q, k, v, block_m=t[0], block_n=t[1],  # noqa: E731
                                                     num_warps=t[2], num_stages=t[3])  # fmt: skip
                        ro, rl, _ = ref_grads(cq, ck, cv, cdo, True)
                        co, _ = fa2.forward(cq, ck, cv, causal=True, block_m=t[0], block_n=t[1],
                                            num_warps=t[2], num_stages=t[3])  # fmt: skip
                        row["err"], row["ok"] = err(co, ro), True
                    else:
                        o, lse = fa2.forward(q, k, v)
                        pl = plan(q, k, v, False, None, None, None, None, "wide")
                        a = cfg(t) if kind == "dkdv" else cfg(WIDE["dkdv"][0])
                        b_ = cfg(t) if kind == "dq" else cfg(WIDE["dq"][0])
                        fn = lambda a=a, b_=b_, o=o, lse=lse, pl=pl: fa2b.run_backward(  # noqa: E731
                            do, q, k, v, o, lse, pl, a, b_, kernels=(kind,))  # fmt: skip
                        co, clse = fa2.forward(cq, ck, cv, causal=True)
                        cpl = plan(cq, ck, cv, True, None, None, None, None, "wide")
                        g = fa2b.run_backward(cdo, cq, ck, cv, co, clse, cpl, a, b_)
                        i = 0 if kind == "dq" else 1
                        row["err"], row["sdpa_err"] = err(g[i], rg[i]), err(sg[i], rg[i])
                        row["ok"] = row["err"] <= 2 * row["sdpa_err"] + ulp(rg[i], BF16)
                    row["ms"] = bench(fn)
                except Exception:
                    row["error"] = traceback.format_exc()[-600:]
                res["wide"].append(row)
                print("wide", json.dumps(row)[:300], flush=True)


PHASES = {
    "correct": phase_correct,
    "determinism": phase_determinism,
    "sweep": phase_sweep,
    "compare": phase_compare,
    "ladder": phase_ladder,
    "auto": phase_auto,
    "headdims": phase_headdims,
    "wide": phase_wide,
}
PHASES_RUN = []


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--phases", nargs="*", default=list(PHASES))
    ap.add_argument("--budget", type=float, default=480)
    a = ap.parse_args()
    PHASES_RUN.extend(a.phases)
    t0 = time.time()
    gen = torch.Generator(device="cuda")
    gen.manual_seed(time.time_ns() % 2**31)
    res = dict(
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        gpu=torch.cuda.get_device_name(),
        sms=torch.cuda.get_device_properties(0).multi_processor_count, torch=torch.__version__,
        triton=triton.__version__, cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
        python=platform.python_version(), command=" ".join(["python3"] + sys.argv[:1] + [
            x for x in sys.argv[1:]]),
        kv_configs={str(k_): v_ for k_, v_ in gb.KV_CONFIGS.items()},
        dq_configs={str(k_): v_ for k_, v_ in gb.DQ_CONFIGS.items()},
        smem_p={str(k_): v_ for k_, v_ in gb.SMEM_P.items()},
        correctness=[], determinism=[], sweep=[], rows=[], ladder=[], auto=[], headdims=[],
        wide=[], skipped=[],
        timings={},
    )  # fmt: skip
    mats = [rand((8192, 8192), BF16, gen) for _ in range(2)]
    res["matmul_bf16_tflops"] = 2 * 8192**3 * 1e-9 / bench(lambda: mats[0] @ mats[1])
    mats.clear()
    for key in a.phases:
        if time.time() - t0 > a.budget:
            res["skipped"].append(key)
            continue
        t1 = time.time()
        try:
            PHASES[key](res, gen)
        except Exception:
            res.setdefault("errors", {})[key] = traceback.format_exc()[-2000:]
            print("PHASE FAILED", key, res["errors"][key], flush=True)
        res["timings"][key] = round(time.time() - t1, 1)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    print("done in", round(time.time() - t0), "s; skipped:", res["skipped"], flush=True)


if __name__ == "__main__":
    main()
