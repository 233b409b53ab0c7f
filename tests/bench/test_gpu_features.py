"""The GPU check's feature rows (flashedu.bench.gpu_features) on whatever device is here: the cases
cover the head dims and features they promise, the comparators agree with flashedu.reference, and
small rows pass (under the interpreter on a CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashedu import reference
from flashedu.bench import gpu_check, gpu_features, oracles
from flashedu.testing import max_error

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim > 0:DeprecationWarning"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_feature_rows_cover_the_head_dims_value_dims_mods_and_packing():
    cases = gpu_features.feature_cases()
    dense = [c for c in cases if c["kind"] == "dense"]
    assert {40, 59, 80, 96, 111, 192} <= {c["d"] for c in dense if c["d"] == c["d_v"]}
    assert {(c["d"], c["d_v"]) for c in dense if c["d"] != c["d_v"]} >= {(128, 64), (64, 128)}
    assert any(c["mod"] == "softcap" for c in dense)
    assert {c["causal"] for c in cases if c["kind"] == "varlen"} == {False, True}
    assert {c["dtype"] for c in cases} == {"float16", "bfloat16", "float32"}
    assert all(set(gpu_check.CASE_KEYS) <= set(c) for c in cases)  # what the matrix's rows read
    assert all(c in gpu_check.matrix() for c in gpu_features.feature_cases(quick=True))


def test_comparators_agree_with_the_reference(rng):
    q, k, v = (torch.from_numpy(rng.standard_normal(s)) for s in ((1, 2, 9, 6), (1, 1, 13, 6),
                                                                    (1, 1, 13, 4)))  # fmt: skip
    do = torch.from_numpy(rng.standard_normal((1, 2, 9, 4)))
    opts = dict(causal=True, window=None, scale=0.7)
    cap = gpu_features.SOFTCAP
    softcap = lambda s: cap * torch.tanh(s / cap)
    exact = oracles.float64_attention(q, k, v, do, slopes=None, mod=softcap, **opts)
    low = oracles.lowp_attention(q, k, v, do, mod=softcap, **opts)  # float64 in, float64 out
    kw = dict(causal=True, softmax_scale=0.7, score_mod=lambda s, *_: cap * np.tanh(s / cap))
    grad = lambda s, *_: 1 - np.tanh(s / cap) ** 2
    ref = (*reference.forward(q, k, v, **kw), *reference.backward(do, q, k, v, **kw,
           score_mod_grad=grad))  # fmt: skip
    for name, x, r in zip(("o", "lse", "dq", "dk", "dv"), exact, ref):
        assert max_error(x, r)[0] < 1e-12, name
    for name, x, r in zip(("o", "dq", "dk", "dv"), low, ref[:1] + ref[2:]):
        assert max_error(x, r)[0] < 1e-12, name


def test_small_feature_rows_pass_here():
    small = [
        dict(kind="dense", B=1, H=2, H_kv=1, N_q=20, N_k=33, mod=None, window=None,
             dtype="float16", d=40, d_v=24, causal=True),
        dict(kind="dense", B=1, H=2, H_kv=1, N_q=17, N_k=17, mod="softcap", window=None,
             dtype="float16", d=16, d_v=16, causal=True),
        dict(kind="varlen", dtype="float16", d=32, d_v=32, causal=True, B=4, H=2, H_kv=1, N_q=51,
             N_k=60, lens_q=[1, 17, 30, 3], lens_k=[1, 20, 30, 9], mod=None, window=None,
             alibi=False),
    ]  # fmt: skip
    for i, case in enumerate(small):  # fixed inputs: a unit test must not depend on the draw
        case["seed"] = 1000 + i
    rows = gpu_check._check_many(small)
    assert len(rows) == 6 and all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    assert [r["extra"] for r in rows[::2]] == ["gqa 2/1 Ev 24", "gqa 2/1 softcap 2.0",
                                              "varlen 4 seqs, gqa 2/1"]  # fmt: skip
