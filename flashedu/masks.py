"""Which keys each query may see, and ALiBi biases, as explicit arrays.

These are the *definitions*; the tiled and Triton implementations never build them (they test block
corners instead), and the tests compare those implementations with `reference.forward` fed these
arrays.

Alignment is bottom-right (flash-attn's convention): query row i sits at key position i + N_k - N_q,
so the last query lines up with the last key. With N_q == N_k that is the usual top-left causal
mask.

Below the definitions sit the *block rules* the tiled and Triton code, split-KV decoding, ring
attention and the traffic model share, all from block corners and never from an (N_q, N_k) array:
`band` (the visible diagonal band), `row_blocks`, `kv_blocks` (the K/V blocks a query block can
see), `block_kind` / `block_map` ("skip", "partial", "full") and `block_visible`; and two counts
that cost O(1) and O(number of query blocks) at any length: `visible_count` (the area of the mask)
and `kv_block_spans` (the visible K/V blocks of every query block at once). `tile_map` prints a
block map as text.

Introduced in notebooks/01_naive_attention.ipynb; windows and ALiBi in notebooks/09_beyond.ipynb;
the block rules in notebooks/03_tiled_forward.ipynb and notebooks/09_beyond.ipynb.
"""

from __future__ import annotations

import numpy as np


def visible(
    N_q: int, N_k: int, *, causal: bool = False, window_size: tuple[int, int] | None = None
) -> np.ndarray:
    """(N_q, N_k) bool: True where query i may attend to key j.

    causal: j <= i + N_k - N_q.
    window_size=(left, right): i + N_k - N_q - left <= j <= i + N_k - N_q + right; -1 leaves a side
    open. Both together intersect (causal is window_size=(-1, 0)).
    """
    diag = np.arange(N_q)[:, None] + (N_k - N_q)  # (N_q, 1): key position aligned with each query
    j = np.arange(N_k)[None, :]  # (1, N_k)
    keep = np.ones((N_q, N_k), dtype=bool)
    if causal:
        keep &= j <= diag
    if window_size is not None:
        left, right = window_size
        if left >= 0:
            keep &= j >= diag - left
        if right >= 0:
            keep &= j <= diag + right
    return keep


def alibi_bias(slopes, N_q: int, N_k: int) -> np.ndarray:
    """(H, N_q, N_k) float64 ALiBi bias -slope_h * |i + N_k - N_q - j| (Press et al. 2022), added to
    scaled scores."""
    slopes = np.asarray(slopes, dtype=np.float64).reshape(-1)
    dist = np.abs(np.arange(N_q)[:, None] + (N_k - N_q) - np.arange(N_k)[None, :])  # (N_q, N_k)
    return -slopes[:, None, None] * dist[None, :, :]


def alibi_slopes(H: int) -> np.ndarray:
    """The geometric slopes of the ALiBi paper: 2^(-8 h / H) for h = 1..H (H a power of two),
    float64."""
    return 2.0 ** (-8.0 * np.arange(1, H + 1) / H)


# ------------------------------------------------------------------------------------- block rules


def band(N_q: int, N_k: int, *, causal: bool = False, window_size: tuple[int, int] | None = None):
    """(off, left, right): query i sees keys off + i - left ... off + i + right (-1 = unbounded
    side), with off = N_k - N_q (bottom-right alignment) and causal folded in as right = 0."""
    left, right = window_size if window_size is not None else (-1, -1)
    return N_k - N_q, left, (0 if causal else right)


