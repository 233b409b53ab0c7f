"""Wall time of each Triton grader (exercises 6.1-6.3, 7.1-7.4) on an honest learner solution,
three seeds each; on CPU the kernels run through Triton's interpreter. Information, not a test:

    cd REPO && PYTHONPATH=$PWD:$PWD/tests python tests/checks/grader_timing.py
"""

from __future__ import annotations

import os
import time

# Without a GPU the kernels run through Triton's interpreter, which must be chosen before the
# fixtures' kernels are decorated (tests/conftest.py does the same for the suite).
os.environ.setdefault("TRITON_INTERPRET", "1")

from fixtures import learner_kernels as L

from flashedu import checks
from flashedu.testing import run_grader


def kv_range(first, last, N_q, N_k, block_n, *, causal=False):
    if not causal:
        return 0, 0, N_k // block_n * block_n, -(-N_k // block_n) * block_n
    hi = min(max(last + N_k - N_q + 1, 0), N_k)
    full = min(max(first + N_k - N_q + 1, 0), N_k)
    hi = -(-hi // block_n) * block_n
    return 0, 0, min(full // block_n * block_n, hi), hi


GRADED = [
    (checks.triton_scores, L.my_scores_kernel),
    (checks.kv_block_range, kv_range),
    (checks.triton_forward, L.my_flash_forward),
    (checks.bwd_preprocess, L.my_preprocess_kernel),
    (checks.recompute_probabilities, L.my_probabilities_kernel),
    (checks.triton_dkdv, L.my_dkdv),
    (checks.triton_dq, L.my_dq),
]

if __name__ == "__main__":
    run_grader(checks.kv_block_range, kv_range, 0)  # imports and the guard's tables, once
    for grader, solution in GRADED:
        times = []
        for seed in (0, 1, 2):
            start = time.perf_counter()
            report, text = run_grader(grader, solution, seed)
            times.append(time.perf_counter() - start)
            assert report.passed, text
        print(f"{grader.__name__:24s} " + "  ".join(f"{t:5.2f} s" for t in times))
