"""Every leaf the planner picks, at a seeded sample of shapes (``tests/planner_shapes.py``): on
the CPU each plan is lowered for CUDA (Mosaic GPU layout inference and transfer plans, Triton
lowering: what a jax release can break), on a GPU each runs against the reference."""
import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import lower_for_cuda, rel_err
from jax_prefix_attn import device_info, shared_prefix_attention
from planner_shapes import LEAVES, README_SHAPES, plan_for, sample_cases

CASES = sample_cases()
REF_ROWS = 64   # batch rows compared with the reference on the GPU
# lowered on the CPU: the README shapes and the first three of every leaf
LOWERED = CASES[:len(README_SHAPES)] + [
    c for leaf in LEAVES for c in [c for c in CASES[len(README_SHAPES):] if c.leaf == leaf][:3]]
S = jax.ShapeDtypeStruct


def _avals(c):
    dt = jnp.dtype(c.dtype)
    pk = (c.groups, c.p, c.hkv, c.d) if c.groups > 1 else (c.p, c.hkv, c.d)
    return [S((c.b, c.tq, c.hq, c.d), dt), S(pk, dt), S(pk, dt), S((c.b, c.s, c.hkv, c.d), dt),
            S((c.b, c.s, c.hkv, c.d), dt), S((c.b,), jnp.int32), S((c.b,), jnp.int32),
            S((c.groups,), jnp.int32)]


def _call(plan=None, impl="auto"):
    def f(q, pk, pv, sk, sv, sl, s2p, plen):
        grouped = pk.ndim == 4
        return shared_prefix_attention(
            q, pk, pv, sk, sv, suffix_lengths=sl, seq_to_prefix=s2p if grouped else None,
            prefix_lengths=plen if grouped else None, plan=plan, impl=impl, return_lse=True)
    return f


def test_sample_covers_every_leaf_and_the_readme_shapes():
    counts = collections.Counter(c.leaf for c in CASES)
    assert len(CASES) >= 105
    assert set(counts) == set(LEAVES), counts
    assert min(counts.values()) >= 10, counts
    readme = {(c.b, c.p, c.s) for c in CASES if (c.hq, c.hkv, c.d, c.tq, c.groups) == (32, 8, 128, 1, 1)}
    assert set(README_SHAPES) <= readme


@pytest.mark.parametrize("case", LOWERED, ids=lambda c: c.id)
def test_planned_leaf_lowers_for_cuda(case):
    plan = plan_for(case)
    assert "+".join(sorted({type(ch.leaf).__name__ for ch in plan.chunks})) == case.leaf
    text = lower_for_cuda(_call(plan), *_avals(case))
    assert ("mosaic_gpu" in text) == case.leaf.startswith("Mgpu")


def _inputs(case, seed):
    """Random inputs on the device; NaN in every suffix slot past its length and in every
    grouped prefix past its length (no leaf may read them).  With one prefix the buffer is
    full: the Mosaic GPU leaves read the prefix's last tile whole (``docs/api.md``)."""
    rng = np.random.default_rng(seed)
    sl = rng.integers(min(case.tq, case.s), case.s + 1, size=case.b)
    sl[0], sl[-1] = case.s, min(case.tq, case.s)
    s2p = rng.integers(0, case.groups, size=case.b)
    plen = rng.integers(1, case.p + 1, size=case.groups)
    plen[0] = case.p
    as32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    sl, s2p, plen = as32(sl), as32(s2p), as32(plen)
    return (*_random_operands(case, jax.random.PRNGKey(seed), sl, plen), sl, s2p, plen)


@jax.jit(static_argnums=0)
def _random_operands(case, key, sl, plen):
    """``(q, pk, pv, sk, sv)`` of ``case`` with NaN past ``sl`` and (grouped) ``plen``."""
    dt = jnp.dtype(case.dtype)
    ks = jax.random.split(key, 5)
    pshape = (case.groups, case.p, case.hkv, case.d) if case.groups > 1 else (case.p, case.hkv, case.d)
    q = jax.random.normal(ks[0], (case.b, case.tq, case.hq, case.d), jnp.float32).astype(dt)
    pk, pv = (jax.random.normal(k, pshape, jnp.float32).astype(dt) for k in ks[1:3])
    sk, sv = (jax.random.normal(k, (case.b, case.s, case.hkv, case.d), jnp.float32).astype(dt)
              for k in ks[3:5])
    keep_s = jnp.arange(case.s)[None, :, None, None] < sl[:, None, None, None]
    sk, sv = (jnp.where(keep_s, x, jnp.nan).astype(dt) for x in (sk, sv))
    if case.groups > 1:
        keep_p = jnp.arange(case.p)[None, :, None, None] < plen[:, None, None, None]
        pk, pv = (jnp.where(keep_p, x, jnp.nan).astype(dt) for x in (pk, pv))
    return q, pk, pv, sk, sv


def checked_rows(case, seed):
    """The batch rows compared with the reference: all of them up to :data:`REF_ROWS`, else the
    first, the last and a seeded random sample (every row's output is checked to be finite)."""
    if case.b <= REF_ROWS:
        return np.arange(case.b)
    rest = np.random.default_rng(seed).choice(np.arange(1, case.b - 1), REF_ROWS - 2, replace=False)
    return np.sort(np.concatenate([[0, case.b - 1], rest]))


def _checked(plan, rows):
    """One program: the plan's ``(out, lse)`` at batch rows ``rows``, whether every row's output
    is finite, and the reference's ``(out, lse)`` at those rows."""
    idx = jnp.asarray(rows)

    @jax.jit
    def f(q, pk, pv, sk, sv, sl, s2p, plen):
        out, lse = _call(plan)(q, pk, pv, sk, sv, sl, s2p, plen)
        ref_out, ref_lse = _call(impl="reference")(q[idx], pk, pv, sk[idx], sv[idx], sl[idx],
                                                   s2p[idx], plen)
        return (out[idx].astype(jnp.float32), lse[idx], jnp.isfinite(out).all(),
                ref_out.astype(jnp.float32), ref_lse)
    return f


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_gpu_planned_leaf_matches_reference(case, results_log):
    dev = device_info()
    plan = plan_for(case, dev)
    leaf = "+".join(sorted({type(ch.leaf).__name__ for ch in plan.chunks}))
    if "H200" in dev.name:   # the sample was planned with the H200 profile
        assert leaf == case.leaf
    seed = len(case.id)
    rows = checked_rows(case, seed)
    out, lse, finite, ref_out, ref_lse = jax.device_get(
        _checked(plan, rows)(*_inputs(case, seed)))
    err = rel_err(out, ref_out)
    fin = np.isfinite(ref_lse)
    lse_err = float(np.abs(lse[fin] - ref_lse[fin]).max()) if fin.any() else 0.0
    results_log(case=case.id, leaf=leaf, rel_err=err, lse_abs_err=lse_err, jax=jax.__version__)
    assert finite, "NaN past a length reached the output"
    assert err < 2e-2, err
    np.testing.assert_array_equal(np.isfinite(lse), fin)
    assert lse_err < 2e-2, lse_err
