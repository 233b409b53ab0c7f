"""Ring attention: the sequence sharded across processes, K/V shards passed around a ring.

W processes (ranks) each hold one contiguous shard of Q, K and V, in rank order. A query needs every
key, so the K/V shards travel: at step t, rank r computes its queries against the K/V shard it holds
while sending that shard on to rank r + 1 and receiving the next one from rank r - 1
(`torch.distributed` point-to-point, `batch_isend_irecv`). After W steps every rank has met every
shard, yet no rank ever held more than two K/V shards. Each step yields a partial softmax state
(m, l, o), and `softmax.merge` folds it into the running one, so the result is exact attention, not
an approximation (Liu, Zaharia and Abbeel 2023, "Ring Attention with Blockwise Transformers",
arXiv:2310.01889; the merge rule is the online softmax of Milakov and Gimelshein 2018,
arXiv:1805.02867).

* `forward(q, k, v, ...)` runs inside an initialised process group, on this rank's shards, and
  returns this rank's (o, lse); `record=[]` collects what it did at each step (which shard, computed
  or skipped, bytes).
* `backward(do, q, k, v, o, lse, ...)` is the ring backward: K/V travel again, with their dK/dV
  accumulators riding along, and come home after W hops.
* `run(world_size, q, k, v, ...)` launches real processes with `torch.multiprocessing` on 127.0.0.1
  and a free port, gives each its shards and returns the gathered output and the record
  (`RingResult`).

Backends: gloo on CPU processes, NCCL with one GPU per process (`run(..., backend="nccl",
device="cuda")`, NVLink multicast kept off with NCCL_NVLS_ENABLE=0). The code path is the same; only
the device differs.

Limits: each step computes its block in plain PyTorch ops (the teaching point is the ring, not the
kernel), and the running state is merged on the host by `softmax.merge` itself, so with NCCL every
step copies one block's (m, l, o) from the GPU; a production version runs a FlashAttention kernel
per block and keeps the state on the device. The forward overlaps each transfer with the block's
compute (non-blocking sends); the backward sends after computing. From a script, call `run` under
`if __name__ == "__main__":` (processes are spawned). With a causal mask the work is unbalanced:
with equal shards rank r computes r + 1 blocks and skips the rest; striped or zigzag layouts even it
out (Brandon et al. 2023, arXiv:2311.09431).

Introduced in notebooks/09_beyond.ipynb.
"""

from __future__ import annotations

import math
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import softmax
from .dtypes import acc_dtype
from .masks import PARTIAL, SKIP, block_kind, block_visible, key_offsets
from .validation import (
    check_backward,
    check_causal,
    check_do,
    check_qkv,
    check_slopes,
    check_window,
    resolve_scale,
)


def shard_bounds(N: int, world_size: int) -> list[tuple[int, int]]:
    """Contiguous shards of N rows over `world_size` ranks; the first N % world_size get one row
    more."""
    if world_size < 1 or N < world_size:
        raise ValueError(
            f"ring: a sequence of N={N} rows cannot give each of "
            f"world_size={world_size} ranks a row"
        )
    base, extra = divmod(N, world_size)
    starts = np.cumsum([0] + [base + (r < extra) for r in range(world_size)])
    return [(int(starts[r]), int(starts[r + 1])) for r in range(world_size)]


def traffic_per_step(
    B: int, H_kv: int, N_k: int, d: int, world_size: int, itemsize: int
) -> list[int]:
    """Bytes sent over all ring links at each forward step: every K and V shard moves one hop,
    except at the last step. 2 B H_kv N_k d itemsize per hop, whatever the shard sizes; GQA divides
    it by H / H_kv."""
    return [2 * B * H_kv * N_k * d * itemsize] * (world_size - 1) + [0]


