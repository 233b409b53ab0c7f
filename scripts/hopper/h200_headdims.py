"""Head dims outside 64/128 on an H200: the FA2 kernels' launch configs, padded and in two chunks
(`flashedu.kernels.tiles.chunk_dims`: 192 = 128 + 64), with dK and dV in one launch and (above
width 128) in two (`launch.SEPARATE_DKDV_DIMS`), each checked and timed, then the best of each
beside `flashedu.attention(impl="auto")` as the library runs today and SDPA's FLASH and cuDNN
backends, all written to one JSON file.

Usage (repository root, on an sm_90 GPU):
    python3 scripts/hopper/h200_headdims.py --out RESULT.json [--dims 192 256 96 80 40 111]
        [--budget SECONDS] [--hard SECONDS] [--workers 12] [--no-split 40]
    python3 scripts/hopper/h200_headdims.py --out /tmp/x.json --smoke   (CPU: the script's logic)
First every kernel and config the run will launch is compiled in --workers processes (Triton's disk
cache; at most --warm seconds). Then the head dims run in the order given, each in two steps:
`sweep` (every candidate config of each kernel, timed alone at B = 4, H = 16, N = 4096 bf16,
non-causal and causal, in each of `modes(d)`) and `compare` (forward and forward + backward:
impl="auto"; the fastest correct configs of each mode; below 128, q, k and v zero-padded to the
Hopper kernels' width of 64 or 128 ("hopper_padded", the path `hopper.dispatch.pad_width` gives
impl="auto"); FLASH; cuDNN; bf16, and fp16 at d = 192). --no-split skips a head dim's two-chunk
mode (d = 40's stopped the process with an illegal memory access on the H200). The
JSON is rewritten after every step; no step starts after --budget seconds and no config or row after
--hard seconds, so the call ends inside 10 minutes and a run cut short keeps what it measured (what
it skipped is listed).

Correctness rule (as scripts/hopper/h200_backward.py): fresh random inputs for every check (a
ragged GQA case, 4 query heads over 2 K/V heads, 777 queries x 1301 keys, with the row's mask),
float64 autograd reference on the GPU, SDPA's output and gradients on the same inputs (explicit
bottom-right mask, K/V heads repeated); a kernel passes when its error on each output is at most
2x SDPA's plus one unit in the last place of the largest reference entry, and nothing is
non-finite. A config that fails is timed but never chosen.
FLOPs: `flashedu.traffic.attention_flops` (forward 4 B H d times the visible (query, key) pairs;
backward 2.5x, forward + backward 3.5x). Each kernel is timed with `triton.testing.do_bench`
(median), inputs drawn afresh for each head dim.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if "--smoke" in sys.argv:  # the interpreter must be on before triton decorates anything
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import triton
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashedu
from flashedu.kernels import bwd, fwd, launch
from flashedu.kernels.tiles import chunk_dims, pad_dim
from flashedu.traffic import attention_flops

BF16, FP16 = torch.bfloat16, torch.float16
DT = {BF16: "bf16", FP16: "fp16"}
SHAPE = (4, 16, 4096)  # B, H, N: the shape of the recorded headdims rows (h200_backward.json)
CHECK = (1, 4, 2, 777, 1301)  # B, H, H_kv, N_q, N_k
DEVICE = "cuda"
# (BLOCK_M, BLOCK_N, warps, stages) per kernel at d = 256 (padded tiles: the tables hold one
# entry there); every other width tries its tables' entries (`fwd.fwd_table`, `bwd.dkdv_table`,
# `bwd.dq_table`; the two-chunk widths were chosen from sm_90a compiles,
# scripts/hopper/compile_fa2.py). No spill, or the smallest; shared memory under 227 KB.
CANDIDATES = {
    256: dict(
        fwd=[(128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 4, 2)],
        dkdv=[(32, 64, 8, 2), (32, 64, 8, 1), (64, 64, 8, 1)],
        dq=[(128, 32, 8, 2), (128, 32, 8, 3), (128, 16, 8, 2)],
    ),
}


def candidates(width, d, sep=False):
    """The configs to try at a tile width: the list above, else the tables' own entries; only the
    tables' first entries for a padded head dim that also runs split (its padded tiles were swept
    in h200_backward.json's "wide" run). sep: dK/dV in two launches (`bwd.dkdv_parts_table`)."""
    table = dict(fwd=fwd.fwd_table(width, False), dkdv=bwd.dkdv_table(width, False),
                 dq=bwd.dq_table(width, False))  # fmt: skip
    if chunk_dims(d)[1] and width > sum(chunk_dims(d)):
        table = {kern: c[:1] for kern, c in table.items()}
    else:
        table = CANDIDATES.get(width, table)
    if sep:
        table = dict(table, dkdv=bwd.dkdv_parts_table(width, False))
    return table


