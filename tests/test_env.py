"""flashedu._env: the torch/triton pair check that `import flashedu` runs once."""

import importlib.metadata
import warnings

import pytest
import torch

from flashedu import _env


def test_a_checked_pair_is_silent(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "3.7.1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _env._check_pair()


def test_an_unchecked_pair_warns_naming_what_was_found_and_what_is_supported(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.13.0")
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "3.6.0")
    with pytest.warns(RuntimeWarning) as got:
        _env._check_pair()
    (w,) = got
    text = str(w.message)
    assert "torch 2.13.0 with triton 3.6.0" in text
    assert "torch 2.13 + triton 3.7" in text and "torch 2.11 + triton 3.6" in text
    assert "\n" not in text


def test_no_triton_means_no_pair_warning(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _env._check_pair()


def test_the_checked_pairs_are_the_pinned_ones():
    root = _env.ROOT
    for name, pair in (
        ("requirements.txt", ("2.13", "3.7")),
        ("requirements-gpu.txt", ("2.11", "3.6")),
    ):
        text = (root / name).read_text()
        torch_pin = text.split("torch==", 1)[1].split()[0]
        triton_pin = text.split("triton==", 1)[1].split()[0]
        assert (_env._release(torch_pin), _env._release(triton_pin)) == pair
        assert pair in _env.CHECKED_PAIRS
