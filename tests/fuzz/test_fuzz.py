"""Differential fuzzing: every implementation against an independent float64 NumPy oracle over
seeded random cases (:mod:`fuzz_run`; buckets in :mod:`fuzz_buckets`, draws in
:mod:`fuzz_cases`).  ``--fuzz-cases N`` runs more cases, ``--fuzz-summary PATH`` writes the
summary JSON."""
import json

import pytest

import fuzz_run


def _run(request, platform: str, default: int) -> dict:
    n = request.config.getoption("--fuzz-cases") or default
    summary = fuzz_run.run(n, platform)
    path = request.config.getoption("--fuzz-summary")
    if path:
        with open(path, "w") as f:
            json.dump(summary, f, indent=1)
    return summary


def _assert_clean(summary: dict) -> None:
    bad = {k: summary[k] for k in ("mismatches", "unexpected_nan", "missing_nan")}
    assert bad == dict(mismatches=0, unexpected_nan=0, missing_nan=0), (bad, summary["failures"])


def test_fuzz_interpret(request):
    """Reference, the kernels in interpret mode (shared, flat, tree schedules, flash) and the
    merges: 200 cases by default."""
    summary = _run(request, "cpu", 200)
    assert summary["checks"] >= 2 * summary["cases"]
    _assert_clean(summary)


@pytest.mark.gpu
def test_fuzz_gpu(request):
    """The compiled default paths at realistic sizes: 1000 cases by default."""
    summary = _run(request, "gpu", 1000)
    _assert_clean(summary)