def modes(d):
    """(split, separate) ways to run head dim d: padded and, where `chunk_dims` splits d, in two
    chunks; each with dK and dV in one launch and, above width 128, in two
    (`launch.SEPARATE_DKDV_DIMS`)."""
    out = []
    for sp in (False, True) if chunk_dims(d)[1] and d not in NO_SPLIT else (False,):
        width = sum(chunk_dims(d)) if sp else pad_dim(d)
        out += [(sp, sep) for sep in ((False, True) if width > 128 else (False,))]
    return out


NO_SPLIT: set[int] = set()  # --no-split: head dims whose two-chunk mode is not run


def hopper_width(d):
    """The Hopper width (64 or 128) that d pads to for the "hopper_padded" rows, or None."""
    return 64 if d < 64 else 128 if 64 < d < 128 else None


def _padded_hopper(q, k, v, causal):
    """`flashedu.attention(impl="hopper")` on q, k, v zero-padded to `hopper_width` (the path that
    impl="auto" takes for a head dim in `hopper.dispatch.PAD_HEAD_DIMS` or off a multiple of 8),
    o sliced back to d; differentiable."""
    d = q.shape[-1]
    w = hopper_width(d)
    qp, kp, vp = (torch.nn.functional.pad(x, (0, w - d)) for x in (q, k, v))
    o = flashedu.attention(qp, kp, vp, causal=causal, softmax_scale=d**-0.5, impl="hopper")
    return o[..., :d]


def check_padded_hopper(checker):
    """(ok, errors) of `_padded_hopper`'s o, dq, dk, dv on the checker's case, by its rule."""
    c = checker
    qs, ks, vs = (x.detach().clone().requires_grad_() for x in (c.q, c.k, c.v))
    o = _padded_hopper(qs, ks, vs, c.causal)
    outs = (o.detach(), *torch.autograd.grad(o, (qs, ks, vs), c.do))
    ok, errs = True, {}
    for n, a, r, sd in zip(("o", "dq", "dk", "dv"), outs, c.ref, c.sdpa_err):
        e = err(a, r)
        errs[n] = (e, sd)
        ok = ok and bool(torch.isfinite(a).all()) and e <= 2 * sd + ulp(r, c.dtype)
    return ok, errs


def variant(sp, sep):
    return ("fa2_split" if sp else "fa2_padded") + ("_sep" if sep else "")


class Deadline:
    """No new config or row once `hard` seconds have passed since the start."""

    start = time.time()
    hard = 540.0

    @classmethod
    def passed(cls):
        return time.time() - cls.start > cls.hard


@contextlib.contextmanager
def mode(d, sp, sep=False):
    """Run head dim d in two chunks (sp) or padded, its dK and dV in two launches (sep) or one,
    whatever the library's defaults."""
    old = launch.SPLIT_HEAD_DIMS, launch.SEPARATE_DKDV_DIMS
    launch.SPLIT_HEAD_DIMS = (old[0] | {d}) if sp else (old[0] - {d})
    launch.SEPARATE_DKDV_DIMS = (old[1] | {d}) if sep else (old[1] - {d})
    try:
        yield
    finally:
        launch.SPLIT_HEAD_DIMS, launch.SEPARATE_DKDV_DIMS = old


def cfg(t):
    return dict(BLOCK_M=t[0], BLOCK_N=t[1], num_warps=t[2], num_stages=t[3])


def rand(shape, dtype, gen):
    return torch.randn(shape, device=DEVICE, generator=gen).to(dtype)


def bench(fn):
    if DEVICE == "cpu":  # --smoke: one call, timed by the host clock (do_bench needs a GPU)
        t = time.perf_counter()
        try:
            fn()
        except RuntimeError as e:  # SDPA's FLASH and cuDNN backends do not run on a CPU
            print("smoke: not run:", str(e)[:80], flush=True)
            return float("nan")
        return (time.perf_counter() - t) * 1e3
    try:
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    except Exception as e:  # a config that fails to compile or launch is recorded, not fatal
        print("bench failed:", type(e).__name__, str(e)[:300], flush=True)
        return float("nan")