def kv_blocks(
    r0: int,
    r1: int,
    N_q: int,
    N_k: int,
    block_n: int,
    *,
    causal: bool = False,
    window_size: tuple[int, int] | None = None,
) -> range:
    """Indices j of the K/V blocks [j block_n, (j+1) block_n) that query rows [r0, r1) can see at
    least one key of; every other block is skipped whole. Bottom-right alignment, as in
    `masks.visible`.

    Row i sees keys [i + N_k - N_q - left, i + N_k - N_q + right]; consecutive rows shift that
    interval by one, so the rows of a block together see one contiguous run of keys."""
    off, left, right = band(N_q, N_k, causal=causal, window_size=window_size)
    lo = max(0, r0 + off - left) if left >= 0 else 0
    hi = min(N_k - 1, r1 - 1 + off + right) if right >= 0 else N_k - 1
    return range(lo // block_n, hi // block_n + 1) if lo <= hi else range(0)


def row_blocks(N: int, block: int) -> list[tuple[int, int]]:
    """[(r0, r1), ...]: blocks of `block` rows covering 0..N-1 (the last may be short)."""
    return [(r0, min(r0 + block, N)) for r0 in range(0, N, block)]


SKIP, PARTIAL, FULL = "skip", "partial", "full"


def key_offsets(rows: tuple[int, int], cols: tuple[int, int], N_q: int, N_k: int) -> np.ndarray:
    """(r1 - r0, c1 - c0) int array of j - (i + N_k - N_q): each key's distance from the query's
    diagonal."""
    i = np.arange(rows[0], rows[1])[:, None] + (N_k - N_q)
    return np.arange(cols[0], cols[1])[None, :] - i


def block_visible(
    rows, cols, N_q: int, N_k: int, *, causal: bool = False, window_size=None
) -> np.ndarray:
    """The bool mask of one block, `masks.visible(N_q, N_k, ...)[r0:r1, c0:c1]`, built for the block
    alone."""
    _, left, right = band(N_q, N_k, causal=causal, window_size=window_size)
    off = key_offsets(rows, cols, N_q, N_k)
    return ((off >= -left) | (left < 0)) & ((off <= right) | (right < 0))


def block_kind(rows, cols, N_q: int, N_k: int, *, causal: bool = False, window_size=None) -> str:
    """ "skip", "partial" or "full" for query rows [r0, r1) against keys [c0, c1), from two corners.

    Query i sees key j iff -left <= j - (i + N_k - N_q) <= right (`band` above; -1 leaves a side
    open). That offset grows along a row and shrinks down a column, so the block's smallest offset
    sits at its bottom-left corner and its largest at its top-right: the block is hidden when the
    largest is below the band or the smallest above it, and fully visible when both lie inside.
    """
    (r0, r1), (c0, c1) = rows, cols
    off, left, right = band(N_q, N_k, causal=causal, window_size=window_size)
    smallest, largest = c0 - (r1 - 1 + off), (c1 - 1) - (r0 + off)
    if (left >= 0 and largest < -left) or (right >= 0 and smallest > right):
        return SKIP
    return FULL if (left < 0 or smallest >= -left) and (right < 0 or largest <= right) else PARTIAL


def block_map(
    N_q: int, N_k: int, block_m: int, block_n: int, *, causal=False, window_size=None
) -> np.ndarray:
    """(ceil(N_q / block_m), ceil(N_k / block_n)) array of "skip" / "partial" / "full" for every
    tile."""
    rows = [(r, min(r + block_m, N_q)) for r in range(0, N_q, block_m)]
    cols = [(c, min(c + block_n, N_k)) for c in range(0, N_k, block_n)]
    return np.array(
        [
            [block_kind(r, c, N_q, N_k, causal=causal, window_size=window_size) for c in cols]
            for r in rows
        ]
    )


# ------------------------------------------------------------------------ counts at any length


def visible_count(
    N_q: int, N_k: int, *, causal: bool = False, window_size: tuple[int, int] | None = None
) -> int:
    """The number of (query, key) pairs the mask lets through, `visible(...).sum()`, in O(1).

    Sums along the diagonals t = j - (i + N_k - N_q): diagonal t holds
    min(N_q, N_q - t) - max(0, N_q - N_k - t) pairs for -N_k < t < N_q, a function that is linear
    between its corners t = 0 and t = N_q - N_k, so each linear piece sums as an arithmetic series.
    Causal N_q = 1, N_k = 1000 sees all 1000 keys; causal N_q = N_k = N sees N (N + 1) / 2.
    """
    _, left, right = band(N_q, N_k, causal=causal, window_size=window_size)
    lo = max(-N_k + 1, -left if left >= 0 else -N_k + 1)
    hi = min(N_q - 1, right if right >= 0 else N_q - 1)

    def pairs(t: int) -> int:
        return min(N_q, N_q - t) - max(0, N_q - N_k - t)

    total, cuts = 0, sorted({lo, hi + 1, 0, N_q - N_k + 1})
    for a, b in zip(cuts, cuts[1:]):
        a, b = max(a, lo), min(b - 1, hi)  # [a, b]: one linear piece
        if a <= b:
            total += (pairs(a) + pairs(b)) * (b - a + 1) // 2
    return total


def kv_block_spans(
    N_q: int,
    N_k: int,
    block_m: int,
    block_n: int,
    *,
    causal: bool = False,
    window_size: tuple[int, int] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`kv_blocks` for every query block at once, as int64 arrays over the ceil(N_q / block_m)
    query blocks: (rows in the block, first visible K/V block, one past the last). A block that sees
    no key has first == stop == 0. Costs O(number of query blocks), not O(blocks^2)."""
    off, left, right = band(N_q, N_k, causal=causal, window_size=window_size)
    r0 = np.arange(0, N_q, block_m, dtype=np.int64)
    r1 = np.minimum(r0 + block_m, N_q)
    lo = np.maximum(0, r0 + off - left) if left >= 0 else np.zeros_like(r0)
    hi = np.minimum(N_k - 1, r1 - 1 + off + right) if right >= 0 else np.full_like(r0, N_k - 1)
    seen = lo <= hi
    first = np.where(seen, lo // block_n, 0)
    stop = np.where(seen, hi // block_n + 1, 0)
    return r1 - r0, first, stop


def keys_in_blocks(first, stop, N_k: int, block_n: int):
    """Keys in the K/V blocks [first, stop) (the last block of K may be short); works elementwise
    on the arrays of `kv_block_spans`."""
    return np.where(stop > first, np.minimum(stop * block_n, N_k) - first * block_n, 0)


def tile_map(
    N_q: int,
    N_k: int,
    block_m: int,
    block_n: int,
    *,
    causal: bool = False,
    window_size: tuple[int, int] | None = None,
) -> str:
    """The block map as text, one character per (query block, key block) tile: '#' fully visible
    (no mask arithmetic), '/' on a mask edge, '.' skipped (never loaded), and a count of the tiles
    computed. Print it: `print(masks.tile_map(48, 48, 8, 8, causal=True))`."""
    kinds = block_map(N_q, N_k, block_m, block_n, causal=causal, window_size=window_size)
    char = {SKIP: ".", PARTIAL: "/", FULL: "#"}
    lines = ["   " + " ".join(char[k] for k in row) for row in kinds]
    lines.append(f"   {int((kinds != SKIP).sum())} of {kinds.size} tiles computed")
    return "\n".join(lines)
