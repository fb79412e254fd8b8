"""Differential fuzzing: every implementation against an independent float64 NumPy oracle over
seeded random cases (:mod:`fuzz_run`; buckets in :mod:`fuzz_buckets`, draws in
:mod:`fuzz_cases`).  ``--fuzz-cases N`` runs more cases, ``--fuzz-summary PATH`` writes the
summary JSON."""
import json
import os

import pytest

import fuzz_run


def _run(request, platform: str, default: int, shard: tuple[int, int] = (0, 1)) -> dict:
    n = request.config.getoption("--fuzz-cases") or default
    summary = fuzz_run.run(n, platform, shard=shard)
    path = request.config.getoption("--fuzz-summary")
    if path:
        if shard[1] > 1:
            root, ext = os.path.splitext(path)
            path = f"{root}_shard{shard[0]}{ext}"
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


GPU_SHARDS = 4


@pytest.mark.gpu
@pytest.mark.parametrize("shard", range(GPU_SHARDS))
def test_fuzz_gpu(request, shard):
    """The compiled default paths at realistic sizes: 400 cases by default, in four shards that
    pytest-xdist runs side by side (``--fuzz-summary PATH`` writes ``PATH_shardK``)."""
    summary = _run(request, "gpu", 400, shard=(shard, GPU_SHARDS))
    _assert_clean(summary)