def mask_of(Nq, Nk):
    i = torch.arange(Nq, device=DEVICE)[:, None]
    return torch.arange(Nk, device=DEVICE)[None, :] <= i + Nk - Nq


def reference(q, k, v, do, causal):
    """float64 (o, dq, dk, dv) by autograd through the plain formulas."""
    G = q.shape[1] // k.shape[1]
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    s = q64 @ k64.repeat_interleave(G, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(~mask_of(q.shape[2], k.shape[2]), -math.inf)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    o = p @ v64.repeat_interleave(G, 1)
    o.backward(do.double())
    return o.detach(), q64.grad, k64.grad, v64.grad


def sdpa_same(q, k, v, do, causal):
    G = q.shape[1] // k.shape[1]
    qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))
    mask = mask_of(q.shape[2], k.shape[2]) if causal else None
    o = torch.nn.functional.scaled_dot_product_attention(
        qs, ks.repeat_interleave(G, 1), vs.repeat_interleave(G, 1), attn_mask=mask
    )
    o.backward(do)
    return o.detach(), qs.grad, ks.grad, vs.grad


def err(a, r):
    return (a.double() - r).abs().max().item()


def ulp(r, dtype):
    return r.abs().max().item() * (2.0**-8 if dtype == BF16 else 2.0**-11)


class Checker:
    """One ragged case per (d, causal, dtype) with its reference and SDPA's errors; `check`
    grades one kernel run on it."""

    def __init__(self, d, causal, dtype, gen):
        B, H, Hk, Nq, Nk = CHECK
        self.causal, self.dtype = causal, dtype
        self.q, self.do = rand((B, H, Nq, d), dtype, gen), rand((B, H, Nq, d), dtype, gen)
        self.k, self.v = rand((B, Hk, Nk, d), dtype, gen), rand((B, Hk, Nk, d), dtype, gen)
        self.ref = reference(self.q, self.k, self.v, self.do, causal)
        sd = sdpa_same(self.q, self.k, self.v, self.do, causal)
        self.sdpa_err = [err(s, r) for s, r in zip(sd, self.ref)]

    def check(self, kernel, fwd_cfg, dkdv_cfg, dq_cfg):
        """(ok, {name: (err, sdpa_err)}) for the outputs `kernel` makes ("fwd": o; "dkdv": dk,
        dv; "dq": dq; "all": every one)."""
        q, k, v, do = self.q, self.k, self.v, self.do
        o, lse = fwd.forward(q, k, v, causal=self.causal, **_kw(fwd_cfg))
        outs = {"o": o}
        if kernel != "fwd":
            pl = launch.plan(q, k, v, self.causal, None, None, None, None, "h200_headdims")
            dq, dk, dv = bwd.run_backward(do, q, k, v, o, lse, pl, cfg(dkdv_cfg), cfg(dq_cfg))
            outs.update(dq=dq, dk=dk, dv=dv)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        keep = {"fwd": ("o",), "dkdv": ("dk", "dv"), "dq": ("dq",), "all": ("o", "dq", "dk", "dv")}
        names = ("o", "dq", "dk", "dv")
        ok, errs = True, {}
        for n in keep[kernel]:
            i = names.index(n)
            e, s = err(outs[n], self.ref[i]), self.sdpa_err[i]
            fin = bool(torch.isfinite(outs[n]).all())
            errs[n] = (e, s)
            ok = ok and fin and e <= 2 * s + ulp(self.ref[i], self.dtype)
        return ok, errs


def _kw(t):
    return dict(block_m=t[0], block_n=t[1], num_warps=t[2], num_stages=t[3])


def tflops(d, causal, pass_, ms):
    B, H, N = SHAPE
    return attention_flops(B, H, N, N, d, causal=causal, pass_=pass_) / ms * 1e-9


def _time_config(res, checker, ctx, kern, use):
    """Check and time one kernel with the configs `use` (the others at their first entry); its
    row goes to res["sweep"]."""
    d, causal, sp, width, q, k, v, do, o, lse, pl = ctx
    t = use[kern]
    row = dict(d=d, causal=causal, split=sp, width=width, kernel=kern, config=list(t))
    try:
        row["ok"], row["errors"] = checker.check(kern, use["fwd"], use["dkdv"], use["dq"])
        if kern == "fwd":
            fn = lambda: fwd.forward(q, k, v, causal=causal, **_kw(t))
        else:
            fn = lambda: bwd.run_backward(do, q, k, v, o, lse, pl, cfg(use["dkdv"]),
                                          cfg(use["dq"]), kernels=(kern,))  # fmt: skip
        row["ms"] = bench(fn)
    except Exception:
        row["ok"], row["error"] = False, traceback.format_exc()[-600:]
    res["sweep"].append(row)
    ms = row.get("ms", float("nan"))
    print(f"sweep d={d} causal={causal!s:5} split={sp!s:5} {kern:4} {t} ok={row['ok']} "
          f"ms={ms:.3f}", flush=True)  # fmt: skip
    return row


