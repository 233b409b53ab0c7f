"""Check, then time, on a CUDA GPU:
`PYTHONPATH=$PWD python -m flashedu.bench.gpu_check --out results.json`.

1. Correctness matrix on fresh random inputs: fp16, bf16, fp32 x d in {64, 128} (and 16, 32, 256) x
   causal x ragged N_q != N_k both ways (with fully masked rows) x GQA, MQA, sliding windows and
   ALiBi. The Triton kernels' forward (o) and backward (dq, dk, dv) are compared with a float64
   computation on the GPU, and PyTorch SDPA runs on the same inputs in the same dtype (see
   `sdpa_same_inputs` for which backend). A case passes when every element is within
   flashedu.testing's tolerance for its dtype, lse is within 1e-3 of float64, no NaN appears, and
   for fp16/bf16 the max error is at most twice SDPA's own plus 1e-6 (flash-attn's rule; fp32 rows
   record SDPA's error but are held to the tolerance table only). The matrix ends with the feature
   rows of `flashedu.bench.gpu_features`: head dims 40, 59, 80, 96, 111, 192, Ev != E, a score mod
   and packed sequences, against float64 and a same-precision PyTorch computation;
   `--features` runs those alone (no configs, timing or memory) in a few minutes.
2. The timing sweep of `flashedu.bench.gpu.run` (Triton against SDPA's FLASH, cuDNN and EFFICIENT
   backends).
3. Peak memory (torch.cuda.max_memory_allocated) against context length, 8k to 128k tokens,
   B = H = 1, d = 128, bf16: standard attention (S and P materialised) against the flashedu kernel.

Cases run in parallel worker processes (one GPU, several CUDA contexts), which also compiles the
kernels in parallel into triton's on-disk cache; the timing runs alone in the main process.
`--explore` also times fixed launch configs one by one (how the autotuning tables were chosen; see
notebooks/results/GPU_NOTES.md).

Introduced in notebooks/08_benchmarks.ipynb; the kernels in notebooks/06_triton_forward.ipynb.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import masks, reference
from ..testing import random_qkv, tolerance
from . import gpu, gpu_features
from .gpu import EXPLORE, explore, run_fixed
from .oracles import err as _err
from .oracles import float64_attention, within

DEVICE = (
    "cuda" if torch.cuda.is_available() else "cpu"
)  # "cpu" only for dry runs under the interpreter
CASE_KEYS = ("dtype", "d", "causal", "N_q", "N_k", "B", "H", "H_kv", "window", "alibi")
SHAPES = [(1000, 1000), (517, 1531), (1531, 517), (1, 777), (2048, 2048)]
EXTRAS = [
    dict(H=8, H_kv=2),
    dict(H=8, H_kv=1),
    dict(window=(256, 0), causal=True),
    dict(window=(100, 50)),
    dict(alibi=True),
    dict(alibi=True, causal=True, H=8, H_kv=2),
]


def matrix(quick: bool = False) -> list[dict]:
    """Every correctness case as a dict of CASE_KEYS."""
    base = dict(B=2, H=4, H_kv=4, window=None, alibi=False)
    cases = []
    for dtype in ("float16", "bfloat16", "float32"):
        for d in (64, 128):
            for causal in (False, True):
                for N_q, N_k in SHAPES[:2] if quick else SHAPES:
                    cases.append(dict(base, dtype=dtype, d=d, causal=causal, N_q=N_q, N_k=N_k))
    for dtype in ("float16", "bfloat16"):
        for d in (16, 32, 256):
            for causal in (False, True):
                cases.append(dict(base, dtype=dtype, d=d, causal=causal, N_q=300, N_k=433))
        for extra in EXTRAS[:2] if quick else EXTRAS:
            cases.append(
                {
                    **base,
                    "dtype": dtype,
                    "d": 128,
                    "causal": False,
                    "N_q": 900,
                    "N_k": 1300,
                    **extra,
                }
            )
    return cases + gpu_features.feature_cases(quick)


def sdpa_same_inputs(q, k, v, do, *, causal, window, slopes, scale):
    """PyTorch SDPA on the same inputs in their dtype: (backend, o, dq, dk, dv), NaN of empty rows
    set to 0.

    Plain attention takes SDPA's default dispatch (FLASH for fp16/bf16). A mask or bias
    (bottom-right causal with N_q != N_k, windows, ALiBi) goes to the EFFICIENT backend with K/V
    heads repeated for GQA: the default would fall back to the MATH backend, which computes in fp32
    internally and is no same-precision kernel. The bias is passed in the inputs' dtype, as SDPA
    requires."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    N_q, N_k, G = q.shape[2], k.shape[2], q.shape[1] // k.shape[1]
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    if window is None and slopes is None and (not causal or N_q == N_k):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=G > 1)
        backend = "default"
    else:
        keep = torch.from_numpy(masks.visible(N_q, N_k, causal=causal, window_size=window)).to(
            q.device
        )
        bias = torch.zeros(keep.shape, device=q.device, dtype=torch.float64)
        if slopes is not None:
            bias = torch.from_numpy(masks.alibi_bias(slopes, N_q, N_k)).to(
                q.device
            )  # (H, N_q, N_k)
        mask = (
            bias.masked_fill(~keep, float("-inf"))
            .to(q.dtype)
            .expand(q.shape[0], q.shape[1], N_q, N_k)
        )
        backend = "efficient" if q.is_cuda else "default"
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION) if q.is_cuda else contextlib.nullcontext():
            o = F.scaled_dot_product_attention(
                q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), attn_mask=mask, scale=scale
            )
    o.backward(do)
    return (backend, *(torch.nan_to_num(x.detach(), nan=0.0) for x in (o, q.grad, k.grad, v.grad)))


