"""Program tiles of the tree kernels under a device's shared memory
(pallas_kernels.tree_attention_tiles): the estimates bound Triton's allocations; every tree
kernel of a long-node token forest's forward and backward fits an H100 (float32 / bfloat16,
head_dim 64 / 128, nodes up to 2,048 tokens); split tiles give the whole tiles' results
(interpret mode) and lower for CUDA; the suffix launch of long query blocks matches the oracle."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import concat_oracle, lower_for_cuda, rel_err, tiny_config
from helpers import tree_inputs as make_inputs
from jax_prefix_attn import PrefixTree, build_tree_metadata, tree_attention
from jax_prefix_attn.device import H100_SXM
from jax_prefix_attn.tree_layout import pad_pool, q_sorted, row_tables
from jax_prefix_attn.tree_paths import SUFFIX_MAX_BLOCK_M
from models import Llama, LlamaConfig
from models.training.tree_logprobs import tree_layout
from pallas_kernels.tree_attention import tree_partials
from pallas_kernels.tree_attention_tiles import (MIN_TILE, dkv_rows, dkv_smem, dq_smem, dq_tile, partials_smem,
                                                 partials_tile)

F32, BF16 = jnp.float32, jnp.bfloat16
SMEM = H100_SXM.smem_per_block

# ``ttg.shared`` bytes Triton allocates for the kernels lowered for sm_90 (num_stages=2, the
# kernels' warps): (estimate, its arguments, allocated).  The first is the request of the
# forward kernel that ran a whole 640-token node's query block as one tile.
TRITON_ALLOCATED = [
    (partials_smem, (4096, 128, 64, F32), 3246080),
    (partials_smem, (128, 128, 64, F32), 197120),
    (partials_smem, (128, 128, 128, F32), 327680),
    (partials_smem, (64, 128, 128, F32), 263680),
    (partials_smem, (16, 256, 64, F32), 220288),
    (partials_smem, (128, 128, 256, BF16), 327680),
    (partials_smem, (64, 256, 256, BF16), 560128),
    (dkv_smem, (128, 32, 256, F32), 346112),
    (dkv_smem, (256, 32, 128, F32), 331776),
    (dkv_smem, (16, 32, 64, BF16), 13568),
    (dq_smem, (64, 128, 32, 128, F32), 231424),
    (dq_smem, (16, 256, 32, 256, F32), 626688),
    (dq_smem, (64, 256, 32, 256, BF16), 364544),
]


@pytest.mark.parametrize("fn, args, allocated", TRITON_ALLOCATED)
def test_estimates_bound_triton_allocations(fn, args, allocated):
    assert allocated <= fn(*args)
    assert args[-1] == BF16 or fn(*args) <= 1.3 * allocated    # float32: a close bound


def test_tiles_fit_divide_and_keep_the_item_tile_when_it_fits():
    for dtype in (F32, BF16):
        for d in (16, 64, 128, 256):
            for bm in (16, 64, 128, 512, 4096):
                for c in (16, 64, 128, 256):
                    rows, cols = partials_tile(bm, c, d, dtype, SMEM)
                    assert partials_smem(rows, cols, d, dtype) <= SMEM
                    assert bm % rows == 0 and c % cols == 0 and min(rows, cols) >= MIN_TILE
                    assert (rows, cols) == (bm, c) or partials_smem(bm, c, d, dtype) > SMEM
                    r = dkv_rows(bm, 32, d, dtype, SMEM)
                    assert dkv_smem(r, 32, d, dtype) <= SMEM and bm % r == 0
                    assert r == bm or dkv_smem(2 * r, 32, d, dtype) > SMEM
                    if c >= 32:
                        rq, step, bq = dq_tile(bm, c, 32, d, dtype, SMEM)
                        assert dq_smem(rq, step, bq, d, dtype) <= SMEM and bm % rq == 0 and c % step == 0
                        assert (rq, step, bq) == (bm, c, 32) or dq_smem(bm, c, 32, d, dtype) > SMEM
    assert partials_tile(4096, 128, 64, F32, None) == (4096, 128)
    assert partials_tile(4096, 128, 64, F32, SMEM) == (128, 128)      # the rows of a whole 640-token node
    assert partials_tile(128, 128, 128, F32, SMEM) == (128, 64)
    with pytest.raises(ValueError, match="no forward tile fits smem_bytes=1000"):
        partials_tile(64, 64, 64, F32, 1000)
    with pytest.raises(ValueError, match="no dK/dV tile fits"):
        dkv_rows(64, 32, 64, F32, 1000)
    with pytest.raises(ValueError, match="no dQ tile fits"):
        dq_tile(64, 64, 32, 64, F32, 1000)
    # 101,376 bytes per CTA (compute capability 8.6 / 8.9 / 12.0): float32 head_dim 256 fits with
    # 16-column dQ slices
    assert dq_tile(128, 64, 32, 256, F32, 101376) == (16, 16, 16)
    assert dq_smem(16, 16, 16, 256, F32) <= 101376 < dq_smem(16, 32, 32, 256, F32)


# ----------------------------------------------------------------- every kernel of a long-node layout

FORESTS = {  # (parents, node lengths) of token forests whose nodes are hundreds of tokens long
    "depth4": ([-1, 0, 0, 1, 1, 2, 3, 3, 4, 5], [600, 150, 1, 90, 257, 33, 1, 120, 64, 200]),
    "long2048": ([-1, 0, 0, 1], [2048, 2048, 5, 700]),
}


def _walk(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs in its equations' parameters."""
    for eqn in jaxpr.eqns:
        yield eqn
        for v in eqn.params.values():
            for x in (v if isinstance(v, (tuple, list)) else (v,)):
                sub = x if hasattr(x, "eqns") else getattr(x, "jaxpr", None)
                if hasattr(sub, "eqns"):
                    yield from _walk(sub)