def sweep(res, d, gen):
    """Each kernel's candidates alone, bf16, in each of `modes(d)`; the others at their list's
    first entry (two-launch dK/dV: that kernel only). The fastest correct config of each kernel
    goes to res["best"]."""
    B, H, N = SHAPE
    q, k, v, do = (rand((B, H, N, d), BF16, gen) for _ in range(4))
    for causal in (False, True):
        checker = Checker(d, causal, BF16, gen)
        for sp, sep in modes(d):
            with mode(d, sp, sep):
                pl = launch.plan(q, k, v, causal, None, None, None, None, "h200_headdims")
                width = launch.tile_width(pl.flags)
                cands = candidates(width, d, sep)
                first = {kern: c[0] for kern, c in cands.items()}
                o, lse = fwd.forward(q, k, v, causal=causal, **_kw(first["fwd"]))
                ctx = (d, causal, sp, width, q, k, v, do, o, lse, pl)
                fused = _best(res, d, causal, sp, False, whole=False) if sep else None
                best = {kn: (tuple(fused[kn]), fused["ms"][kn]) for kn in ("fwd", "dq")
                        if fused and kn in fused}  # fmt: skip
                for kern, configs in cands.items():
                    if sep and kern != "dkdv":
                        continue
                    for t in configs:
                        if Deadline.passed():
                            res["skipped"].append(f"sweep d={d} {causal} {sp} {sep} {kern} {t}")
                            continue
                        row = _time_config(res, checker, ctx, kern, dict(first, **{kern: t}))
                        row["separate"] = sep
                        ms = row.get("ms", float("nan"))
                        if row["ok"] and ms == ms and ms < best.get(kern, (None, math.inf))[1]:
                            best[kern] = (t, ms)
                res["best"].append(dict(d=d, causal=causal, split=sp, separate=sep, width=width,
                                        **{kn: list(b[0]) for kn, b in best.items()},
                                        ms={kn: b[1] for kn, b in best.items()}))  # fmt: skip


def _best(res, d, causal, sp, sep, whole=True):
    """The sweep's best configs for one mode; with whole, only if every kernel has one."""
    for b in res["best"]:
        if (b["d"], b["causal"], b["split"], b["separate"]) == (d, causal, sp, sep):
            return b if not whole or all(kn in b for kn in ("fwd", "dkdv", "dq")) else None
    return None


def _add(res, kernel, d, dtype, causal, pass_, fn, **extra):
    """Time fn and add its row (unless the hard deadline has passed)."""
    if Deadline.passed():
        res["skipped"].append(f"rows {kernel} {DT[dtype]} d={d} {causal} {pass_}")
        return
    ms = bench(fn)
    B, H, N = SHAPE
    tf = tflops(d, causal, pass_, ms)
    res["rows"].append(dict(kernel=kernel, dtype=DT[dtype], d=d, causal=causal, B=B, H=H, N=N,
                            **{"pass": pass_}, ms=ms, tflops=tf, **extra))  # fmt: skip
    print(f"rows  {kernel:16s} {DT[dtype]} d={d:3d} causal={causal!s:5} {pass_:7s} {ms:8.3f} ms "
          f"{tf:6.1f} TF/s", flush=True)  # fmt: skip


