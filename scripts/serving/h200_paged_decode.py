"""Paged split-KV decoding on an H200: correctness first, then decode steps at batch 1-64 and
contexts of 1k-128k keys, timed beside SDPA on the same keys held contiguously (and flash-attn's
`flash_attn_with_kvcache` when it imports), with the bytes each step must move and the fraction of
the HBM bandwidth measured in the same run.

Usage (repository root, on a CUDA GPU):
    python3 scripts/serving/h200_paged_decode.py --out notebooks/results/h200_paged_decode.json
        [--page-size 64] [--dtype float16] [--budget 330]
    python3 scripts/serving/h200_paged_decode.py --out /tmp/dry.json --dry-run   # CPU, interpreter

Order (llm.c's "validate, then benchmark"): the HBM bandwidth (a device-to-device copy of a 4 GiB
buffer: bytes read + written over the median time); correctness of `decoding.paged_forward` in
float16 and bfloat16 on fresh inputs (ragged lengths, scrambled tables, GQA, causal or not,
N_q 1 and 4, with and without sinks) against a float64 reference, each error at most twice SDPA's
on the same inputs plus one unit in the last place of the largest output (sinks, which SDPA cannot
take: the package's tolerance); nothing is timed if a case fails. Then every timed config: H = 32,
H_kv = 8, d = 128, N_q = 1, every sequence ctx keys long, the block table a random permutation of
the pool, validated once (`kernels.paged.plan` reads the table on the host) and the split and
combine kernels timed alone. GB/s is `traffic.paged_decode_bytes` (the bytes the kernels must move:
the whole cache once, the partial states, q, o) over the median time; SDPA's is the bytes of q, K,
V and o. On a GPU each step is also timed replayed from a CUDA graph (`ms_graph`, as a server runs
its decode step: no host launch overhead), SDPA's too, and the paged step again with twice the
programs per SM (`num_splits_x2`, `ms_graph_x2`; `kernels.paged.PROGRAMS_PER_SM` is the default).
A config whose tensors would not fit in 60 % of the GPU's memory is skipped and listed.
The JSON is rewritten after each phase; no timed config starts after --budget seconds. Sized to
finish within 6 minutes on an H200 (the first run took 27 s; notebooks/results/GPU_NOTES.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.nn.functional as F

import flashedu  # noqa: F401  (sets TRITON_INTERPRET=1 first when there is no GPU)

BATCHES = (1, 8, 64)
CONTEXTS = (1024, 8192, 32768, 131072)
H, H_KV, D = 32, 8, 128


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the JSON file to write")
    p.add_argument("--page-size", type=int, default=64, help="keys per page (default 64)")
    p.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    p.add_argument("--budget", type=float, default=330.0, help="seconds before no new config")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="the smallest case only, on CPU under the interpreter if there is no GPU",
    )
    return p.parse_args(argv)  # fmt: skip


def paged_inputs(B, lens, N_q, page_size, dtype, device, gen, sinks=False, H=H, H_kv=H_KV, d=D):
    """Fresh q, the contiguous K/V (B, H_kv, max_len, d) and the same keys scattered into a pool
    of pages through a scrambled block table."""
    longest = max(lens)
    pages = -(-longest // page_size)

    def rnd(*shape):  # drawn in the dtype itself: no float32 copy of a 17 GB cache
        return torch.randn(*shape, device=device, generator=gen, dtype=dtype)

    n = pages * page_size
    q, k, v = rnd(B, H, N_q, d), rnd(B, H_kv, n, d), rnd(B, H_kv, n, d)
    perm = torch.randperm(B * pages, device=device, generator=gen)
    table = perm.reshape(B, pages).to(torch.int32)
    k_cache, v_cache = (
        torch.empty(B * pages, page_size, H_kv, d, device=device, dtype=dtype) for _ in range(2)
    )
    for cache, x in ((k_cache, k), (v_cache, v)):
        cache[perm] = x.transpose(1, 2).reshape(B * pages, page_size, H_kv, d)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    s = torch.randn(H, device=device, generator=gen) if sinks else None
    return q, k, v, k_cache, v_cache, table, lens_t, s  # fmt: skip


def reference(q, k, v, lens, causal, sinks, dtype=torch.float64):
    """Per sequence: softmax over its first len keys (bottom-right causal) and the sink column,
    computed in `dtype`; a row that sees nothing is 0 (not NaN)."""
    outs = []
    N_q = q.shape[2]
    for b, n in enumerate(lens):
        qb, kb, vb = (x[b : b + 1].to(dtype) for x in (q, k[:, :, :n], v[:, :, :n]))
        kb, vb = (x.repeat_interleave(q.shape[1] // k.shape[1], 1) for x in (kb, vb))
        s = (qb @ kb.transpose(-1, -2)) / q.shape[-1] ** 0.5  # (1, H, N_q, n)
        if causal:
            cols, rows = torch.arange(n, device=q.device), torch.arange(N_q, device=q.device)
            s = s.masked_fill(cols[None] > rows[:, None] + n - N_q, float("-inf"))
        col = torch.full_like(s[..., :1], float("-inf"))
        if sinks is not None:
            col = sinks.to(dtype)[None, :, None, None].expand_as(col)
        s = torch.cat([s, col], -1)
        m = s.amax(-1, keepdim=True)
        p = torch.exp(s - torch.where(torch.isinf(m), 0.0, m))
        total = p.sum(-1, keepdim=True)
        outs.append(torch.where(total > 0, p[..., :-1] @ vb / total.clamp_min(1e-30), 0.0))
    return torch.cat(outs)


def sdpa_error(q, k, v, lens, causal, ref):
    """SDPA's max error on the same inputs in q's dtype (explicit bottom-right mask, GQA), over
    the rows that see a key."""
    worst = 0.0
    N_q = q.shape[2]
    for b, n in enumerate(lens):
        qb, kb, vb = (x[b : b + 1] for x in (q, k[:, :, :n], v[:, :, :n]))
        rows = torch.arange(N_q, device=q.device)[:, None]
        mask = torch.arange(n, device=q.device)[None] <= rows + (n - N_q if causal else n)
        o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, enable_gqa=True)
        seen = mask.any(-1)
        err = (o.double() - ref[b : b + 1]).abs()[:, :, seen]
        worst = max(worst, err.max().item() if err.numel() else 0.0)
    return worst


def correctness(dtype, device, gen, small):
    from flashedu import decoding
    from flashedu.testing import tolerance

    rows, page_size = [], 16 if small else 64
    lens_all = [[37, 1, 64]] if small else [[1000, 1, 4097], [64, 2048, 63, 777]]
    for lens in lens_all:
        for causal, N_q, sinks in ((False, 1, False), (True, 4, False), (True, 1, True)):
            h, h_kv, d = (4, 2, 16) if small else (H, H_KV, D)
            q, k, v, kc, vc, table, lens_t, s = paged_inputs(
                len(lens), lens, N_q, page_size, dtype, device, gen, sinks, h, h_kv, d
            )
            o, _ = decoding.paged_forward(q, kc, vc, table, lens_t, causal=causal, sinks=s)
            ref = reference(q, k, v, lens, causal, s)
            err = (o.double() - ref).abs().max().item()
            if s is None:
                sdpa = sdpa_error(q, k, v, lens, causal, ref)
                bound = 2 * sdpa + torch.finfo(dtype).eps * ref.abs().max().item()
            else:
                tol = tolerance(str(dtype).split(".")[-1])
                bound = tol.atol + tol.rtol * ref.abs().max().item()
            ok = bool(err <= bound and o.isfinite().all())
            rows.append(dict(dtype=str(dtype), lens=lens, N_q=N_q, causal=causal, sinks=sinks,
                             err=err, bound=bound, passed=ok))  # fmt: skip
            print(f"correct {rows[-1]}", flush=True)
    return rows


def timer(device):
    if device.type == "cuda":
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    def cpu(fn):  # the interpreter has no driver for do_bench: one warm call, then three
        fn()
        t = time.perf_counter()
        for _ in range(3):
            fn()
        return (time.perf_counter() - t) / 3 * 1e3

    return cpu


def PROGRAMS_PER_SM():  # noqa: N802  (the constant's name, read where the kernels are imported)
    from flashedu.kernels import paged

    return paged.PROGRAMS_PER_SM


def bench_graph(bench, fn):
    """fn captured once in a CUDA graph (after a warm call on a side stream), its replay timed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench(graph.replay)


