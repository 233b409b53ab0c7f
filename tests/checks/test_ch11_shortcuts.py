"""Chapter 11 graders against solutions that give the right numbers by the wrong method.

Exercise 11.3 teaches the random Hadamard rotation M = diag(s) H / sqrt(d). Any orthogonal M keeps
the scores, and a dense random one spreads most outliers too, so the grader reads M itself off a
rotation of the identity: a dense random orthogonal matrix, a DCT, a signed permutation or a basis
computed from the data are rejected with a diagnosis that names them, for every seed. Honest
solutions written other ways (the Sylvester matrix by Kronecker products, an in-place fast
Walsh-Hadamard butterfly) are accepted.
"""

import math

import numpy as np
import pytest

from flashedu import checks
from flashedu.testing import run_grader

SEEDS = range(6)


def _signs(seed, d):
    return np.random.default_rng(seed).choice([-1.0, 1.0], size=d)


def sylvester_kron(q, k, seed):
    """Honest: H by Kronecker products, signs on the rows."""
    d = q.shape[1]
    h = np.array([[1.0]])
    for _ in range(int(math.log2(d))):
        h = np.kron(np.array([[1.0, 1.0], [1.0, -1.0]]), h)
    m = _signs(seed, d)[:, None] * h / math.sqrt(d)
    return q @ m, k @ m


def fwht(x):
    """The fast Walsh-Hadamard transform of each row (d log2 d additions), unnormalised."""
    x = np.array(x, dtype=np.float64)
    d, h = x.shape[1], 1
    while h < d:
        for i in range(0, d, 2 * h):
            a, b = x[:, i : i + h].copy(), x[:, i + h : i + 2 * h].copy()
            x[:, i : i + h], x[:, i + h : i + 2 * h] = a + b, a - b
        h *= 2
    return x


def butterfly(q, k, seed):
    """Honest, another way: flip the signs, then the fast transform, then 1/sqrt(d)."""
    s = _signs(seed, q.shape[1])
    return tuple(fwht(x * s) / math.sqrt(x.shape[1]) for x in (q, k))


def random_orthogonal(q, k, seed):
    """Shortcut: a dense random orthogonal matrix (QR of a Gaussian), seeded."""
    d = q.shape[1]
    m, r = np.linalg.qr(np.random.default_rng(seed).standard_normal((d, d)))
    m = m * np.sign(np.diag(r))
    return q @ m, k @ m


def dct(q, k, seed):
    """Shortcut: the orthonormal DCT-II matrix with random signs: dense, orthogonal, no Hadamard."""
    d = q.shape[1]
    j, n = np.arange(d)[:, None], np.arange(d)[None, :]
    c = np.cos(np.pi * (2 * n + 1) * j / (2 * d)) * math.sqrt(2 / d)
    c[0] /= math.sqrt(2)
    m = _signs(seed, d)[:, None] * c.T
    return q @ m, k @ m


def signed_permutation(q, k, seed):
    """Shortcut: a random signed permutation (orthogonal, cheap, spreads nothing)."""
    rng = np.random.default_rng(seed)
    d = q.shape[1]
    m = np.eye(d)[rng.permutation(d)] * rng.choice([-1.0, 1.0], size=d)
    return q @ m, k @ m


def data_basis(q, k, seed):
    """Shortcut: rotate into the principal axes of q and k (an orthogonal basis from the data)."""
    _, _, vt = np.linalg.svd(np.vstack([q, k]))
    m = vt.T * _signs(seed, q.shape[1])
    return q @ m, k @ m


@pytest.mark.parametrize("solution", [sylvester_kron, butterfly])
def test_rotation_accepts_honest_hadamard_rotations(solution):
    for seed in SEEDS:
        report, text = run_grader(checks.hadamard_rotation, solution, seed)
        assert report.passed, text


@pytest.mark.parametrize(
    "shortcut,words",
    [
        (random_orthogonal, "M is orthogonal but not a Hadamard matrix"),
        (dct, "M is orthogonal but not a Hadamard matrix"),
        (signed_permutation, "M is a (signed) permutation"),
        (data_basis, "the rotation depends on the values of q"),
    ],
    ids=["random orthogonal", "DCT", "signed permutation", "basis from the data"],
)
def test_rotation_rejects_an_orthogonal_matrix_that_is_not_hadamard_for_every_seed(shortcut, words):
    for seed in SEEDS:
        report, text = run_grader(checks.hadamard_rotation, shortcut, seed)
        assert not report.passed, text
        assert words in report.diagnosis, text
        assert report.lead == 0, text  # named on the first case, not by an unlucky input


def test_a_dense_random_rotation_is_never_blamed_on_a_permutation():
    for seed in SEEDS:
        _, text = run_grader(checks.hadamard_rotation, random_orthogonal, seed)
        assert "permutation" not in text, text
