"""The bytes a FlashAttention-2 kernel may move, and what to say when a learner's kernel moves
others: the method check of the Triton graders.

`traffic.measure()` records every load and store of a kernel run under Triton's interpreter, by
argument tensor. Each budget here gives, per tensor and direction, the range of bytes the FA2
algorithm moves with the launch's block sizes: the upper end is the closed form of
`flashedu.traffic` (whole blocks; every block a row block can see, never one the causal mask hides
entirely), the lower end what is left when a kernel also masks the loads inside a block on the
causal diagonal, or skips loading Q for a query block that sees no key at all. That range is the
masked-edge tolerance, and it is all: a kernel that re-reads Q for every key block, stores O once
per key block, loads key blocks the causal mask hides, or writes S or P to HBM lands outside it
and is told so in bytes ("your kernel read Q 3 times (6,144 B of a 2,048 B tensor): once per key
block").

Used by `flashedu.checks._triton`; tested in tests/checks/test_ch06.py and test_ch07.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import traffic
from ..traffic.measured import UNKNOWN


@dataclass(frozen=True)
class Shape:
    """What a budget needs to know about one graded launch."""

    B: int
    H: int
    H_kv: int
    N_q: int
    N_k: int
    d: int
    itemsize: int
    causal: bool
    block_m: int
    block_n: int


@dataclass(frozen=True)
class Allowance:
    """low..high bytes of one tensor in one direction; size: the tensor's bytes; per: the loop
    whose count a multiple of `size` names ("key block"); advice: what to do when over."""

    low: int
    high: int
    size: int
    per: dict
    advice: str


ONCE_Q = "load it once, before the loop over key blocks: it stays on chip"
ONCE_KV = "load k_j and v_j once per program, before the loop over query blocks"
STORE_ONCE = "keep the accumulator on chip and store it once, after the loop"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _keys_seen(s: Shape) -> int:
    """Keys each query block needs, summed over blocks: keys visible to at least one row."""
    total = 0
    for r0 in range(0, s.N_q, s.block_m):
        last = min(r0 + s.block_m, s.N_q) - 1
        total += min(max(last + s.N_k - s.N_q + 1, 0), s.N_k) if s.causal else s.N_k
    return total


def _queries_seen(s: Shape, aligned: bool) -> int:
    """Query rows each key block's loop visits, summed over key blocks: from the first row that
    sees the block's first key (aligned: rounded down to a query block) to N_q."""
    total = 0
    for c0 in range(0, s.N_k, s.block_n):
        first = max(c0 - (s.N_k - s.N_q), 0) if s.causal else 0
        if first < s.N_q:
            total += s.N_q - (first // s.block_m * s.block_m if aligned else first)
    return total


def _rows_seeing(s: Shape) -> int:
    """Query rows in the query blocks that see at least one key."""
    total = 0
    for r0 in range(0, s.N_q, s.block_m):
        last = min(r0 + s.block_m, s.N_q) - 1
        if not s.causal or last + s.N_k - s.N_q >= 0:
            total += min(r0 + s.block_m, s.N_q) - r0
    return total


def forward(s: Shape) -> dict[tuple[str, str], Allowance]:
    """The forward kernel: grid (query blocks, B H), a loop over the key blocks each sees."""
    row, stat = s.B * s.H * s.d * s.itemsize, s.B * s.H * 4
    kv_size = s.B * s.H_kv * s.N_k * s.d * s.itemsize
    model = traffic.flash_forward(
        s.B, s.H, s.N_q, s.N_k, s.d, block_m=s.block_m, block_n=s.block_n, causal=s.causal,
        itemsize=s.itemsize,
    )  # fmt: skip
    per_q = {_cdiv(s.N_k, s.block_n): "key block"}
    per_kv = {_cdiv(s.N_q, s.block_m) * s.H // s.H_kv: "query block"}
    kv = "FA2 reads each visible K/V block once per query block"
    if s.causal:
        kv += "; blocks the causal mask hides entirely are never loaded"
    once_q, once_o = s.N_q * row, s.N_q * stat
    out = {("Q", "read"): Allowance(model.reads.get("Q", 0), once_q, once_q, per_q, ONCE_Q)}
    for t in ("K", "V"):
        out[(t, "read")] = Allowance(_keys_seen(s) * row, model.reads[t], kv_size, per_kv, kv)
    out[("O", "write")] = Allowance(once_q, once_q, once_q, per_q, STORE_ONCE)
    out[("lse", "write")] = Allowance(once_o, once_o, once_o, per_q, STORE_ONCE)
    return out


def dq(s: Shape) -> dict[tuple[str, str], Allowance]:
    """The dQ kernel: grid (query blocks, B H), a loop over the key blocks each sees."""
    row, stat = s.B * s.H * s.d * s.itemsize, s.B * s.H * 4
    seen = _rows_seeing(s)
    per = {_cdiv(s.N_k, s.block_n): "key block"}
    out = {(t, "read"): forward(s)[(t, "read")] for t in ("K", "V")}
    for t, size in (("Q", row), ("dO", row), ("lse", stat), ("D", stat)):
        out[(t, "read")] = Allowance(seen * size, s.N_q * size, s.N_q * size, per, ONCE_Q)
    out[("dQ", "write")] = Allowance(s.N_q * row, s.N_q * row, s.N_q * row, per, STORE_ONCE)
    return out


def dkdv(s: Shape) -> dict[tuple[str, str], Allowance]:
    """The dK/dV kernel: grid (key blocks, B H_kv), a loop over the query heads of the group and
    the query blocks that see each key block."""
    kv = s.B * s.H_kv * s.N_k * s.d * s.itemsize
    q_row, stat_row = s.B * s.H * s.d * s.itemsize, s.B * s.H * 4
    lo, hi = _queries_seen(s, False), _queries_seen(s, True)
    per_kv = {_cdiv(s.N_q, s.block_m): "query block"}
    per_q = {_cdiv(s.N_k, s.block_n): "key block"}
    seen = "FA2 reads each query block once per key block it sees"
    if s.causal:
        seen += "; query blocks the causal mask hides from these keys are never loaded"
    out = {(t, "read"): Allowance(kv, kv, kv, per_kv, ONCE_KV) for t in ("K", "V")}
    for t, size in (("Q", q_row), ("dO", q_row), ("lse", stat_row), ("D", stat_row)):
        out[(t, "read")] = Allowance(lo * size, hi * size, s.N_q * size, per_q, seen)
    for t in ("dK", "dV"):
        out[(t, "write")] = Allowance(kv, kv, kv, per_kv, STORE_ONCE)
    return out


def _times(n: int, size: int) -> str:
    t = n / size
    if t == 1:
        return "once"
    if t == 2:
        return "twice"
    return f"{t:g} times" if t == int(t) else f"{t:.2f} times"


def _per(n: int, a: Allowance) -> str:
    """': once per key block' when n is that many tensors, ': once more per key block' when n is
    the allowance plus that many."""
    if n % a.size == 0 and n // a.size in a.per:
        return f": once per {a.per[n // a.size]}"
    extra = n - a.high
    if extra % a.size == 0 and extra // a.size in a.per:
        return f": once more per {a.per[extra // a.size]}"
    return ""


def _passes(measured: traffic.Traffic, budget: dict) -> str:
    """'' or "two passes over the keys" when K was read a whole number of times more than FA2
    reads it while V was not: a softmax that finds the row max (and sum) in passes of its own."""
    k, v = budget.get(("K", "read")), budget.get(("V", "read"))
    if k is None or v is None or k.advice == ONCE_KV:  # dK/dV: K is loaded once per program
        return ""
    got_k, got_v = measured.reads.get("K", 0), measured.reads.get("V", 0)
    if not (v.low <= got_v <= v.high) or got_k <= k.high:
        return ""
    for n, word in ((2, "two"), (3, "three")):
        if n * k.low <= got_k <= n * k.high:
            return (
                f"your kernel read K {n} times as often as V ({got_k:,} B against FA2's at most "
                f"{k.high:,} B): {word} passes over the keys, the first for the row max; the "
                "online softmax takes one, rescaling l and acc as the max grows"
            )
    return ""


def judge(measured: traffic.Traffic, budget: dict, outputs: tuple[str, ...]) -> str:
    """'' when every tensor moves bytes inside its allowance; else one sentence about the first
    tensor that does not, with its bytes."""
    for direction, moved in (("write", measured.writes), ("read", measured.reads)):
        verb = "read" if direction == "read" else "wrote"
        for name, n in moved.items():
            if name == UNKNOWN:
                return (
                    f"your kernel {verb} {n:,} B outside every tensor it was given: a load or "
                    "store past the last row, without a mask (on a GPU that touches another "
                    "tensor's memory, or faults)"
                )
            if (name, direction) not in budget:
                kept = ", ".join(outputs)
                return (
                    f"your kernel {verb} {name} ({n:,} B) {'to' if verb == 'wrote' else 'from'} "
                    f"HBM: FlashAttention keeps scores, probabilities and running sums on chip; "
                    f"only {kept} leave it"
                )
    passes = _passes(measured, budget)
    if passes:
        return passes
    for (name, direction), a in budget.items():
        n = (measured.reads if direction == "read" else measured.writes).get(name, 0)
        if a.low <= n <= a.high:
            continue
        verb = "read" if direction == "read" else "wrote"
        text = f"your kernel {verb} {name} {_times(n, a.size)} ({n:,} B of a {a.size:,} B tensor)"
        if n > a.high:
            return text + _per(n, a) + f"; {a.advice}"
        return text + f"; FA2 moves at least {a.low:,} B of it"
    return ""
