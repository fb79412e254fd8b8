"""Ragged split-KV attention kernel (pallas_kernels.decode_attention), interpret mode on CPU."""
import numpy as np
import jax.numpy as jnp
import pytest

from pallas_kernels._common import merge_partial_list, merge_partials, pad_rows, row_meta, seq_rows
from pallas_kernels.decode_attention import Source, ragged_attention
from jax_prefix_attn import plan_shared_prefix, shared_prefix_attention
from jax_prefix_attn.device import H100_SXM
from jax_prefix_attn.leaf_plans import busy_splits
from helpers import check, check_rows, forced_plan, kv_pool, make_case, oracle, rel_err, rows_oracle


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_two_sources_mixed_entries_and_splits(num_splits, dtype):
    rng = np.random.default_rng(num_splits)
    hkv, m, d, block_m = 2, 32, 16, 16
    k1, v1 = kv_pool(rng, 3, 50, hkv, d, dtype)   # S % block_k != 0: masked loads
    k2, v2 = kv_pool(rng, 4, 64, hkv, d, dtype)
    # Rows of one block read different pool entries (several groups in a block).
    idx1 = rng.integers(0, 3, size=m).astype(np.int32)
    idx2 = np.sort(rng.integers(0, 4, size=m)).astype(np.int32)
    lim1 = rng.integers(0, 51, size=m).astype(np.int32)
    lim2 = rng.integers(0, 65, size=m).astype(np.int32)
    lim1[:3] = [0, 50, 1]
    lim2[:3] = [0, 0, 64]   # row 0 sees no key at all
    q = jnp.asarray(rng.standard_normal((hkv, m, d), np.float32)).astype(dtype)
    srcs = [Source(k1, v1, jnp.asarray(idx1), jnp.asarray(lim1)),
            Source(k2, v2, jnp.asarray(idx2), jnp.asarray(lim2))]
    kw = dict(scale=0.3, block_m=block_m, block_k=16, num_splits=num_splits, interpret=True)
    if num_splits == 1:
        o, lse = ragged_attention(q, srcs, finalize=True, out_dtype=dtype, **kw)
        assert o.dtype == dtype
    else:
        po, pl_ = ragged_attention(q, srcs, finalize=False, **kw)
        assert po.shape == (num_splits, hkv, m, d) and po.dtype == jnp.float32
        o, lse = merge_partials(po, pl_)
    ro, rl = rows_oracle(q, [(k1, v1, idx1, lim1), (k2, v2, idx2, lim2)], 0.3)
    check_rows(o, lse, ro, rl, 1e-5 if dtype == jnp.float32 else 2e-2)