def _kernel_estimates(closed):
    """``[(kernel name, estimated shared memory)]`` of every tree kernel launch in ``closed``
    (checking that no forward item holds more than ``SUFFIX_MAX_BLOCK_M`` query vectors, the
    schedules' default and the suffix launch's bound), from the program tile its dots show: the forward's first dot is ``q [rows, D] @ k [cols,
    D]^T``, dK/dV's ``k [bk, D] @ q [rows, D]^T``, dQ's ``q [rows, D] @ k [bq, D]^T`` three dots
    per ``bq``-key slice of a step."""
    out = []
    for eqn in _walk(closed.jaxpr):
        if eqn.primitive.name != "pallas_call":
            continue
        name = str(eqn.params.get("name", eqn.params.get("name_and_src_info")))
        dots = [e for e in _walk(eqn.params["jaxpr"]) if e.primitive.name == "dot_general"]
        a, b = (v.aval for v in dots[0].invars)
        dtype, d = a.dtype, a.shape[1]
        if name.startswith("tree_partials"):
            assert eqn.params["out_avals"][0].shape[2] <= SUFFIX_MAX_BLOCK_M     # an item's query vectors
            out.append((name, partials_smem(a.shape[0], b.shape[0], d, dtype)))
        elif name == "tree_grads_dkv":
            out.append((name, dkv_smem(b.shape[0], a.shape[0], d, dtype)))
        elif name == "tree_grads_dq":
            out.append((name, dq_smem(a.shape[0], len(dots) // 3 * b.shape[0], b.shape[0], d, dtype)))
    return out


@pytest.mark.parametrize("forest", sorted(FORESTS))
def test_every_tree_kernel_of_long_nodes_fits_an_h100(forest):
    """Forward and backward of tree attention as ``models.tree_completion_logprobs`` calls it on
    the GPU (pool = every node's row, each row its own suffix; the tree schedule, the suffix
    launch and the backward kernels)."""
    parents, lengths = FORESTS[forest]
    for dtype in (F32, BF16):
        for d in (64, 128):
            cfg = tiny_config(max_position_embeddings=8192, hidden_size=256, num_attention_heads=8,
                              num_key_value_heads=2, head_dim=d, intermediate_size=512, vocab_size=512)
            layout = tree_layout(Llama(LlamaConfig.from_hf_config(dict(cfg, model_type="llama"))), parents, lengths)
            m, t = layout.shape
            full = jnp.full((m,), t, jnp.int32)

            def loss(q, k, v):
                pk, pv = (x.reshape(m * t, 2, d) for x in (k, v))
                out = tree_attention(q, layout.meta, pk, pv, k, v, suffix_lengths=full, platform="gpu")
                return out.astype(F32).sum()

            s = jax.ShapeDtypeStruct
            closed = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(
                s((m, t, 8, d), dtype), s((m, t, 2, d), dtype), s((m, t, 2, d), dtype))
            est = _kernel_estimates(closed)
            names = {n for n, _ in est}
            assert {"tree_partials_node", "tree_grads_dkv", "tree_grads_dq"} <= names, names
            over = [(n, e) for n, e in est if e > SMEM]
            assert not over, (forest, dtype.__name__, d, over)


# ----------------------------------------------------------------- split tiles, interpret mode

def _sorted_forward_inputs(tree, *, tq, hq, hkv, d, seed, block_kv):
    q, kp, vp, _, _, _ = make_inputs(tree, tq=tq, hq=hq, hkv=hkv, d=d, smax=0, seed=seed)
    meta = jax.tree_util.tree_map(jnp.asarray, build_tree_metadata(
        tree, tq=tq, group=hq // hkv, pool_size=kp.shape[0], block_kv=block_kv, device=False))
    key, lim = row_tables(meta, jnp.zeros((tree.num_seqs,), jnp.int32))
    kp, vp = pad_pool(kp, vp, block_kv)
    g = hq // hkv
    return meta, (q_sorted(q, meta, hkv), kp, vp), (jnp.repeat(key, g), jnp.repeat(lim, g))


@pytest.mark.parametrize("schedule", ["flatten", "nodes"])
def test_split_forward_tiles_match_the_whole_tiles(schedule):
    """Rows over several programs and keys in 16-key steps (the tile of a 1-byte budget's
    smallest) give the whole tile's partial states."""
    tree = PrefixTree.from_nested([[37, [20, 3, 9], 6], 25], seqs_per_leaf=3)
    meta, (q, kp, vp), (key, lim) = _sorted_forward_inputs(tree, tq=4, hq=4, hkv=2, d=16, seed=2, block_kv=64)
    sched = meta.flatten if schedule == "flatten" else meta.nodes
    assert sched.block_rows * 2 >= 32                       # at least two 16-row programs per item

    def run(smem):
        return tree_partials(q, kp, vp, sched.items, sched.tok, sched.chunk_start, key, lim, mode=sched.mode,
                             group=2, block_rows=sched.block_rows, block_kv=sched.block_kv, sm_scale=0.3,
                             interpret=True, smem_bytes=smem)

    small = partials_smem(16, 16, 16, F32)
    assert partials_tile(sched.block_rows * 2, 64, 16, F32, small) == (16, 16)
    (o_w, l_w), (o_s, l_s) = jax.jit(lambda: (run(None), run(small)))()
    np.testing.assert_array_equal(np.isfinite(l_w), np.isfinite(l_s))
    fin = np.isfinite(np.asarray(l_w))
    assert fin.any() and rel_err(np.asarray(l_s)[fin], np.asarray(l_w)[fin]) < 1e-6
    assert rel_err(o_s, o_w) < 1e-6


def test_split_forward_tiles_lower_for_cuda():
    tree = PrefixTree.from_nested([[37, [20, 3, 9], 6], 25], seqs_per_leaf=3)
    meta, args, (key, lim) = _sorted_forward_inputs(tree, tq=4, hq=4, hkv=2, d=16, seed=2, block_kv=64)
    for sched in (meta.flatten, meta.nodes):
        f = jax.jit(lambda *a, s=sched: tree_partials(
            *a, s.items, s.tok, s.chunk_start, key, lim, mode=s.mode, group=2, block_rows=s.block_rows,
            block_kv=s.block_kv, sm_scale=0.3, smem_bytes=partials_smem(16, 16, 16, F32)))
        assert f"tree_partials_{sched.mode}" in lower_for_cuda(f, *args)


@pytest.mark.parametrize("interpret", [False, True])
def test_long_query_blocks_through_the_suffix_launch(interpret):
    """Tq * G = 160 query vectors per sequence: the suffix launch cuts them into 128-vector
    blocks, each stopping at its last visible key tile; against the concatenation oracle
    (the kernels in interpret mode, or the pure-JAX mirror of the same items)."""
    tree = PrefixTree(parents=[-1, 0, 0], starts=[0, 30, 45], lengths=[30, 15, 9], leaf_of_seq=[1, 2, 0])
    q, kp, vp, sk, sv, _ = make_inputs(tree, tq=40, hq=4, hkv=1, d=16, smax=70, seed=4)
    sl = jnp.asarray([70, 41, 23], jnp.int32)       # (23 < Tq: early rows see no suffix)
    meta = build_tree_metadata(tree, tq=40, group=4, pool_size=kp.shape[0], block_kv=16)
    out, lse = jax.jit(lambda m, *a: tree_attention(a[0], m, *a[1:], suffix_lengths=sl, impl="flatten",
                                                    interpret=interpret, return_lse=True))(meta, q, kp, vp, sk, sv)
    ref_out, ref_lse = concat_oracle(tree, q, kp, vp, sk, sv, sl)
    assert rel_err(out, ref_out) < 1e-5
    assert rel_err(lse, ref_lse) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 256])
def test_gpu_float32_wide_heads_and_long_query_blocks(d):
    """Compiled, float32: head_dim 128 / 256 (program tiles split to fit the device's shared
    memory) with Tq * G = 160 query vectors per sequence (suffix items of 128); the outputs and
    the kernel gradients of a random projection of ``(out, lse)`` against the reference."""
    tree = PrefixTree.from_nested([[300, [40, 20, 7], 90]], seqs_per_leaf=3)
    q, kp, vp, sk, sv, _ = make_inputs(tree, tq=40, hq=8, hkv=2, d=d, smax=60, seed=6)
    sl = jnp.asarray(np.random.default_rng(6).integers(20, 61, tree.num_seqs), jnp.int32)
    rng = np.random.default_rng(7)
    w_o = jnp.asarray(rng.standard_normal(q.shape, np.float32))
    w_l = jnp.asarray(rng.standard_normal(q.shape[:3], np.float32))

    def value_and_grads(impl):
        def f(*x):
            o, l = tree_attention(x[0], tree, *x[1:], suffix_lengths=sl, impl=impl, return_lse=True)
            return jnp.sum(o * w_o) + jnp.sum(jnp.where(jnp.isfinite(l), l, 0.0) * w_l), (o, l)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4), has_aux=True))(q, kp, vp, sk, sv)

    (_, (ref_o, ref_l)), ref_g = value_and_grads("reference")
    for impl in ("flatten", "levelwise"):
        (_, (o, l)), g = value_and_grads(impl)
        assert rel_err(o, ref_o) < 1e-4 and rel_err(l, ref_l) < 1e-4, impl
        for a, w in zip(g, ref_g):
            assert np.isfinite(np.asarray(a)).all() and rel_err(a, w) < 1e-4, (impl, rel_err(a, w))