def check_case(case: dict) -> list[dict]:
    """Run one case (fresh inputs) through the Triton kernels, SDPA and float64; one row per
    pass."""
    from .. import kernels

    seed = int.from_bytes(os.urandom(4), "little")
    q, k, v = random_qkv(
        case["B"],
        case["H"],
        case["N_q"],
        case["N_k"],
        case["d"],
        case["dtype"],
        H_kv=case["H_kv"],
        seed=seed,
        kind="torch",
        device=DEVICE,
    )
    do = torch.randn(
        q.shape, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(seed)
    ).to(q.dtype)
    slopes = masks.alibi_slopes(case["H"]) if case["alibi"] else None
    opts = dict(
        causal=case["causal"], window=case["window"], slopes=slopes, scale=case["d"] ** -0.5
    )
    o, lse = kernels.forward(
        q, k, v, causal=case["causal"], window_size=case["window"], alibi_slopes=slopes
    )
    grads = kernels.backward(
        do, q, k, v, o, lse, causal=case["causal"], window_size=case["window"], alibi_slopes=slopes
    )
    ref = float64_attention(q, k, v, do, **opts)
    backend, *pt = sdpa_same_inputs(q, k, v, do, **opts)
    extra = " ".join(
        x
        for x in (
            f"gqa {case['H']}/{case['H_kv']}" if case["H"] != case["H_kv"] else "",
            f"window {case['window']}" if case["window"] else "",
            "alibi" if case["alibi"] else "",
        )
        if x
    )
    row = {
        "impl": "flashedu-triton",
        "dtype": case["dtype"],
        "d": case["d"],
        "causal": case["causal"],
        "N_q": case["N_q"],
        "N_k": case["N_k"],
        "B": case["B"],
        "H": case["H"],
        "H_kv": case["H_kv"],
        "extra": extra,
        "seed": seed,
        "sdpa_backend": backend,
    }
    fp32 = case["dtype"] == "float32"
    rule = lambda err, sdpa_err: fp32 or err <= 2 * sdpa_err + 1e-6
    lse_err = _err(lse, ref[1])
    fwd = {
        **row,
        "pass": "fwd",
        "err": _err(o, ref[0]),
        "sdpa_err": _err(pt[0], ref[0]),
        "lse_err": lse_err,
        "within_tolerance": within(o, ref[0], case["dtype"], False),
    }
    fwd["ok"] = rule(fwd["err"], fwd["sdpa_err"]) and fwd["within_tolerance"] and lse_err <= 1e-3
    worst = max(
        zip(("dq", "dk", "dv"), grads, ref[2:], pt[1:]),
        key=lambda t: _err(t[1], t[2]) / (2 * _err(t[3], t[2]) + 1e-6),
    )
    bwd = {
        **row,
        "pass": "bwd",
        "err": _err(worst[1], worst[2]),
        "sdpa_err": _err(worst[3], worst[2]),
        "worst": worst[0],
        "within_tolerance": all(within(g, r, case["dtype"], True) for g, r in zip(grads, ref[2:])),
    }
    bwd["ok"] = rule(bwd["err"], bwd["sdpa_err"]) and bwd["within_tolerance"]
    return [fwd, bwd]


