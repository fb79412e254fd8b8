"""Inter-sequence batched prefix attention and the Triton shared-family leaves (interpret mode)."""
import numpy as np
import jax.numpy as jnp
import pytest

from pallas_kernels._common import merge_partials
from jax_prefix_attn import shared_prefix_attention
from jax_prefix_attn.device import H100_SXM
from jax_prefix_attn.leaf_plans import prefix_tiling
from jax_prefix_attn.plans import PrefixTiling, SuffixTiling
from pallas_kernels.prefix_attention import prefix_partials
from helpers import forced_plan
from helpers import check, check_rows, kv_pool, make_case, oracle, rows_oracle


@pytest.mark.parametrize("num_splits", [1, 3])
def test_prefix_partials_grouped_rows_across_blocks(num_splits):
    rng = np.random.default_rng(num_splits)
    hkv, m, d, g = 2, 64, 16, 3
    k, v = kv_pool(rng, g, 72, hkv, d, jnp.float32)
    # Rows sorted by group; group boundaries fall inside 32-row blocks; group 1 is empty of rows.
    grp = np.array([0] * 20 + [2] * 44, np.int32)
    lim = rng.integers(0, 73, size=m).astype(np.int32)
    lim[[0, 21, 63]] = [72, 0, 72]
    q = jnp.asarray(rng.standard_normal((hkv, m, d), np.float32))
    o, lse = prefix_partials(q, k, v, jnp.asarray(grp), jnp.asarray(lim), scale=0.2, block_m=32,
                             block_k=16, num_splits=num_splits, num_warps=4, num_stages=2,
                             interpret=True)
    assert o.shape == (num_splits, hkv, m, d)
    o, lse = merge_partials(o, lse)
    ro, rl = rows_oracle(q, [(k, v, grp, lim)], 0.2)
    check_rows(o, lse, ro, rl, 1e-5)


def test_prefix_config_fills_gpu_and_splits_small_batches():
    target = 2 * H100_SXM.sm_count
    small = prefix_tiling(batch=8, rows_per_seq=8, heads_kv=1, prefix_len=4096, target=target)
    assert small.num_splits > 1 and small.block_m >= 16
    big = prefix_tiling(batch=1024, rows_per_seq=4, heads_kv=8, prefix_len=4096, target=target)
    assert big.num_splits == 1 and big.block_m == 128 and big.two_phase


CFG = PrefixTiling(block_m=16, block_k=16, num_splits=2, num_warps=4, num_stages=2)


def _leaf_fields(path, suffix_splits):
    if path == "triton_two_launch":
        return dict(prefix=CFG, suffix_splits=suffix_splits, suffix=SuffixTiling(16, 4, 3))
    return dict(prefix=CFG, suffix_splits=suffix_splits, suffix_block_k=16)


@pytest.mark.parametrize("tq,hq,hkv,g,suffix_splits,variant", [
    (1, 8, 1, 3, 1, "fused"), (4, 4, 2, 0, 2, "fused"), (4, 8, 2, 3, 1, "overlap"),
    (1, 8, 1, 3, 2, "overlap"), (4, 4, 2, 0, 3, "overlap")])
def test_shared_forward_forced_splits(tq, hq, hkv, g, suffix_splits, variant):
    from helpers import check, make_case, oracle
    args, kw, meta = make_case(12 + tq, b=5, tq=tq, hq=hq, hkv=hkv, d=16, g=g, p=48, s=20,
                               suffix_lengths=[0, 20, 2, 7, 1])
    path = "triton_two_launch" if variant == "fused" else "triton_overlap"
    plan = forced_plan(args[0], args[1], args[3], path, **_leaf_fields(path, suffix_splits))
    out, lse = shared_prefix_attention(*args, **kw, sm_scale=0.25, return_lse=True, plan=plan,
                                       interpret=True)
    check(out, lse, oracle(args, kw, meta), jnp.float32)


@pytest.mark.parametrize("hq,hkv,variant,suffix_splits", [
    (8, 1, "overlap", 1), (8, 2, "overlap", 2), (4, 4, "fused", 1), (8, 1, "fused", 2)])
def test_decode_one_prefix_length_given(hq, hkv, variant, suffix_splits):
    """Decoding with one prefix of ragged length (37 of 48 keys, NaN past it): the shared leaves
    take the one prefix length as it is (no per-row metadata arrays; the overlap kernel
    broadcasts the one prefix length and each sequence's suffix length to its rows) and match
    the oracle."""
    from helpers import check, make_case, oracle
    args, kw, meta = make_case(31 + hq, b=5, tq=1, hq=hq, hkv=hkv, d=16, g=1, p=48, s=20,
                               suffix_lengths=[0, 20, 2, 7, 1], prefix_lengths=[37])
    q, pk, pv, sk, sv = args
    pk = pk.at[:, 37:].set(jnp.nan)
    pv = pv.at[:, 37:].set(jnp.nan)
    path = "triton_two_launch" if variant == "fused" else "triton_overlap"
    plan = forced_plan(q, pk, sk, path, **_leaf_fields(path, suffix_splits))
    out = shared_prefix_attention(q, pk, pv, sk, sv, **kw, sm_scale=0.25, return_lse=True,
                                  plan=plan, interpret=True)
    check(*out, oracle((q, pk.at[:, 37:].set(0), pv.at[:, 37:].set(0), sk, sv), kw, meta),
          jnp.float32)


def test_overlap_partials_refuses_16_row_blocks_when_compiled():
    from pallas_kernels.overlap_attention import overlap_partials
    z = jnp.zeros((1, 16, 64), jnp.bfloat16)
    kv = jnp.zeros((1, 64, 1, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="block_m must be at least 32 when compiled, got 16"):
        overlap_partials(z, None, jnp.zeros((1,), jnp.int32), kv, kv, z, None,
                         jnp.zeros((1,), jnp.int32), kv, kv, scale=0.125, block_m=16, block_k=16,
                         num_splits=1, r16=16)