def hbm_bandwidth(device, bench, small):
    n = (1 << 20) if small else (4 << 30)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return dict(bytes=2 * n, ms=ms, gbs=2 * n / ms / 1e6)


def flash_attn_fn():
    try:
        from flash_attn import flash_attn_with_kvcache  # type: ignore
    except Exception as e:  # not installed, or built for another torch
        return None, f"{type(e).__name__}: {e}"
    return flash_attn_with_kvcache, ""


def timed(cfg, dtype, device, gen, bench, bw, fa):
    from flashedu import traffic
    from flashedu.kernels import paged

    B, ctx, ps = cfg["B"], cfg["ctx"], cfg["page_size"]
    h, h_kv, d = (4, 2, 16) if device.type != "cuda" else (H, H_KV, D)
    q, k, v, kc, vc, table, lens, _ = paged_inputs(B, [ctx] * B, 1, ps, dtype, device, gen,
                                                   H=h, H_kv=h_kv, d=d)  # fmt: skip
    block_n = 64 if device.type == "cuda" and ps % 64 == 0 else 16
    splits = paged.auto_splits(B, h_kv, ctx, block_n, device)
    # validated once, outside the timed region (the check reads the table on the host), as a
    # server checks its block table when it changes; then the two kernels alone are timed
    plan = paged.plan(q, kc, vc, table, lens, False, None, None, splits, block_n, "benchmark")
    ms = bench(lambda: paged.combine(*paged.split_states(q, kc, vc, table, lens, plan),
                                     dtype=q.dtype))  # fmt: skip
    extra = {}
    if device.type == "cuda":
        # the same step replayed from a CUDA graph, as a server runs its decode step: the GPU's
        # time without the host's launch overhead
        extra["ms_graph"] = bench_graph(
            bench, lambda: paged.combine(*paged.split_states(q, kc, vc, table, lens, plan),
                                         dtype=q.dtype))  # fmt: skip
        # twice the programs per SM (paged.PROGRAMS_PER_SM is the default)
        more = paged.auto_splits(B, h_kv, ctx, block_n, device, 2 * paged.PROGRAMS_PER_SM)
        plan2 = paged.plan(q, kc, vc, table, lens, False, None, None, more, block_n, "benchmark")
        extra["num_splits_x2"] = more
        extra["ms_graph_x2"] = bench_graph(
            bench, lambda: paged.combine(*paged.split_states(q, kc, vc, table, lens, plan2),
                                         dtype=q.dtype))  # fmt: skip
    model = traffic.paged_decode_bytes([ctx] * B, H=h, H_kv=h_kv, N_q=1, d=d, block_n=block_n,
                                       num_splits=splits, itemsize=q.element_size())  # fmt: skip
    row = dict(cfg, H=h, H_kv=h_kv, d=d, num_splits=splits, block_n=block_n, ms=ms,
               tokens_per_s=B / (ms * 1e-3), bytes=model.total_bytes,
               gbs=model.total_bytes / ms / 1e6, **extra)  # fmt: skip
    row["frac_measured_hbm"] = row["gbs"] / bw["gbs"]
    if "ms_graph" in row:
        row["gbs_graph"] = model.total_bytes / row["ms_graph"] / 1e6
        row["frac_measured_hbm_graph"] = row["gbs_graph"] / bw["gbs"]
        model2 = traffic.paged_decode_bytes([ctx] * B, H=h, H_kv=h_kv, N_q=1, d=d,
                                            block_n=block_n, num_splits=row["num_splits_x2"],
                                            itemsize=q.element_size())  # fmt: skip
        row["gbs_graph_x2"] = model2.total_bytes / row["ms_graph_x2"] / 1e6
    row["frac_spec_hbm"] = row["gbs"] / 4800.0
    sdpa_bytes = (2 * q.numel() + k.numel() + v.numel()) * q.element_size()
    try:
        row["sdpa_ms"] = bench(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        row["sdpa_gbs"] = sdpa_bytes / row["sdpa_ms"] / 1e6
        if device.type == "cuda":
            row["sdpa_ms_graph"] = bench_graph(
                bench, lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            )
    except Exception as e:  # recorded, not fatal: the paged row stands on its own
        row["sdpa_error"] = f"{type(e).__name__}: {e}"[:300]
    if fa is not None and ps % 256 == 0:  # flash-attn's paged cache takes pages of 256k keys
        qf = q.transpose(1, 2).contiguous()  # flash-attn's (B, N, H, d)
        try:
            row["flash_attn_ms"] = bench(lambda: fa(qf, kc, vc, cache_seqlens=lens,
                                                    block_table=table))  # fmt: skip
        except Exception as e:
            row["flash_attn_error"] = f"{type(e).__name__}: {e}"[:300]
    return row


def main(argv=None) -> int:
    import triton

    args = parse(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    small = args.dry_run
    gen = torch.Generator(device=device).manual_seed(time.time_ns() % 2**31)
    dtype = getattr(torch, args.dtype)
    fa, fa_why = flash_attn_fn()
    res = dict(
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        gpu=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
        torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
        python=platform.python_version(), command=" ".join(["python3"] + sys.argv),
        dry_run=small, flash_attn=fa_why or "imported", programs_per_sm=PROGRAMS_PER_SM(),
        rows=[], skipped=[],
    )  # fmt: skip

    def save():
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    bench = timer(device)
    res["hbm"] = hbm_bandwidth(device, bench, small)
    print(f"HBM copy: {res['hbm']['gbs']:.0f} GB/s", flush=True)
    res["correctness"] = [r for dt in (torch.float16, torch.bfloat16)
                          for r in correctness(dt, device, gen, small)]  # fmt: skip
    save()
    if not all(r["passed"] for r in res["correctness"]):
        print("correctness failed: nothing timed", flush=True)
        return 1
    print("All results match. Starting benchmarks.", flush=True)
    start, total = time.time(), torch.cuda.mem_get_info()[1] if device.type == "cuda" else 0
    grid = [(1, 64)] if small else [(B, ctx) for B in BATCHES for ctx in CONTEXTS]
    for B, ctx in grid:
        cfg = dict(B=B, ctx=ctx, page_size=16 if small else args.page_size, dtype=args.dtype)
        need = 2 * 2 * B * ctx * H_KV * D * dtype.itemsize  # the pool and the contiguous copy
        if total and need > 0.6 * total:
            res["skipped"].append(dict(cfg, why=f"needs {need / 1e9:.0f} GB"))
            continue
        if time.time() - start > args.budget:
            res["skipped"].append(dict(cfg, why="past --budget"))
            continue
        row = timed(cfg, dtype, device, gen, bench, res["hbm"], fa)
        res["rows"].append(row)
        print(f"B={B:3d} ctx={ctx:6d} paged {row['ms']:.3f} ms {row['gbs']:7.0f} GB/s "
              f"({row['frac_measured_hbm']:.0%} of the copy) sdpa {row.get('sdpa_ms', -1):.3f} ms"
              + (f" | graph: paged {row['ms_graph']:.3f} ms {row['frac_measured_hbm_graph']:.0%}, "
                 f"x2 splits ({row['num_splits_x2']}) {row['ms_graph_x2']:.3f} ms, sdpa "
                 f"{row.get('sdpa_ms_graph', -1):.3f} ms" if "ms_graph" in row else ""),
              flush=True)  # fmt: skip
        save()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