def _check_many(cases: list[dict]) -> list[dict]:
    rows = []
    for case in cases:
        try:  # the feature rows (any head dim, Ev != E, score mods, packed) carry a "kind"
            rows += gpu_features.check(case) if "kind" in case else check_case(case)
        except Exception as e:  # reported as a failing row, never hidden
            rows.append(
                {
                    **{k: case[k] for k in ("dtype", "d", "causal", "N_q", "N_k")},
                    "impl": "flashedu-triton",
                    "extra": "",
                    "pass": "fwd",
                    "err": float("inf"),
                    "sdpa_err": None,
                    "ok": False,
                    "error": f"{type(e).__name__}: {str(e)[:300]}",
                }
            )
    return rows


def config_jobs(explore_too: bool) -> list[tuple]:
    """(dtype, d, causal, kernel, config) for every config the autotuner may pick (fp16/bf16, d
    64/128), and with explore_too every config of EXPLORE (bf16)."""
    from ..kernels import bwd, fwd

    tables = {"fwd": fwd.fwd_table, "dkdv": bwd.dkdv_table, "dq": bwd.dq_table}
    jobs = {
        (dt, d, c, kern, tuple(cfg))
        for dt in ("bfloat16", "float16")
        for d in (64, 128)
        for c in (False, True)
        for kern, table in tables.items()
        for cfg in table(d, False)
    }
    if explore_too:
        jobs |= {
            ("bfloat16", d, c, kern, tuple(cfg))
            for (kern, d), cfgs in EXPLORE.items()
            for c in (False, True)
            for cfg in cfgs
        }
    return sorted(jobs)