@dataclass(frozen=True)
class _Block:
    """One (query shard x key shard) block, in the full sequence's coordinates."""

    rows: tuple[int, int]
    cols: tuple[int, int]
    N_q: int
    N_k: int
    scale: float
    causal: bool
    window_size: tuple[int, int] | None
    alibi_slopes: torch.Tensor | None

    @property
    def kind(self) -> str:
        return block_kind(
            self.rows,
            self.cols,
            self.N_q,
            self.N_k,
            causal=self.causal,
            window_size=self.window_size,
        )

    def scores(self, q, k) -> torch.Tensor:
        """Scaled, biased, masked scores (B, H, n_q, n_k) in q's dtype."""
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # GQA: (B, H, n_k, d)
        s = torch.matmul(q, k.transpose(-1, -2)) * self.scale  # (B, H, n_q, n_k)
        if self.alibi_slopes is not None:
            off = torch.from_numpy(key_offsets(self.rows, self.cols, self.N_q, self.N_k)).to(
                s.device
            )
            s = s - self.alibi_slopes[:, None, None] * off.abs().to(s.dtype)
        if self.kind == PARTIAL:
            keep = block_visible(
                self.rows,
                self.cols,
                self.N_q,
                self.N_k,
                causal=self.causal,
                window_size=self.window_size,
            )
            s = s.masked_fill(~torch.from_numpy(keep).to(s.device), -math.inf)
        return s

    def state(self, q, k, v) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Partial softmax state (m, l, o) of this block, on the host for `softmax.merge`; o
        unnormalised."""
        s = self.scores(q, k)
        m = s.amax(dim=-1)  # (B, H, n_q), -inf if nothing visible
        p = torch.exp(s - torch.where(torch.isfinite(m), m, 0.0)[..., None])
        o = torch.matmul(p, v.repeat_interleave(q.shape[1] // v.shape[1], dim=1))  # (B, H, n_q, d)
        return tuple(
            t.cpu().numpy() for t in (m, p.sum(dim=-1), o)
        )  # HBM -> host: (B, H, n_q, d + 2)

    def grads(self, q, k, v, do, lse, D):
        """This block's share of (dq, dk, dv), P recomputed from the saved lse
        (Dao 2023, Alg. 2)."""
        B, H, H_kv, n_k, d = q.shape[0], q.shape[1], k.shape[1], k.shape[2], k.shape[3]
        p = torch.exp(
            self.scores(q, k) - torch.where(torch.isfinite(lse), lse, math.inf)[..., None]
        )
        k, v = (x.repeat_interleave(H // H_kv, dim=1) for x in (k, v))  # GQA: (B, H, n_k, d)
        ds = p * (
            torch.matmul(do, v.transpose(-1, -2)) - D[..., None]
        )  # dS = P * (dO V^T - D), (B, H, n_q, n_k)
        dv = torch.matmul(p.transpose(-1, -2), do)  # dV = P^T dO           (B, H, n_k, d)
        dk = (
            torch.matmul(ds.transpose(-1, -2), q) * self.scale
        )  # dK = scale dS^T Q     (B, H, n_k, d)
        dq = torch.matmul(ds, k) * self.scale  # dQ = scale dS K       (B, H, n_q, d)
        return dq, *(g.reshape(B, H_kv, H // H_kv, n_k, d).sum(dim=2) for g in (dk, dv))


class _Ring:
    """This rank's view of the sharded sequence: every shard's bounds and the block for each K/V
    shard."""

    def __init__(self, q, k, v, causal, softmax_scale, window_size, alibi_slopes, name):
        B, H, H_kv, n_q, n_k, d = check_qkv(q, k, v, name=name, kind="torch")
        if not dist.is_initialized():
            raise RuntimeError(
                f"{name}: call inside an initialised torch.distributed process group (see ring.run)"
            )
        self.rank, self.W, self.acc = dist.get_rank(), dist.get_world_size(), acc_dtype(q.dtype)
        self.scale = resolve_scale(softmax_scale, d, name=name)
        self.window_size = check_window(window_size, name=name)
        self.causal = check_causal(causal, name=name)
        self.alibi = None
        if check_slopes(alibi_slopes, H, name=name) is not None:
            self.alibi = torch.as_tensor(np.asarray(alibi_slopes), device=q.device).to(self.acc)
        sizes = torch.tensor([n_q, n_k], dtype=torch.int64, device=q.device)
        everyone = [torch.empty_like(sizes) for _ in range(self.W)]
        dist.all_gather(everyone, sizes)  # every shard's size, in rank order
        n = torch.stack(everyone).cpu().numpy()  # (W, 2)
        ends = np.cumsum(n, axis=0)
        self.q_bounds = [(int(e - c), int(e)) for c, e in zip(n[:, 0], ends[:, 0])]
        self.k_bounds = [(int(e - c), int(e)) for c, e in zip(n[:, 1], ends[:, 1])]

    def block(self, src: int) -> _Block:
        """Our queries against the K/V shard that started on rank `src`."""
        return _Block(
            self.q_bounds[self.rank],
            self.k_bounds[src],
            self.q_bounds[-1][1],
            self.k_bounds[-1][1],
            self.scale,
            self.causal,
            self.window_size,
            self.alibi,
        )

    def held(self, step: int) -> int:
        """Which rank's K/V shard we hold at `step`: shards move one rank forward per step."""
        return (self.rank - step) % self.W

    def rows(self, src: int) -> int:
        return self.k_bounds[src][1] - self.k_bounds[src][0]

    def pass_on(self, payloads: list[torch.Tensor], incoming_rows: int):
        """Post one hop: send each payload to rank + 1 and receive the like-shaped one from
        rank - 1."""
        incoming = [
            torch.empty((*p.shape[:-2], incoming_rows, p.shape[-1]), dtype=p.dtype, device=p.device)
            for p in payloads
        ]
        ops = [dist.P2POp(dist.isend, p, (self.rank + 1) % self.W) for p in payloads]
        ops += [dist.P2POp(dist.irecv, t, (self.rank - 1) % self.W) for t in incoming]
        return incoming, dist.batch_isend_irecv(ops)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size=None,
    alibi_slopes=None,
    record: list | None = None,
):
    """This rank's share of exact attention over the whole (sharded) sequence.

    Args:
        q: (B, H, n_q, d) this rank's query rows; k, v: (B, H_kv, n_k, d) its key/value rows. Shards
            are contiguous and in rank order (rank 0 holds the first rows); their sizes may differ
            (>= 1).
        causal, softmax_scale, window_size, alibi_slopes: as in `reference.forward`, for positions
            in the full sequence (bottom-right alignment over the full N_q and N_k).
        record: a list that receives one dict per step: step, rank, kv_shard, kind ("full",
            "partial" or "skip"), sent_bytes, recv_bytes (of the tensors actually sent and
            received).
    Returns:
        o (B, H, n_q, d) in q's dtype and lse (B, H, n_q) float32 (float64 for float64) for this
        rank's rows.
    """
    ring = _Ring(q, k, v, causal, softmax_scale, window_size, alibi_slopes, "ring.forward")
    B, H, n_q, d = q.shape
    acc = ring.acc
    np_acc = np.float64 if acc == torch.float64 else np.float32
    state = (
        np.full((B, H, n_q), -np.inf, np_acc),
        np.zeros((B, H, n_q), np_acc),
        np.zeros((B, H, n_q, d), np_acc),
    )
    kv = [k, v]  # travels in the input dtype
    for step in range(ring.W):
        src, hop = ring.held(step), step < ring.W - 1
        if hop:  # the transfer runs while this block computes
            incoming, works = ring.pass_on(kv, ring.rows(ring.held(step + 1)))
        block = ring.block(src)
        if block.kind != SKIP:  # a skipped block is passed on, never computed
            state = softmax.merge(state, block.state(q.to(acc), kv[0].to(acc), kv[1].to(acc)))
        if record is not None:
            record.append(
                dict(
                    step=step,
                    rank=ring.rank,
                    kv_shard=src,
                    kind=block.kind,
                    sent_bytes=_nbytes(kv) if hop else 0,
                    recv_bytes=_nbytes(incoming) if hop else 0,
                )
            )
        if hop:
            for w in works:
                w.wait()
            kv = incoming
    o, lse = softmax.finalize(*state)
    return torch.from_numpy(o).to(q.device, q.dtype), torch.from_numpy(lse).to(q.device)


def backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size=None,
    alibi_slopes=None,
    record: list | None = None,
):
    """Gradients for this rank's shards: dq (B, H, n_q, d) and dk, dv (B, H_kv, n_k, d), in q's
    dtype.

    K and V go round the ring as in `forward`, each shard with its dK and dV accumulators (float32,
    float64 for float64): every rank adds its queries' share, and a last hop brings each accumulator
    home to the rank that owns the shard. dq stays put. Same arguments as `forward`, plus do, and o
    and lse from `forward`.
    """
    ring = _Ring(q, k, v, causal, softmax_scale, window_size, alibi_slopes, "ring.backward")
    check_backward(do, o, lse, q, name="ring.backward", kind="torch")
    acc = ring.acc
    q_a, do_a, lse_a = q.to(acc), do.to(acc), lse.to(acc)
    D = (do_a * o.to(acc)).sum(dim=-1)  # D = rowsum(dO * O), (B, H, n_q)
    dq = torch.zeros_like(q_a)
    kv, dkv = [k, v], [torch.zeros(k.shape, dtype=acc, device=k.device) for _ in range(2)]
    for step in range(ring.W):
        src, last = ring.held(step), step == ring.W - 1
        block = ring.block(src)
        if block.kind != SKIP:
            g_q, g_k, g_v = block.grads(q_a, kv[0].to(acc), kv[1].to(acc), do_a, lse_a, D)
            dq += g_q
            dkv = [dkv[0] + g_k, dkv[1] + g_v]
        payload = dkv if last else kv + dkv  # after the last step only the accumulators go home
        incoming, works = ring.pass_on(payload, ring.rows(ring.held(step + 1)))
        if record is not None:
            record.append(
                dict(
                    step=step,
                    rank=ring.rank,
                    kv_shard=src,
                    kind=block.kind,
                    sent_bytes=_nbytes(payload),
                    recv_bytes=_nbytes(incoming),
                )
            )
        for w in works:
            w.wait()
        kv, dkv = (kv, incoming) if last else (incoming[:2], incoming[2:])
    return dq.to(q.dtype), dkv[0].to(q.dtype), dkv[1].to(q.dtype)


