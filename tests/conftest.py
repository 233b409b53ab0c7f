"""Shared fixtures: fresh seeded inputs for every test case, and the implementation registry."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
from hypothesis import settings

from flashedu import IMPLEMENTATIONS
from flashedu.testing import random_qkv

# CI replays the same examples every run (derandomised); local runs keep exploring new ones.
settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A generator seeded from the test's id: fresh per case, reproducible per run."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def make_qkv(rng):
    def make(B, H, N_q, N_k, d, dtype="float32", *, H_kv=None, kind="numpy", scale=1.0):
        return random_qkv(B, H, N_q, N_k, d, dtype, H_kv=H_kv, seed=rng, kind=kind, scale=scale)

    return make


@pytest.fixture
def impls():
    return IMPLEMENTATIONS