def test_fused_merge_epilogue_with_incoming_partials():
    rng = np.random.default_rng(7)
    hkv, m, d, block_m, n_in, stride = 2, 32, 16, 16, 2, 8
    k, v = kv_pool(rng, 2, 40, hkv, d, jnp.float32)
    idx = np.repeat(np.arange(2), 16).astype(np.int32)
    lim = rng.integers(0, 41, size=m).astype(np.int32)
    lim[0] = 0
    q = jnp.asarray(rng.standard_normal((hkv, m, d), np.float32))
    m_in = 2 * stride + block_m
    o_in = rng.standard_normal((n_in, hkv, m_in, d)).astype(np.float32)
    lse_in = rng.standard_normal((n_in, hkv, m_in)).astype(np.float32)
    lse_in[0, :, 1] = -np.inf      # an empty incoming partial ...
    o_in[0, :, 1] = np.nan         # ... whose garbage must be ignored
    lse_in[:, :, 0] = -np.inf      # row 0: nothing anywhere -> lse -inf, out 0
    o, lse = ragged_attention(q, [Source(k, v, jnp.asarray(idx), jnp.asarray(lim))], scale=0.25,
                              block_m=block_m, block_k=16, incoming=(jnp.asarray(o_in),
                              jnp.asarray(lse_in)), in_stride=stride, finalize=True,
                              interpret=True)
    ro, rl = rows_oracle(q, [(k, v, idx, lim)], 0.25)
    # Expected: merge own state with incoming rows [rb * stride + i] for row rb * block_m + i.
    rows_in = (np.arange(m) // block_m) * stride + np.arange(m) % block_m
    parts_o = np.stack([ro] + [o_in[i][:, rows_in] for i in range(n_in)])
    parts_l = np.stack([rl] + [lse_in[i][:, rows_in] for i in range(n_in)])
    eo, el = merge_partials(jnp.asarray(parts_o, jnp.float32), jnp.asarray(parts_l, jnp.float32))
    check_rows(o, lse, np.asarray(eo), np.asarray(el), 1e-5)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_flat_forward_tq4_gqa(num_splits):
    args, kw, meta = make_case(11, b=3, tq=4, hq=8, hkv=2, d=16, g=2, p=40, s=24,
                               suffix_lengths=[0, 24, 5])
    plan = forced_plan(args[0], args[1], args[3], "flat_rows", block_k=16, num_splits=num_splits)
    out, lse = shared_prefix_attention(*args, **kw, sm_scale=0.25, return_lse=True, plan=plan,
                                       interpret=True)
    check(out, lse, oracle(args, kw, meta), jnp.float32)


@pytest.mark.parametrize("layout", ["own", "rows", "auto"])
@pytest.mark.parametrize("num_splits", [1, 3, 17])
@pytest.mark.parametrize("hq,hkv,g", [(8, 2, 2), (8, 1, 0), (6, 6, 3)])
def test_flat_forward_decode_layouts(layout, num_splits, hq, hkv, g):
    """Decoding (Tq=1) on the flat path in both layouts and by the planner's rule: one prefix or
    ragged groups, suffix lengths 0 and S_max, key splits that leave some chunks empty; against
    the reference over the explicit concatenation."""
    args, kw, meta = make_case(12 + hq + g, b=4, tq=1, hq=hq, hkv=hkv, d=16, g=g, p=70, s=40,
                               suffix_lengths=[0, 40, 5, 17])
    q, pk, pv, sk, sv = args
    if layout == "auto":
        plan = plan_shared_prefix(
            batch=4, tq=1, heads_q=hq, heads_kv=hkv, head_dim=16, groups=max(g, 1), prefix_len=70,
            suffix_len=40, dtype=q.dtype, impl="flat", device=H100_SXM, interpret=True)
    elif layout == "own":
        plan = forced_plan(q, pk, sk, "flat_own", num_splits=num_splits)
    else:
        plan = forced_plan(q, pk, sk, "flat_rows", block_k=16, num_splits=num_splits)
    out, lse = shared_prefix_attention(*args, **kw, sm_scale=0.25, return_lse=True, plan=plan,
                                       interpret=True)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:3]
    check(out, lse, oracle(args, kw, meta), jnp.float32)


def test_flat_decode_layout_and_tiling_rules():
    def flat(b, hq, hkv, p, s):
        return plan_shared_prefix(batch=b, tq=1, heads_q=hq, heads_kv=hkv, head_dim=128,
                                  groups=1, prefix_len=p, suffix_len=s, dtype=jnp.bfloat16,
                                  impl="flat", device=H100_SXM).chunks[0].leaf
    # 16 programs: 17 splits (>= 64 keys each, 2 programs per SM of 132) of 64-key tiles, of
    # which the kernel fills 16 (a 1024-key prefix in 64-key chunks): 16 splits
    own = flat(16, 8, 1, 1024, 128)
    assert own.path == "flat_own" and own.num_splits == 16 and own.tiling.block_k == 64
    assert busy_splits(1024, 128, 17, 64) == 16 and busy_splits(1024, 128, 16, 64) == 16
    one = flat(1, 8, 1, 16384, 64)           # 1 program: 257 splits of 64 keys capped at 64
    assert one.path == "flat_own" and one.num_splits == 64 and one.tiling.block_k == 128
    assert flat(16, 32, 8, 16384, 256).path == "flat_rows"   # 3 splits of a 16K prefix
    wide = flat(64, 32, 8, 8192, 128)                        # 512 programs: 64-key tiles
    assert wide.path == "flat_own" and wide.tiling.block_k == 64
    many = flat(1024, 32, 8, 4096, 128)
    assert (many.tiling.block_k, many.tiling.num_warps, many.tiling.num_stages) == (32, 2, 3)


