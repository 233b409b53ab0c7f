"""Bad input to public entry points: each gets a ValueError or TypeError that names the argument
and the value, never a traceback from deep inside, a MemoryError or a hang. One parametrized case
per bad input; the figures in tests/faults/README.md count them.
"""

from __future__ import annotations

import math
import signal

import numpy as np
import pytest
import torch

from flashedu import attention, checks, traffic, viz, widgets
from flashedu.traffic import closed_forms
from flashedu.varlen import attention_varlen


@pytest.fixture(autouse=True)
def no_hang():
    """A bad input must fail at once: a case still running after 20 s fails instead of hanging."""

    def stop(signum, frame):
        raise TimeoutError("still running after 20 s")

    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def _refused(call, arg: str, value_text: str):
    with pytest.raises((ValueError, TypeError)) as e:
        call()
    message = str(e.value)
    assert arg in message and value_text in message, message
    return message


# ---------------------------------------------------------------------------- the traffic model

BAD_N = [float("nan"), float("inf"), 10**18, 1e18, 0, -4, "4096", True, 4096.5, None]


@pytest.mark.parametrize("N", BAD_N, ids=repr)
def test_explorer_state_refuses_a_bad_N(N):
    text = f"{N:,}" if isinstance(N, int) and not isinstance(N, bool) and N > 10**6 else repr(N)
    _refused(lambda: viz.explorer_state(N=N), "N", text)


@pytest.mark.parametrize("N", [10**18, 2**40])
def test_the_tiled_traffic_model_refuses_more_blocks_than_it_can_sum(N):
    message = _refused(
        lambda: traffic.flash_forward(1, 1, N, N, 64, block_m=16, block_n=16, causal=True),
        "N_q",
        f"{N:,}",
    )
    assert "query blocks" in message and f"{closed_forms.MAX_QUERY_BLOCKS * 16:,}" in message


@pytest.mark.parametrize("N", [float("nan"), float("inf"), -1, "64"], ids=repr)
def test_the_closed_forms_refuse_non_finite_sizes(N):
    _refused(lambda: traffic.naive_forward(1, 1, N, 64, 64), "N_q", repr(N))


SRAM = [0, -1, float("nan"), float("inf"), 1e9, 2048, "64", True]


@pytest.mark.parametrize("kib", SRAM, ids=repr)
def test_explorer_state_refuses_sram_out_of_range(kib):
    _refused(lambda: viz.explorer_state(sram_kib=kib), "sram_kib", repr(kib))


@pytest.mark.parametrize("kib", [8, 300, 100.5, "128"], ids=repr)
def test_the_explorer_widget_refuses_sram_its_slider_would_clamp(kib):
    message = _refused(lambda: widgets.traffic_explorer(sram_kib=kib), "sram_kib", repr(kib))
    assert "[16, 256]" in message


# ---------------------------------------------------------------------------- the tile stepper

STEPPER = [
    ("block_m", 0),
    ("block_m", -8),
    ("block_m", 41),  # taller than N_q = 40
    ("block_n", 41),
    ("block_m", 2.5),
    ("block_m", "8"),
    ("block_n", True),
    ("N_q", 0),
    ("d", -1),
    ("order", "fa3"),
    ("causal", "yes"),
]


@pytest.mark.parametrize("arg,value", STEPPER, ids=lambda x: repr(x))
def test_the_tile_stepper_refuses_bad_sizes(arg, value):
    message = _refused(lambda: widgets.tile_stepper(**{arg: value}), arg, repr(value))
    assert message.startswith("tile_stepper:")


def test_a_block_as_tall_as_the_sequence_is_fine():
    stepper = widgets.tile_stepper(N_q=16, N_k=16, d=16, block_m=16, block_n=16)
    assert len(stepper.frames) >= 1


# ---------------------------------------------------------------------------- window sizes

WINDOWS = ["12", b"12", (1.7, 2.2), (True, False), (1, 2, 3), 5, {1: 2}, (None, 1)]


@pytest.mark.parametrize("window", WINDOWS, ids=repr)
@pytest.mark.parametrize("entry", ["naive", "reference", "traffic"])
def test_window_size_takes_ints_only(entry, window):
    from flashedu import naive, reference

    q = np.zeros((1, 1, 4, 8))
    call = {
        "naive": lambda: naive.forward(q, q, q, window_size=window),
        "reference": lambda: reference.forward(q, q, q, window_size=window),
        "traffic": lambda: traffic.flash_forward(
            1, 1, 64, 64, 16, block_m=16, block_n=16, window_size=window
        ),
    }[entry]
    _refused(call, "window_size", repr(window))


def test_window_size_still_takes_numpy_ints():
    from flashedu import naive

    q = np.ones((1, 1, 4, 8))
    o, _ = naive.forward(q, q, q, window_size=(np.int64(1), 0))
    assert np.isfinite(o).all()


# ---------------------------------------------------------------------------- impl names

IMPLS = ["bogus", 3, None, "reference", ""]


@pytest.mark.parametrize("impl", IMPLS, ids=repr)
def test_attention_refuses_an_unknown_impl(impl):
    q = torch.zeros(1, 1, 2, 8)
    _refused(lambda: attention(q, q, q, impl=impl), "impl", repr(impl))


@pytest.mark.parametrize("impl", IMPLS, ids=repr)
def test_varlen_refuses_an_unknown_impl_even_with_no_sequence_to_run(impl):
    q, cu = torch.zeros(0, 2, 8), torch.tensor([0, 0], dtype=torch.int32)
    _refused(lambda: attention_varlen(q, q, q, cu, cu, 0, 0, impl=impl), "impl", repr(impl))


def test_bench_refuses_an_unknown_impl_before_running(capsys):
    from flashedu.bench import __main__ as bench

    with pytest.raises(SystemExit) as e:
        bench.main(["--cpu", "--impls", "bogus"])
    assert e.value.code == 2 and "'bogus'" in capsys.readouterr().err


# ---------------------------------------------------------------------------- time limits

LIMITS = [0, -1, math.nan, math.inf, "5", True, None.__class__]


@pytest.mark.parametrize("limit", LIMITS, ids=repr)
def test_a_grader_refuses_a_bad_time_limit_before_running_anything(limit):
    ran = []

    def fn(*args, **kwargs):
        ran.append(1)

    _refused(lambda: checks.naive_attention(fn, time_limit=limit), "time_limit", repr(limit))
    assert not ran
