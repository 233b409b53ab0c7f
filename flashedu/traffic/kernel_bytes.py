"""A kernel's measured bytes beside the closed form: the sentences and the bars chapters 06 and 07
show under the kernels the learner writes.

`traffic.measure()` records what a Triton kernel really loads and stores under the interpreter;
`traffic.flash_forward` / `flash_backward` say what the FA2 algorithm moves. `describe` turns the
two into one line per tensor ("K: read 4 times (16,384 B of a 4,096 B tensor); the closed form
also 4 times: once per query block") and `plot` draws them as pairs of bars.

Introduced in notebooks/06_triton_forward.ipynb; used again in notebooks/07_triton_backward.ipynb.
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
