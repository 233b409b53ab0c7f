"""A kernel's measured bytes beside the closed form: the sentences and the bars chapters 06 and 07
show under the kernels the learner writes.

`traffic.measure()` records what a Triton kernel really loads and stores under the interpreter;
`traffic.flash_forward` / `flash_backward` say what the FA2 algorithm moves. `describe` turns the
two into one line per tensor ("K: read 4 times (16,384 B of a 4,096 B tensor); the closed form
also 4 times: once per query block") and `plot` draws them as pairs of bars.

`dq_strategies` and `families` put the two ways of summing dQ side by side (chapter 11's
backward ladder): a separate dQ pass, or float32 partial tiles added in one pass.

Introduced in notebooks/06_triton_forward.ipynb; used again in notebooks/07_triton_backward.ipynb
and notebooks/11_hopper.ipynb.
"""

from __future__ import annotations

from .. import traffic
from .ledger import Traffic, combine, tensor_order


def _times(n: int, size: int) -> str:
    if not size:
        return f"{n:,} B"
    t = n / size
    word = "once" if t == 1 else "twice" if t == 2 else f"{t:g} times"
    return word if t == int(t) else f"{t:.2f} times"


def describe(measured: Traffic, model: Traffic, sizes: dict[str, int], per=None) -> list[str]:
    """One line per tensor and direction: how many times the kernel moved the tensor, and how many
    times the closed form says. sizes: tensor -> its bytes (e.g. from `Measurement.tensors`);
    per: {count: "query block"} names a count that is one per something."""
    per = per or {}
    lines = []
    for direction, mine, theirs in (("read", measured.reads, model.reads),
                                    ("written", measured.writes, model.writes)):  # fmt: skip
        for name in sorted(set(mine) | set(theirs), key=tensor_order):
            a, b, size = mine.get(name, 0), theirs.get(name, 0), sizes.get(name, 0)
            line = f"{name}: {direction} {_times(a, size)} ({a:,} B of a {size:,} B tensor)"
            line += "; the closed form " + ("also " if a == b else "") + _times(b, size)
            if size and a % size == 0 and a // size in per and a // size > 1:
                line += f": once per {per[a // size]}"
            lines.append(line)
    return lines


def measured(m, skip: tuple[str, ...] = ()) -> Traffic:
    """The bytes of a `traffic.measure()` run, leaving out the launches of the kernels named in
    skip (e.g. the backward's preprocess)."""
    reads: dict[str, int] = {}
    writes: dict[str, int] = {}
    for a in m.accesses:
        if m.launches[a.launch][0] not in skip:
            moved = reads if a.direction == "read" else writes
            moved[a.tensor] = moved.get(a.tensor, 0) + a.nbytes
    return Traffic(reads, writes)


def backward_passes(B, H, N_q, N_k, d, *, block_m, block_n, causal=False, itemsize=2, H_kv=None):
    """The closed form of the dK/dV and dQ passes together: `traffic.flash_backward`'s two-pass
    variant without its preprocess (which reads O and dO once and writes D)."""
    whole = traffic.flash_backward(
        B, H, N_q, N_k, d, block_m=block_m, block_n=block_n, causal=causal, itemsize=itemsize,
        H_kv=H_kv, variant="two_pass",
    )  # fmt: skip
    row = B * H * N_q * d * itemsize
    minus = Traffic({"O": -row, "dO": -row}, {"D": -B * H * N_q * 4})
    return combine(whole, minus)


def dq_strategies(B, H, N_q, N_k, d, *, block_m, block_n, causal=False, itemsize=2):
    """What a backward's kernels move with each way of summing dQ, from `traffic.flash_backward`
    without the preprocess (it reads O and dO once and writes D, whichever the strategy):

    "separate": a dK/dV pass and a dQ pass (the FA2 kernels, the Gluon backward's default), the
        two-pass variant: Q and dO read once per key block, K and V once per query block.
    "atomic": one pass; each visible tile adds its partial dQ into a float32 buffer (a read and a
        write of BLOCK_M x d float32 per tile; `hopper.triton_bwd`, the Gluon backward's
        dq_mode="atomic"). Left out, because torch does them outside the kernel: zeroing that
        buffer and casting it to dQ's dtype at the end.
    "workspace": one pass with plain stores instead of atomics: each visible tile writes its
        partial dQ to a float32 slot of its own (`dq_workspace_bytes`), and a reduction kernel
        reads every slot and writes dQ. No kernel of the package does this; it is the closed form
        of the third way, for comparison.
    """
    kw = dict(block_m=block_m, block_n=block_n, causal=causal, itemsize=itemsize)
    separate = backward_passes(B, H, N_q, N_k, d, **kw)
    whole = traffic.flash_backward(B, H, N_q, N_k, d, variant="atomic", **kw)
    row, acc_row = B * H * N_q * d * itemsize, B * H * N_q * d * 4
    minus = Traffic(
        {"O": -row, "dO": -row, "dQ": -acc_row}, {"D": -B * H * N_q * 4, "dQ": -acc_row - row}
    )
    atomic = combine(whole, minus)
    # the workspace's slots are written and read once each, as the atomic buffer's tiles are; the
    # reduction then writes dQ in its dtype
    workspace = combine(atomic, Traffic({}, {"dQ": row}))
    return {"separate": separate, "atomic": atomic, "workspace": workspace}


def dq_workspace_bytes(B, H, N_q, N_k, d, *, block_m, block_n, causal=False, itemsize=2):
    """Bytes of the float32 buffer the "workspace" strategy needs: one BLOCK_M x d tile for every
    visible (query block, key block) pair, that is the atomic strategy's partial-dQ reads."""
    whole = traffic.flash_backward(
        B, H, N_q, N_k, d, block_m=block_m, block_n=block_n, causal=causal, itemsize=itemsize,
        variant="atomic",
    )  # fmt: skip
    acc_row = B * H * N_q * d * 4
    return whole.reads["dQ"] - acc_row


FAMILIES = ("Q, dO read", "K, V read", "dQ read + written")


def families(t: Traffic) -> dict[str, int]:
    """The bytes in which the dQ strategies differ, in three sums (`FAMILIES`): the query side
    read (Q and dO), the key side read (K and V), and dQ moved either way."""
    r, w = t.reads, t.writes
    return dict(
        zip(
            FAMILIES,
            (
                r.get("Q", 0) + r.get("dO", 0),
                r.get("K", 0) + r.get("V", 0),
                r.get("dQ", 0) + w.get("dQ", 0),
            ),
        )
    )


def plot(measured: Traffic, model: Traffic, title: str, ax=None):
    """Bars of bytes per tensor and direction, the measured run beside the closed form. Returns the
    matplotlib Axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 3.2))
    keys = [(n, "read") for n in sorted(set(measured.reads) | set(model.reads), key=tensor_order)]
    keys += [
        (n, "write") for n in sorted(set(measured.writes) | set(model.writes), key=tensor_order)
    ]
    xs = range(len(keys))

    def values(t: Traffic):
        return [(t.reads if d == "read" else t.writes).get(n, 0) / 1024 for n, d in keys]

    ax.bar([x - 0.2 for x in xs], values(measured), 0.4, label="measured (traffic.measure)")
    ax.bar([x + 0.2 for x in xs], values(model), 0.4, label="closed form (traffic)", alpha=0.6)
    ax.set_xticks(list(xs), [f"{n}\n{'read' if d == 'read' else 'written'}" for n, d in keys])
    ax.set_ylabel("KiB")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return ax
