"""Inter-sequence batched prefix attention and the two-launch shared forward (interpret mode)."""
import numpy as np
import jax.numpy as jnp
import pytest

from pallas_kernels.decode_attention import merge_partials
from pallas_kernels.prefix_attention import prefix_config, prefix_partials, shared_prefix_forward
from test_decode_attention import _check, _pool, rows_oracle


@pytest.mark.parametrize("num_splits", [1, 3])
def test_prefix_partials_grouped_rows_across_blocks(num_splits):
    rng = np.random.default_rng(num_splits)
    hkv, m, d, g = 2, 64, 16, 3
    k, v = _pool(rng, g, 72, hkv, d, jnp.float32)
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
    _check(o, lse, ro, rl, 1e-5)


def test_prefix_config_fills_gpu_and_splits_small_batches():
    small = prefix_config(batch=8, rows_per_seq=8, heads_kv=1, prefix_len=4096)
    assert small["num_splits"] > 1 and small["block_m"] >= 16
    big = prefix_config(batch=1024, rows_per_seq=4, heads_kv=8, prefix_len=4096)
    assert big["num_splits"] == 1 and big["block_m"] == 128 and big["two_phase"]


def test_mgpu_suffix_splits_rule():
    from pallas_kernels.prefix_attention import default_suffix_splits, mgpu_suffix_splits
    assert default_suffix_splits(256, 1, 1024) == 2        # 256 programs < 264: split
    assert mgpu_suffix_splits(256, 1, 1024) == 1           # Mosaic GPU path: not at 256
    assert mgpu_suffix_splits(128, 1, 1024) == default_suffix_splits(128, 1, 1024) > 1
    assert mgpu_suffix_splits(16, 8, 64) == 1               # one 128-key chunk: nothing to split


@pytest.mark.parametrize("tq,hq,hkv,g,suffix_splits,variant", [
    (1, 8, 1, 3, 1, "fused"), (4, 4, 2, 0, 2, "fused"), (4, 8, 2, 3, 1, "overlap"),
    (1, 8, 1, 3, 2, "overlap"), (4, 4, 2, 0, 3, "overlap")])
def test_shared_forward_forced_splits(tq, hq, hkv, g, suffix_splits, variant):
    from test_shared_prefix import check, make_case, oracle
    from jax_prefix_attn.shared_prefix import row_limits
    args, kw, meta = make_case(12 + tq, b=5, tq=tq, hq=hq, hkv=hkv, d=16, g=g, p=48, s=20,
                               suffix_lengths=[0, 20, 2, 7, 1])
    q, pk, pv, sk, sv = args
    pk4 = pk if pk.ndim == 4 else pk[None]
    pv4 = pv if pv.ndim == 4 else pv[None]
    s2p = kw.get("seq_to_prefix", jnp.zeros((5,), jnp.int32))
    plen = kw.get("prefix_lengths", jnp.full((1,), 48, jnp.int32))
    lim_p, lim_s = row_limits(tq, plen[s2p], kw["suffix_lengths"])
    cfg = dict(block_m=16, block_k=16, num_splits=2, num_warps=4, num_stages=2)
    out, lse = shared_prefix_forward(q, pk4, pv4, sk, sv, s2p, lim_p, lim_s, scale=0.25,
                                     interpret=True, prefix_cfg=cfg, suffix_block_k=16,
                                     suffix_splits=suffix_splits, variant=variant)
    check(out, lse, oracle(args, kw, meta), jnp.float32)


@pytest.mark.parametrize("hq,hkv,variant,suffix_splits", [
    (8, 1, "overlap", 1), (8, 2, "overlap", 2), (4, 4, "fused", 1), (8, 1, "fused", 2)])
def test_decode_one_prefix_length_given(hq, hkv, variant, suffix_splits):
    """Decoding with one prefix of ragged length (37 of 48 keys, NaN past it): the shared path
    given ``prefix_len_g`` (no per-row metadata arrays; the overlap kernel broadcasts the one
    prefix length and each sequence's suffix length to its rows) gives the same result, bit for
    bit, as with the per-row limits only, and matches the oracle."""
    from test_shared_prefix import check, make_case, oracle
    args, kw, meta = make_case(31 + hq, b=5, tq=1, hq=hq, hkv=hkv, d=16, g=1, p=48, s=20,
                               suffix_lengths=[0, 20, 2, 7, 1], prefix_lengths=[37])
    q, pk, pv, sk, sv = args
    pk = pk.at[:, 37:].set(jnp.nan)
    pv = pv.at[:, 37:].set(jnp.nan)
    s2p = kw["seq_to_prefix"]
    lim_p, lim_s = kw["prefix_lengths"][s2p][:, None], kw["suffix_lengths"][:, None]
    cfg = dict(block_m=16, block_k=16, num_splits=2, num_warps=4, num_stages=2)
    outs = [shared_prefix_forward(q, pk, pv, sk, sv, s2p, lim_p, lim_s, scale=0.25,
                                  interpret=True, prefix_cfg=cfg, suffix_block_k=16,
                                  suffix_splits=suffix_splits, variant=variant, prefix_len_g=plg)
            for plg in (None, kw["prefix_lengths"])]
    np.testing.assert_array_equal(np.asarray(outs[0][0]), np.asarray(outs[1][0]))
    np.testing.assert_array_equal(np.asarray(outs[0][1]), np.asarray(outs[1][1]))
    check(*outs[1], oracle((q, pk.at[:, 37:].set(0), pv.at[:, 37:].set(0), sk, sv), kw, meta),
          jnp.float32)