def check_config(job: tuple) -> dict:
    """Compile one kernel with one fixed launch config (filling triton's on-disk cache) and check
    its output against float64 on a ragged input: the autotuner may pick any listed config, so each
    is checked."""
    dtype, d, causal, kernel, cfg = job
    q, k, v = random_qkv(1, 2048 // d // 4, 300, 300, d, dtype, seed=0, kind="torch", device=DEVICE)
    do = torch.randn_like(q)
    ref = float64_attention(q, k, v, do, causal=causal, window=None, slopes=None, scale=d**-0.5)
    o, lse = run_fixed("fwd", EXPLORE[("fwd", d)][0], q, k, v, do, None, None, causal)
    if kernel == "fwd":
        got, want = run_fixed("fwd", cfg, q, k, v, do, None, None, causal)[:1], ref[:1]
    else:
        dq, dk, dv = run_fixed(kernel, cfg, q, k, v, do, o, lse, causal)
        got, want = ((dk, dv), ref[3:]) if kernel == "dkdv" else ((dq,), ref[2:3])
    tol = tolerance(dtype, grad=kernel != "fwd")
    err = max(_err(g, w) for g, w in zip(got, want))
    scale = max(w.abs().max().item() for w in want)
    return {
        "kernel": kernel,
        "dtype": dtype,
        "d": d,
        "causal": causal,
        "config": list(cfg),
        "err": err,
        "ok": err <= tol.atol + tol.rtol * scale,
    }


def pool_map(fn, jobs, workers: int, log=print) -> list:
    ctx = mp.get_context("spawn")
    out = []
    with ctx.Pool(workers) as pool:
        for i, r in enumerate(pool.imap_unordered(fn, jobs)):
            out.append(r)
            if (i + 1) % max(len(jobs) // 8, 1) == 0:
                log(f"  {i + 1}/{len(jobs)} done", flush=True)
    return out


def self_check() -> float:
    """float64_attention against flashedu.reference on a small case; returns the max difference."""
    q, k, v = random_qkv(1, 4, 37, 50, 32, "float32", H_kv=2, seed=1, kind="torch", device=DEVICE)
    do = torch.randn_like(q)
    opts = dict(causal=True, window=(20, -1), slopes=masks.alibi_slopes(4), scale=0.3)
    mine = float64_attention(q, k, v, do, **opts)
    kw = dict(
        causal=True, window_size=(20, -1), alibi_slopes=masks.alibi_slopes(4), softmax_scale=0.3
    )
    ref = (*reference.forward(q, k, v, **kw), *reference.backward(do, q, k, v, **kw))
    return max(_err(m.cpu(), torch.from_numpy(r)) for m, r in zip(mine, ref))


def autotune_choices() -> list[dict]:
    """The config the autotuner kept for each kernel and key in this process."""
    from ..kernels import bwd, fwd

    rows = []
    for name, kern in (*fwd.AUTOTUNED.items(), *bwd.AUTOTUNED.items()):
        for key, cfg in getattr(kern, "cache", {}).items():
            rows.append(
                {
                    "kernel": name,
                    "key": [str(x) for x in key],
                    "config": [
                        cfg.kwargs["BLOCK_M"],
                        cfg.kwargs["BLOCK_N"],
                        cfg.num_warps,
                        cfg.num_stages,
                    ],
                }
            )
    return rows


def check_everything(
    workers: int, quick: bool, explore_too: bool, log=print
) -> tuple[list[dict], list[dict]]:
    """Every launch config, then the correctness matrix, in `workers` processes: (config rows, case
    rows)."""
    t0 = time.time()
    log(f"float64 oracle on the GPU vs flashedu.reference: max diff {self_check():.1e}")
    jobs = config_jobs(explore_too)
    log(f"compiling and checking {len(jobs)} (kernel, launch config) pairs in {workers} processes")
    configs = pool_map(check_config, jobs, workers, log)
    cases = matrix(quick)
    log(f"[{time.time() - t0:.0f}s] correctness: {len(cases)} cases")
    chunks = [cases[i :: workers * 2] for i in range(workers * 2)]
    correctness = [r for rows in pool_map(_check_many, chunks, workers, log) for r in rows]
    log(
        f"[{time.time() - t0:.0f}s] configs: {sum(r['ok'] for r in configs)}/{len(configs)} pass; "
        f"correctness: {sum(r['ok'] for r in correctness)}/{len(correctness)} rows pass"
    )
    for r in configs + correctness:
        if not r["ok"]:
            log("  FAIL", json.dumps(r))
    return configs, correctness


def features_only(out: str, workers: int, quick: bool, argv, log=print) -> int:
    """`--features`: the rows of `gpu_features` alone, in `workers` processes, written to `out`."""
    t0 = time.time()
    log(f"float64 oracle on the GPU vs flashedu.reference: max diff {self_check():.1e}")
    cases = gpu_features.feature_cases(quick)
    log(f"feature rows: {len(cases)} cases in {workers} processes")
    chunks = [cases[i :: workers * 2] for i in range(workers * 2)]
    rows = [r for part in pool_map(_check_many, chunks, workers, log) for r in part]
    ok = all(r["ok"] for r in rows)
    for r in rows:
        if not r["ok"]:
            log("  FAIL", json.dumps(r))
    meta = {
        **gpu.versions(),
        "command": "python -m flashedu.bench.gpu_check " + " ".join(argv or sys.argv[1:]),
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({"meta": meta, "correctness": rows}, indent=1) + "\n")
    log(
        f"[{time.time() - t0:.0f}s] {sum(r['ok'] for r in rows)}/{len(rows)} rows pass; wrote {out}"
    )
    return 0 if ok else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m flashedu.bench.gpu_check", description=__doc__.splitlines()[0]
    )
    p.add_argument("--out", default="notebooks/results/h200_attention.json")
    p.add_argument("--quick", action="store_true", help="a smaller matrix and sweep")
    p.add_argument(
        "--explore", action="store_true", help="also time fixed launch configs one by one"
    )
    p.add_argument("--no-bench", action="store_true", help="correctness (and memory) only")
    p.add_argument(
        "--features",
        action="store_true",
        help="only the feature rows (head dims, Ev != E, score mod, packed sequences); no timing",
    )
    p.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1))
    a = p.parse_args(argv)
    if a.workers < 1:
        p.error(f"--workers must be >= 1, got {a.workers}")
    log = lambda *s, **kw: print(*s, **{"flush": True, **kw})
    if a.features:
        return features_only(a.out, a.workers, a.quick, argv, log)
    configs, correctness = check_everything(a.workers, a.quick, a.explore, log)
    ok = all(r["ok"] for r in configs + correctness)
    result = {
        "meta": {
            **gpu.versions(),
            "command": "python -m flashedu.bench.gpu_check " + " ".join(argv or sys.argv[1:]),
            "matmul_bf16_tflops": gpu.matmul_tflops(),
        },
        "correctness": correctness,
        "configs": configs,
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save = lambda: out.write_text(json.dumps(result, indent=1) + "\n")
    save()
    if a.explore:
        result["explore"] = explore(log=log)
        save()
    if not a.no_bench:
        bench = gpu.run(quick=a.quick, log=log)
        result["timing"], result["refused"] = bench["timing"], bench["refused"]
        result["meta"].update(sweep=bench["meta"]["sweep"], autotuned=autotune_choices())
        save()
        log(gpu.table(bench["timing"]))
    result["memory"] = gpu.measure_memory(log=log)
    save()
    log(f"wrote {a.out}; correctness {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