# ----------------------------------------------------------------------------------------- launcher


@dataclass
class RingResult:
    """What `run` gathered from the ranks: outputs in the input's kind and dtype, and every rank's
    record."""

    o: object
    lse: object
    records: list  # records[rank][step]: dicts from `forward(..., record=...)`
    dq: object = None
    dk: object = None
    dv: object = None
    backward_records: list | None = None

    @property
    def world_size(self) -> int:
        return len(self.records)

    def _table(self, key: str) -> np.ndarray:
        return np.array(
            [[rec[t][key] for rec in self.records] for t in range(len(self.records[0]))]
        )

    @property
    def schedule(self) -> np.ndarray:
        """(steps, ranks): which rank's K/V shard each rank holds at each step."""
        return self._table("kv_shard")

    @property
    def kinds(self) -> np.ndarray:
        """(steps, ranks): "full", "partial" or "skip" for the block each rank met at each step."""
        return self._table("kind")

    @property
    def bytes_per_step(self) -> np.ndarray:
        """(steps,): bytes sent over all ring links at each forward step, as measured on the sent
        tensors."""
        return self._table("sent_bytes").sum(axis=1)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pack(x):
    """(float64-or-narrower NumPy array, dtype name) for the trip to a worker; bfloat16 travels as
    float32."""
    if x is None:
        return None
    if hasattr(x, "detach"):
        name = str(x.dtype).split(".")[-1]
        return (
            x.detach().cpu().float().numpy() if name == "bfloat16" else x.detach().cpu().numpy(),
            name,
        )
    return np.asarray(x), np.asarray(x).dtype.name


def _solve(problem: dict, rank: int, W: int, device) -> dict:
    """Run one problem on this rank: cut out our shards, forward (and backward), return host
    arrays."""

    def shard(name):
        a, dtype = problem[name]
        r0, r1 = shard_bounds(a.shape[2], W)[rank]
        return torch.from_numpy(np.ascontiguousarray(a[:, :, r0:r1])).to(
            device, getattr(torch, dtype)
        )

    q, k, v, kw = shard("q"), shard("k"), shard("v"), problem["kwargs"]
    out = {"records": []}
    o, lse = forward(q, k, v, record=out["records"], **kw)
    if problem["do"] is not None:
        out["backward_records"] = []
        out["dq"], out["dk"], out["dv"] = backward(
            shard("do"), q, k, v, o, lse, record=out["backward_records"], **kw
        )
    out.update(o=o, lse=lse)
    return {
        key: val.double().cpu().numpy() if torch.is_tensor(val) else val for key, val in out.items()
    }


def _worker(
    rank: int, world_size: int, port: int, backend: str, device: str, problems: list, queue
) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # no NVLink multicast (NVLS) for NCCL
    dev = torch.device(device) if device == "cpu" else torch.device(device, rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=120),
        device_id=dev if dev.type == "cuda" else None,
    )
    try:
        queue.put((rank, [_solve(p, rank, world_size, dev) for p in problems]))
    finally:
        dist.destroy_process_group()


def _check_launch(world_size, backend, device, problems) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"ring.run: world_size must be a positive int, got {world_size!r}")
    if (
        backend not in ("gloo", "nccl")
        or device not in ("cpu", "cuda")
        or (backend == "nccl") != (device == "cuda")
    ):
        raise ValueError(
            f"ring.run: use backend='gloo' with device='cpu' or backend='nccl' with device='cuda', "
            f"got backend={backend!r}, device={device!r}"
        )
    if device == "cuda" and torch.cuda.device_count() < world_size:
        raise ValueError(
            f"ring.run: world_size={world_size} needs one GPU per process, "
            f"found {torch.cuda.device_count()}"
        )
    for p in problems:
        B, H, H_kv, N_q, N_k, d = check_qkv(p["q"], p["k"], p["v"], name="ring.run")
        shard_bounds(N_q, world_size), shard_bounds(N_k, world_size)
        resolve_scale(p["kwargs"].get("softmax_scale"), d, name="ring.run")
        check_window(p["kwargs"].get("window_size"), name="ring.run")
        check_slopes(p["kwargs"].get("alibi_slopes"), H, name="ring.run")
        if p.get("do") is not None:
            check_do(p["do"], p["q"], name="ring.run")