def compare(res, d, gen):
    """Forward and forward + backward: impl="auto" as the library stands, the sweep's best
    (padded, split), FLASH, cuDNN; bf16 (and fp16 at d = 192)."""
    B, H, N = SHAPE
    for dtype in (BF16, FP16) if d == 192 else (BF16,):
        q, k, v, do = (rand((B, H, N, d), dtype, gen) for _ in range(4))
        for causal in (False, True):
            qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))

            def auto_fb():
                o = flashedu.attention(qs, ks, vs, causal=causal)
                return torch.autograd.grad(o, (qs, ks, vs), do)

            _add(res, "flashedu_auto", d, dtype, causal, "fwd",
                 lambda: flashedu.attention(q, k, v, causal=causal))  # fmt: skip
            _add(res, "flashedu_auto", d, dtype, causal, "fwd_bwd", auto_fb)
            for sp, sep in modes(d):
                b = _best(res, d, causal, sp, sep)
                if b is None or Deadline.passed():
                    continue
                name = variant(sp, sep)
                with mode(d, sp, sep):
                    ok, errs = Checker(d, causal, dtype, gen).check("all", b["fwd"], b["dkdv"],
                                                                    b["dq"])  # fmt: skip
                    pl = launch.plan(q, k, v, causal, None, None, None, None, "h200_headdims")

                    def f(b=b):
                        return fwd.forward(q, k, v, causal=causal, **_kw(b["fwd"]))

                    def fb(b=b, pl=pl):
                        o, lse = f()
                        return bwd.run_backward(do, q, k, v, o, lse, pl, cfg(b["dkdv"]),
                                                cfg(b["dq"]))  # fmt: skip

                    extra = dict(configs={kn: b[kn] for kn in ("fwd", "dkdv", "dq")}, ok=ok,
                                 errors=errs)  # fmt: skip
                    _add(res, name, d, dtype, causal, "fwd", f, **extra)
                    _add(res, name, d, dtype, causal, "fwd_bwd", fb, **extra)
            if hopper_width(d) and not Deadline.passed():
                ok, errs = check_padded_hopper(Checker(d, causal, dtype, gen))
                qh, kh, vh = (x.detach().clone().requires_grad_() for x in (q, k, v))

                def hp_fb():
                    o = _padded_hopper(qh, kh, vh, causal)
                    return torch.autograd.grad(o, (qh, kh, vh), do)

                extra = dict(width=hopper_width(d), ok=ok, errors=errs)
                _add(res, "hopper_padded", d, dtype, causal, "fwd",
                     lambda: _padded_hopper(q, k, v, causal), **extra)  # fmt: skip
                _add(res, "hopper_padded", d, dtype, causal, "fwd_bwd", hp_fb, **extra)
            for name, be in (("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                             ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):  # fmt: skip

                def sf(be=be):
                    with sdpa_kernel([be]):
                        return torch.nn.functional.scaled_dot_product_attention(
                            q, k, v, is_causal=causal
                        )

                def sfb(be=be):
                    with sdpa_kernel([be]):
                        o = torch.nn.functional.scaled_dot_product_attention(
                            qs, ks, vs, is_causal=causal
                        )
                    return torch.autograd.grad(o, (qs, ks, vs), do)

                _add(res, name, d, dtype, causal, "fwd", sf)
                _add(res, name, d, dtype, causal, "fwd_bwd", sfb)


def _warm_job(job):
    """Compile one kernel with one config: launch it once on a small input whose strides have the
    same divisibility as the timed shape's (so Triton's disk cache serves the timed launch)."""
    d, causal, sp, sep, kern, t, dt = job
    dtype = BF16 if dt == "bf16" else FP16
    try:
        with mode(d, sp, sep):
            q, k, v, do = (torch.randn(1, 2, 256, d, device=DEVICE, dtype=dtype) for _ in range(4))
            first = candidates(launch.tile_width(_flags(q, causal)), d, sep)
            use = dict({kern_: c[0] for kern_, c in first.items()}, **{kern: t})
            o, lse = fwd.forward(q, k, v, causal=causal, **_kw(use["fwd"]))
            if kern != "fwd":
                pl = launch.plan(q, k, v, causal, None, None, None, None, "h200_headdims")
                bwd.run_backward(do, q, k, v, o, lse, pl, cfg(use["dkdv"]), cfg(use["dq"]),
                                 kernels=(kern,))  # fmt: skip
            if DEVICE == "cuda":
                torch.cuda.synchronize()
        return None
    except Exception as e:
        return f"{job}: {type(e).__name__}: {str(e)[:200]}"


def _flags(q, causal):
    return launch.plan(q, q, q, causal, None, None, None, None, "h200_headdims").flags


def warm(dims, workers, seconds):
    """Compile every (kernel, config) the sweep and the comparison can launch, in parallel."""
    import multiprocessing as mp

    jobs = []
    for d in dims:
        q = torch.empty(1, 1, 1, d, device=DEVICE, dtype=BF16)
        for causal in (False, True):
            for sp, sep in modes(d):
                with mode(d, sp, sep):
                    cands = candidates(launch.tile_width(_flags(q, causal)), d, sep)
                if sep:
                    cands = dict(dkdv=cands["dkdv"])
                for dt in ("bf16", "fp16") if d == 192 else ("bf16",):
                    jobs += [(d, causal, sp, sep, kern, t, dt)
                             for kern, c in cands.items() for t in c]  # fmt: skip
    t0, failed = time.time(), []
    with mp.get_context("spawn").Pool(workers) as pool:
        for i, r in enumerate(pool.imap_unordered(_warm_job, jobs)):
            failed += [r] if r else []
            if time.time() - t0 > seconds:
                failed.append(f"warm-up stopped after {i + 1} of {len(jobs)} compiles")
                break
    print(f"warm-up: {len(jobs)} compiles in {time.time() - t0:.0f} s, {len(failed)} failed",
          flush=True)  # fmt: skip
    return dict(jobs=len(jobs), seconds=time.time() - t0, failed=failed)


def summary(res):
    """One line per (dtype, d, causal, pass): the fastest flashedu row against FLASH and cuDNN."""
    rows = res["rows"]
    keys = sorted({(r["dtype"], r["d"], r["causal"], r["pass"]) for r in rows})
    names = ("flashedu_auto", "fa2_padded", "fa2_padded_sep", "fa2_split", "fa2_split_sep",
             "hopper_padded", "sdpa_flash", "sdpa_cudnn")  # fmt: skip
    print(f"{'case':28s}  auto   pad  pad2 split split2  hpad FLASH cuDNN   (TFLOP/s; 2: dK, dV "
          "apart; hpad: zero-padded to the Hopper kernels' width)")
    for key in keys:
        got = {r["kernel"]: r["tflops"] for r in rows
               if (r["dtype"], r["d"], r["causal"], r["pass"]) == key}  # fmt: skip
        cells = [got.get(n, float("nan")) for n in names]
        print(f"{str(key):28s} " + " ".join(f"{c:5.0f}" for c in cells), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dims", type=int, nargs="+", default=[192, 256, 96, 80, 40, 111])
    ap.add_argument("--budget", type=float, default=420, help="no step starts after this")
    ap.add_argument("--hard", type=float, default=540, help="no config or row starts after this")
    ap.add_argument("--workers", type=int, default=12, help="compile processes for the warm-up")
    ap.add_argument("--warm", type=float, default=180, help="warm-up stops after this")
    ap.add_argument("--no-split", type=int, nargs="*", default=[],
                    help="head dims whose two-chunk mode is skipped")  # fmt: skip
    smoke = "tiny shapes on CPU (interpreter): checks the script, times nothing"
    ap.add_argument("--smoke", action="store_true", help=smoke)
    a = ap.parse_args(argv)
    if a.smoke:
        global SHAPE, CHECK, DEVICE
        SHAPE, CHECK, DEVICE = (1, 2, 64), (1, 2, 1, 33, 47), "cpu"
    NO_SPLIT.update(a.no_split)
    t0 = Deadline.start = time.time()
    Deadline.hard = a.hard
    gen = torch.Generator(device=DEVICE)
    gen.manual_seed(time.time_ns() % 2**31)
    x = torch.randn(*(2 * [8192 if DEVICE == "cuda" else 64]), device=DEVICE, dtype=BF16)
    mm = 2 * x.shape[0] ** 3 / bench(lambda: x @ x) * 1e-9
    res = dict(
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        gpu=torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke)",
        torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
        cudnn=torch.backends.cudnn.version(), python=platform.python_version(),
        command="python3 " + " ".join(sys.argv), matmul_bf16_tflops=mm,
        split_head_dims_default=sorted(launch.SPLIT_HEAD_DIMS),
        separate_dkdv_dims_default=sorted(launch.SEPARATE_DKDV_DIMS),
        candidates={str(w): c for w, c in CANDIDATES.items()},
        sweep=[], best=[], rows=[], skipped=[],
    )  # fmt: skip
    print(f"bf16 matmul {mm:.0f} TFLOP/s", flush=True)
    if DEVICE == "cuda" and a.workers > 0:
        res["warm"] = warm(a.dims, a.workers, a.warm)
    for d in a.dims:
        for step in (sweep, compare):
            if time.time() - t0 > a.budget:
                res["skipped"].append(f"{step.__name__} d={d}")
                continue
            try:
                step(res, d, gen)
            except Exception:
                res.setdefault("errors", []).append(traceback.format_exc()[-1500:])
                print(res["errors"][-1], flush=True)
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)
    res["seconds"] = time.time() - t0
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    summary(res)


if __name__ == "__main__":
    main()
