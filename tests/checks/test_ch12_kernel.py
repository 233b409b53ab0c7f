"""Chapter 12's Triton exercise grader (`checks._ch12_kernel.paged_kernel`): the honest answer
passes, a stub is "not attempted yet", and each planted bug or shortcut fails with its name. The
planted functions are @triton.jit; on CPU they run through the interpreter."""

from __future__ import annotations

import pytest
import triton
import triton.language as tl

from flashedu.checks._ch12_kernel import paged_kernel
from flashedu.kernels import paged_solution
from flashedu.testing import run_grader

pytestmark = [
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]


def flat(text: str) -> str:
    return " ".join(text.split())


@triton.jit
def my_page_rows(BT_ROW, start_n, seqlen, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    page = tl.load(BT_ROW + start_n // PAGE_SIZE).to(tl.int64)
    cols = start_n + tl.arange(0, BLOCK_N)
    return page * PAGE_SIZE + cols % PAGE_SIZE, cols < seqlen


@triton.jit
def my_page_rows_per_key(BT_ROW, start_n, seqlen, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    cols = start_n + tl.arange(0, BLOCK_N)  # one table load per key, the same address: one entry
    keep = cols < seqlen
    pages = tl.load(BT_ROW + cols // PAGE_SIZE, mask=keep, other=0)
    return pages.to(tl.int64) * PAGE_SIZE + cols % PAGE_SIZE, keep


@triton.jit
def my_stub(BT_ROW, start_n, seqlen, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    # rows = ...; keep = ...
    pass


@triton.jit
def ignores_table(BT_ROW, start_n, seqlen, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    cols = start_n + tl.arange(0, BLOCK_N)
    return cols.to(tl.int64), cols < seqlen


@triton.jit
def drops_last_page(BT_ROW, start_n, seqlen, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    page = tl.load(BT_ROW + start_n // PAGE_SIZE).to(tl.int64)
    cols = start_n + tl.arange(0, BLOCK_N)
    return page * PAGE_SIZE + cols % PAGE_SIZE, cols < (seqlen // PAGE_SIZE) * PAGE_SIZE


@triton.jit
def trusts_full_pages(BT_ROW, start_n, seqlen, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    page = tl.load(BT_ROW + start_n // PAGE_SIZE).to(tl.int64)
    cols = start_n + tl.arange(0, BLOCK_N)
    return page * PAGE_SIZE + cols % PAGE_SIZE, cols < tl.cdiv(seqlen, PAGE_SIZE) * PAGE_SIZE


@triton.jit
def one_past(BT_ROW, start_n, seqlen, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    page = tl.load(BT_ROW + start_n // PAGE_SIZE).to(tl.int64)
    cols = start_n + tl.arange(0, BLOCK_N)
    return page * PAGE_SIZE + cols % PAGE_SIZE, cols <= seqlen


@triton.jit
def no_modulo(BT_ROW, start_n, seqlen, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    page = tl.load(BT_ROW + start_n // PAGE_SIZE).to(tl.int64)
    cols = start_n + tl.arange(0, BLOCK_N)
    return page * PAGE_SIZE + cols, cols < seqlen


@triton.jit
def block_as_page(BT_ROW, start_n, seqlen, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    page = tl.load(BT_ROW + start_n // BLOCK_N).to(tl.int64)
    cols = start_n + tl.arange(0, BLOCK_N)
    return page * PAGE_SIZE + cols % PAGE_SIZE, cols < seqlen


@triton.jit
def reads_table_twice(BT_ROW, start_n, seqlen, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    first = tl.load(BT_ROW)  # the row's first entry, again at every tile
    page = tl.load(BT_ROW + start_n // PAGE_SIZE).to(tl.int64) + first * 0
    cols = start_n + tl.arange(0, BLOCK_N)
    return page * PAGE_SIZE + cols % PAGE_SIZE, cols < seqlen


@triton.jit
def calls_the_package(BT_ROW, start_n, seqlen, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    return paged_solution.page_rows(BT_ROW, start_n, seqlen, PAGE_SIZE, BLOCK_N)


def gathers_on_the_host(k_cache, v_cache, block_table, cache_seqlens):
    k = k_cache[block_table.long()].flatten(1, 2)  # a contiguous copy of every page
    v = v_cache[block_table.long()].flatten(1, 2)
    return k, v


@pytest.mark.parametrize("fn", [my_page_rows, my_page_rows_per_key])
def test_an_honest_function_passes(fn):
    report, text = run_grader(paged_kernel, fn, seed=3)
    assert report.passed, text


def test_a_stub_is_not_attempted_yet():
    report, text = run_grader(paged_kernel, my_stub)
    assert not report.attempted and text == "paged_kernel: not attempted yet"


@pytest.mark.parametrize(
    "fn,words",
    [
        (ignores_table, "ignored the block table"),
        (drops_last_page, "the last, partial page was dropped"),
        (trusts_full_pages, "read past the sequence's length"),
        (one_past, "one key too many"),
        (no_modulo, "cols % PAGE_SIZE, not cols"),
        (block_as_page, "picked by cols // BLOCK_N"),
        (reads_table_twice, "where one int32 per tile"),
        (calls_the_package, "flashedu.kernels.paged_solution.page_rows"),
        (paged_solution.page_rows, "flashedu's own kernel"),
        (gathers_on_the_host, "contiguous gather"),
    ],
)
def test_each_planted_bug_is_named(fn, words):
    report, text = run_grader(paged_kernel, fn, seed=5)
    assert report.attempted and not report.passed, text
    assert words in flat(text), text