def _gather(outs: list, template, key: str, axis: int = 2):
    """Concatenate one output over the ranks and give it the input's kind and dtype."""
    full = np.concatenate([out[key] for out in outs], axis=axis)
    if hasattr(template, "detach"):
        dtype = template.dtype if key != "lse" else acc_dtype(template.dtype)
        return torch.from_numpy(full).to(dtype)
    dtype = (
        template.dtype
        if key != "lse"
        else (np.float64 if template.dtype == np.float64 else np.float32)
    )
    return full.astype(dtype)


def run(
    world_size: int,
    q,
    k,
    v,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size=None,
    alibi_slopes=None,
    do=None,
    backend: str = "gloo",
    device: str = "cpu",
    timeout: float = 120.0,
) -> RingResult:
    """Ring attention for real: `world_size` processes on this machine, one shard of the sequence
    each.

    q (B, H, N_q, d), k, v (B, H_kv, N_k, d) and the optional do (B, H, N_q, d, which adds the
    backward pass) are full NumPy arrays or CPU tensors; rank r gets rows
    `shard_bounds(N, world_size)[r]` of each. backend="gloo", device="cpu" runs CPU processes;
    backend="nccl", device="cuda" one process per GPU.
    Returns a RingResult: o, lse (and dq, dk, dv) as if computed in one piece, plus what each rank
    did at each step and the bytes it sent (`.schedule`, `.kinds`, `.bytes_per_step`).
    """
    problem = dict(
        q=q,
        k=k,
        v=v,
        do=do,
        kwargs=dict(
            causal=causal,
            softmax_scale=softmax_scale,
            window_size=window_size,
            alibi_slopes=alibi_slopes,
        ),
    )
    return run_many(world_size, [problem], backend=backend, device=device, timeout=timeout)[0]


def run_many(
    world_size: int,
    problems: list[dict],
    *,
    backend: str = "gloo",
    device: str = "cpu",
    timeout: float = 120.0,
) -> list[RingResult]:
    """Like `run`, for several problems (dicts with q, k, v, optional do, and kwargs for `forward`)
    in one launch of the processes, which is what costs time on a CPU."""
    problems = [{"do": None, "kwargs": {}, **p} for p in problems]
    _check_launch(world_size, backend, device, problems)
    payload = [
        dict(
            q=_pack(p["q"]),
            k=_pack(p["k"]),
            v=_pack(p["v"]),
            do=_pack(p["do"]),
            kwargs={
                key: (None if val is None else np.asarray(val)) if key == "alibi_slopes" else val
                for key, val in p["kwargs"].items()
            },
        )
        for p in problems
    ]
    queue = mp.get_context("spawn").SimpleQueue()
    procs = mp.start_processes(
        _worker,
        args=(world_size, _free_port(), backend, device, payload, queue),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    results, deadline = {}, time.monotonic() + timeout
    try:
        done = False
        while not done:
            done = procs.join(timeout=0.05)  # raises if a rank failed, with its traceback
            while not queue.empty():
                rank, out = queue.get()
                results[rank] = out
            if not done and time.monotonic() > deadline:
                raise TimeoutError(
                    f"ring.run: the {world_size} processes did not finish within {timeout} s"
                )
    finally:
        for proc in procs.processes:
            if proc.is_alive():
                proc.terminate()
    missing = sorted(set(range(world_size)) - set(results))
    if missing:
        raise RuntimeError(
            f"ring.run: rank(s) {missing} exited without a result (from a script, call ring.run "
            f"under `if __name__ == '__main__':`, as multiprocessing's spawn requires)"
        )
    return [_result([results[r][i] for r in range(world_size)], p) for i, p in enumerate(problems)]


def _result(outs: list, problem: dict) -> RingResult:
    res = RingResult(
        _gather(outs, problem["q"], "o"),
        _gather(outs, problem["q"], "lse"),
        [out["records"] for out in outs],
    )
    if problem["do"] is not None:
        res.dq = _gather(outs, problem["q"], "dq")
        res.dk, res.dv = _gather(outs, problem["k"], "dk"), _gather(outs, problem["k"], "dv")
        res.backward_records = [out["backward_records"] for out in outs]
    return res