@pytest.mark.parametrize("num_splits,two_phase", [(1, True), (2, True), (2, False)])
def test_unmasked_full_tiles_then_masked_tail(num_splits, two_phase):
    """One pool entry per row block and limits >= several tiles: the kernel runs the tiles every
    row sees without masks, then the ragged tail with masks."""
    rng = np.random.default_rng(30 + num_splits)
    hkv, m, d, block_m = 2, 32, 16, 16
    k, v = kv_pool(rng, 2, 80, hkv, d, jnp.float32)
    idx = np.repeat(np.arange(2), 16).astype(np.int32)
    lim = rng.integers(37, 81, size=m).astype(np.int32)
    lim[16:] = 80
    q = jnp.asarray(rng.standard_normal((hkv, m, d), np.float32))
    po, pl_ = ragged_attention(q, [Source(k, v, jnp.asarray(idx), jnp.asarray(lim))], scale=0.3,
                               block_m=block_m, block_k=16, num_splits=num_splits,
                               finalize=False, interpret=True, two_phase=two_phase)
    o, lse = merge_partials(po, pl_)
    ro, rl = rows_oracle(q, [(k, v, idx, lim)], 0.3)
    check_rows(o, lse, ro, rl, 1e-5)


def test_row_metadata_constants_and_broadcasts():
    """``seq_rows``: a NumPy constant for static per-sequence values (no device work), a broadcast
    otherwise; ``row_meta`` with one position equals it (and the general form)."""
    import jax
    idx = np.array([3, 0, 2], np.int32)
    out = seq_rows(idx, 4)
    assert isinstance(out, np.ndarray) and out.dtype == np.int32
    np.testing.assert_array_equal(out, np.repeat(idx, 4))
    order = jnp.array([2, 0, 1], jnp.int32)
    np.testing.assert_array_equal(np.asarray(seq_rows(idx, 4, order)), np.repeat(idx[[2, 0, 1]], 4))
    lim = jnp.array([[5], [0], [7]], jnp.int32)
    traced = jax.jit(lambda x: row_meta(x, 2, 4))(lim)
    np.testing.assert_array_equal(np.asarray(traced), [5] * 4 + [0] * 4 + [7] * 4)
    lim2 = jnp.array([[5, 6], [0, 1], [7, 8]], jnp.int32)  # two positions: the general form
    np.testing.assert_array_equal(np.asarray(row_meta(lim2, 2, 8)),
                                  [5, 5, 6, 6, 6, 6, 6, 6, 0, 0, 1, 1, 1, 1, 1, 1,
                                   7, 7, 8, 8, 8, 8, 8, 8])
    padded = pad_rows(out, 3, mode="edge")
    assert isinstance(padded, np.ndarray) and padded.tolist()[-4:] == [2, 2, 2, 2]
    assert np.asarray(pad_rows(jnp.asarray(out), 2, constant_values=9)).tolist()[-2:] == [9, 9]


@pytest.mark.parametrize("unroll", [32, 0])
def test_merge_partial_list_matches_float64(unroll):
    """The merge of partial states, as one elementwise expression over the parts and (``unroll``
    0) as the stacked reduction, against float64 NumPy; empty parts and all-empty rows included."""
    rng = np.random.default_rng(7)
    n, hkv, m, d = 5, 2, 6, 8
    o = rng.standard_normal((n, hkv, m, d)).astype(np.float32)
    lse = (3 * rng.standard_normal((n, hkv, m))).astype(np.float32)
    lse[1, 0, 2] = -np.inf
    lse[:, 1, 4] = -np.inf          # a row no part saw
    o[1, 0, 2] = np.nan             # an empty part's output must not leak (0 * NaN)
    mo, ml = merge_partial_list([jnp.asarray(o[i]).astype(jnp.bfloat16) if i == 3 else
                                 jnp.asarray(o[i]) for i in range(n)],
                                [jnp.asarray(lse[i]) for i in range(n)], unroll=unroll)
    o64, l64 = o.astype(np.float64), lse.astype(np.float64)
    o64[3] = np.asarray(jnp.asarray(o[3]).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    mx = np.max(l64, axis=0)
    mx = np.where(np.isfinite(mx), mx, 0.0)
    w = np.exp(l64 - mx)
    tot = w.sum(0)
    exp_o = np.where(tot[..., None] > 0, np.einsum("nhm,nhmd->hmd", w, np.nan_to_num(o64))
                     / np.where(tot > 0, tot, 1)[..., None], 0.0)
    exp_l = np.where(tot > 0, mx + np.log(np.where(tot > 0, tot, 1)), -np.inf)
    assert np.all(np.isfinite(np.asarray(mo)))
    check_rows(mo, ml, exp_o, exp_l, 1e-5)
    so, sl = merge_partials(jnp.asarray(np.nan_to_num(o64).astype(np.float32)), jnp.asarray(lse),
                            unroll=unroll)
    check_rows(so, sl, exp_o, exp_l, 1e-5)
