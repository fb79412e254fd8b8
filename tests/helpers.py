"""Helpers shared by several test files."""
import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_prefix_attn import PrefixTree, plan_shared_prefix, reference
from jax_prefix_attn.device import H100_SXM
from pallas_kernels._common import merge_partials
from models.tokenizer import bytes_to_unicode


# ------------------------------------------------------------------ tiny Llama files (models)
def tiny_config(**kw):
    cfg = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
               rope_theta=10000.0, max_position_embeddings=128, tie_word_embeddings=False)
    cfg.update(kw)
    return cfg


def tiny_state_dict(cfg, seed=0):
    rng = np.random.default_rng(seed)
    h, f, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nq, nkv, v = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]

    def r(*s):
        return (rng.standard_normal(s) * 0.1).astype(np.float32)

    sd = {"model.embed_tokens.weight": r(v, h), "model.norm.weight": 1 + r(h)}
    if not cfg["tie_word_embeddings"]:
        sd["lm_head.weight"] = r(v, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd.update({p + "input_layernorm.weight": 1 + r(h), p + "post_attention_layernorm.weight": 1 + r(h),
                   p + "self_attn.q_proj.weight": r(nq * d, h), p + "self_attn.k_proj.weight": r(nkv * d, h),
                   p + "self_attn.v_proj.weight": r(nkv * d, h), p + "self_attn.o_proj.weight": r(h, nq * d),
                   p + "mlp.gate_proj.weight": r(f, h), p + "mlp.up_proj.weight": r(f, h),
                   p + "mlp.down_proj.weight": r(h, f)})
    return sd


def write_tiny_gguf(path, *, seed: int, lm_head_scale: float, tensor_type=None) -> str:
    """A tiny random Llama checkpoint with the tiny tokenizer (:func:`tiny_tokenizer_meta`) written
    as GGUF to ``path``; the LM head scaled by ``lm_head_scale`` (peaked logits: greedy and
    sampled continuations differ visibly).  Returns ``str(path)``."""
    from models.gguf import write_llama_gguf  # noqa: PLC0415
    meta = tiny_tokenizer_meta()
    cfg = tiny_config(vocab_size=len(meta["tokens"]), bos_token_id=1, eos_token_id=2)
    sd = tiny_state_dict(cfg, seed=seed)
    sd["lm_head.weight"] = sd["lm_head.weight"] * lm_head_scale
    kw = {} if tensor_type is None else {"tensor_type": tensor_type}
    write_llama_gguf(path, cfg, sd, tokenizer=meta, **kw)
    return str(path)


def run_cli(argv, capsys):
    """``jpa-sample argv`` in this process: ``(exit status, stdout, stderr)``."""
    from models import cli  # noqa: PLC0415
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_error_line(rc, out, err, msg):
    """Status 2, nothing on stdout, and exactly `jpa-sample: error: ...msg...` on stderr."""
    assert rc == 2, err
    assert err.startswith("jpa-sample: error: ") and msg in err, err
    assert err.count("\n") == 1 and err.endswith("\n") and out == ""


# ------------------------------------------------------------------ Prompt Cache (models)
# A tiny model and a one-token-per-character tokenizer for the Prompt Cache tests.
PC_CONFIG = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2)


class ModTokenizer:
    """One token per character, scrambled into the tiny vocabulary (``PC_CONFIG``)."""

    def encode(self, text, add_special_tokens=True):
        return [(ord(c) * 7 + 3) % PC_CONFIG["vocab_size"] for c in text]


def numbered_schema(i, extra=""):
    """Schemas of equal shapes (one compiled encoding serves them all), distinct text."""
    from models.prompt_cache import module, param, schema  # noqa: PLC0415
    return schema(f"s{i}", f"Header {i}. ", module("a", f"Module a of schema {i}{extra}."),
                  module("b", "Some ", param("p", 2), f" text {i}."))


CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def tiny_tokenizer_meta():
    """GGUF tokenizer metadata of a tiny byte-level BPE: 3 control tokens, 256 bytes, 6 merges."""
    byte_chars = [bytes_to_unicode()[b] for b in range(256)]
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "o n"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + byte_chars + [m.replace(" ", "") for m in merges]
    return {"model": "gpt2", "pre": "smollm", "tokens": tokens,
            "token_types": [3, 3, 3] + [1] * (len(tokens) - 3), "merges": merges,
            "bos_token_id": 1, "eos_token_id": 2, "padding_token_id": 0, "add_bos_token": False,
            "chat_template": CHATML}


# ------------------------------------------------------------------ tree attention
# (n_trees, max_depth, max_branch, max_len): depth 1-4, branching 1-16, lengths 1-700.
TREE_FORESTS = [(3, 1, 0, 700), (2, 2, 16, 30), (2, 3, 4, 200), (1, 4, 2, 90)]


def random_forest(rng, n_trees, max_depth, max_branch, max_len, seqs_per_leaf=(1, 3)):
    """Random ``PrefixTree`` forest from a parent list (nodes shuffled so parents may follow
    children; some sequences hang from inner nodes)."""
    parents, lengths = [], []

    def grow(parent, depth):
        me = len(parents)
        parents.append(parent)
        lengths.append(int(rng.integers(1, max_len + 1)))
        if depth + 1 < max_depth:
            for _ in range(int(rng.integers(0, max_branch + 1))):
                grow(me, depth + 1)

    for _ in range(n_trees):
        grow(-1, 0)
    n = len(parents)
    perm = rng.permutation(n)                 # new index of old node i is inv[i]
    inv = np.argsort(perm)
    parents = [(-1 if parents[o] < 0 else int(inv[parents[o]])) for o in perm]
    lengths = [lengths[o] for o in perm]
    has_child = np.zeros(n, bool)
    for p in parents:
        if p >= 0:
            has_child[p] = True
    leaf_of_seq = []
    for u in range(n):
        if not has_child[u]:
            leaf_of_seq += [u] * int(rng.integers(seqs_per_leaf[0], seqs_per_leaf[1] + 1))
        elif rng.random() < 0.2:
            leaf_of_seq.append(u)
    leaf_of_seq = list(rng.permutation(leaf_of_seq))
    return PrefixTree.from_parents(parents, lengths, leaf_of_seq)


def tree_inputs(tree, *, tq, hq, hkv, d, smax, seed, dtype=None, extra_pool=7):
    """Random ``(q, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths)`` for ``tree``, drawn by
    NumPy (no random-number program to compile for each shape)."""
    dtype = jnp.float32 if dtype is None else dtype
    rng = np.random.default_rng(seed)
    b, n = tree.num_seqs, tree.pool_extent + extra_pool
    shapes = ((b, tq, hq, d), (n, hkv, d), (n, hkv, d), (b, smax, hkv, d), (b, smax, hkv, d))
    q, kp, vp, sk, sv = (jnp.asarray(rng.standard_normal(s, np.float32).astype(dtype)) for s in shapes)
    return q, kp, vp, sk, sv, jnp.asarray(rng.integers(0, smax + 1, b), jnp.int32)


_attention = jax.jit(reference.attention, static_argnames=("causal", "sm_scale"))


def concat_oracle(tree, q, kp, vp, sk, sv, sl, sm_scale=None, lmax=None):
    """Independent oracle of tree attention: per sequence, numpy-concatenate path spans and suffix
    (host), pad to a common length, then one ``reference.attention`` call with ``kv_lengths``."""
    kp, vp, sk, sv, sl = (np.asarray(x, np.float32) for x in (kp, vp, sk, sv, sl))
    ctx_k, ctx_v = [], []
    for b in range(tree.num_seqs):
        idx = tree.path_token_indices(b)
        s = int(sl[b])
        ctx_k.append(np.concatenate([kp[idx], sk[b, :s]], axis=0))
        ctx_v.append(np.concatenate([vp[idx], sv[b, :s]], axis=0))
    lens = np.array([c.shape[0] for c in ctx_k], np.int32)
    lmax = max(1, int(lens.max())) if lmax is None else lmax
    pad = lambda c: np.concatenate([c, np.zeros((lmax - c.shape[0],) + c.shape[1:], c.dtype)])  # noqa: E731
    k = jnp.asarray(np.stack([pad(c) for c in ctx_k]))
    v = jnp.asarray(np.stack([pad(c) for c in ctx_v]))
    o, l = _attention(jnp.asarray(np.asarray(q, np.float32)), k, v, causal=True, kv_lengths=jnp.asarray(lens),
                      sm_scale=sm_scale)
    return o.astype(q.dtype), l


def poison_outside_tree(tree, kp, vp, sk, sv, sl):
    """NaN everywhere no sequence may look: pool tokens outside spans, suffix beyond lengths.
    Returns ``((kp, vp, sk, sv), used [N] bool)``."""
    used = np.zeros(kp.shape[0], bool)
    for s, n in zip(tree.starts, tree.lengths):
        used[s:s + n] = True
    smask = (np.arange(sk.shape[1])[None, :] < np.asarray(sl)[:, None])[..., None, None]
    bad = lambda keep, x: jnp.asarray(np.where(keep, np.asarray(x), np.nan).astype(x.dtype))  # noqa: E731
    return (bad(used[:, None, None], kp), bad(used[:, None, None], vp), bad(smask, sk), bad(smask, sv)), used


# ------------------------------------------------------------------ shared-prefix plans
def forced_plan(q, prefix_k, suffix_k, path, *, device=None, interpret=True, **leaf):
    """A ``plan_shared_prefix`` plan forcing leaf ``path`` for these arrays (interpret mode
    unless ``interpret=False``, planned as for an H100 SXM unless ``device``), each chunk's leaf
    fields replaced by ``leaf`` (e.g. ``num_splits=3``, ``block_k=16``)."""
    pk = prefix_k if prefix_k.ndim == 4 else prefix_k[None]
    plan = plan_shared_prefix(batch=q.shape[0], tq=q.shape[1], heads_q=q.shape[2],
                              heads_kv=pk.shape[2], head_dim=q.shape[3], groups=pk.shape[0],
                              prefix_len=pk.shape[1], suffix_len=suffix_k.shape[1], dtype=q.dtype,
                              path=path, device=device or H100_SXM, interpret=interpret)
    if not leaf:
        return plan
    chunks = tuple(dataclasses.replace(c, leaf=dataclasses.replace(c.leaf, **leaf))
                   for c in plan.chunks)
    return dataclasses.replace(plan, chunks=chunks)


# ------------------------------------------------------------------ Mosaic GPU kernels
def cuda_target():
    """A context in which ``lower(lowering_platforms=("cuda",))`` targets an H200 on a host
    without a GPU: jax 0.12 reads the target GPU of a Pallas Triton kernel from the abstract
    mesh's device (``jax.sharding.AbstractDevice``); earlier versions need nothing."""
    abstract_device = getattr(jax.sharding, "AbstractDevice", None)
    if abstract_device is None or jax.default_backend() == "gpu":
        return contextlib.nullcontext()
    device = abstract_device(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    return jax.sharding.use_abstract_mesh(
        jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device))


def lower_for_cuda(fn, *avals):
    """The text of ``jax.jit(fn)`` traced on ``avals`` and lowered for CUDA on any host (API,
    Mosaic GPU layout inference and transfer plans, Triton lowering and shared-memory budgets
    are checked; no PTX is compiled)."""
    with cuda_target():
        return jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()


def decode_rows_case(seed, b, hq, hkv, d, p, s, nan_tail=True):
    """Random bf16 decode operands in the Mosaic GPU kernels' row layout: ``(q_hmd [Hkv, M, D],
    pk [P, Hkv, D], pv, sk [B, S, Hkv, D], sv, sl [B])``; row ``b * G + j`` of ``q_hmd[h]`` is
    query head ``h * G + j`` of sequence ``b``, ``M = B * G`` rounded up to 128 with zero
    padding rows; ``sl`` NumPy suffix lengths with 0 (first) and ``S`` (last) included; with
    ``nan_tail`` the suffix caches hold NaN past each length."""
    g = hq // hkv
    rng = np.random.default_rng(seed)
    m = -(-b * g // 128) * 128
    q = rng.standard_normal((hkv, m, d)).astype(np.float32)
    q[:, b * g:] = 0.0                                   # padding rows
    pk, pv = (rng.standard_normal((p, hkv, d)).astype(np.float32) for _ in range(2))
    sk, sv = (rng.standard_normal((b, s, hkv, d)).astype(np.float32) for _ in range(2))
    sl = rng.integers(0, s + 1, size=b)
    sl[0], sl[-1] = 0, s
    if nan_tail:
        for i in range(b):
            sk[i, sl[i]:] = np.nan
            sv[i, sl[i]:] = np.nan
    as16 = lambda x: jnp.asarray(x, jnp.bfloat16)        # noqa: E731
    return as16(q), as16(pk), as16(pv), as16(sk), as16(sv), sl


def decode_row_states(q, pk, pv, p_len, sk, sv, sl, group, scale):
    """float64 NumPy states of each real row of ``q [Hkv, >= B G, D]`` (row layout of
    :func:`decode_rows_case`): ``{"pre": (o [Hkv, B G, D], lse [Hkv, B G]), "suf": ...}`` over
    the prefix keys ``[0, p_len)`` and over its own sequence's suffix keys ``[0, sl[b])``
    (``o = 0``, ``lse = -inf`` where there is none)."""
    q, pk, pv, sk, sv = (np.asarray(x, np.float64) for x in (q, pk, pv, sk, sv))
    hkv, _, d = q.shape
    b = sk.shape[0]

    def state(qr, keys, vals):                  # qr [r, D], keys/vals [n, D]
        if len(keys) == 0:
            return np.zeros((len(qr), d)), np.full(len(qr), -np.inf)
        sc = qr @ keys.T * scale
        mx = sc.max(axis=1, keepdims=True)
        w = np.exp(sc - mx)
        return w @ vals / w.sum(axis=1, keepdims=True), mx[:, 0] + np.log(w.sum(axis=1))
    out = {}
    for name in ("pre", "suf"):
        o = np.zeros((hkv, b * group, d))
        lse = np.full((hkv, b * group), -np.inf)
        for h in range(hkv):
            if name == "pre":
                o[h], lse[h] = state(q[h, :b * group], pk[:p_len, h], pv[:p_len, h])
                continue
            for i in range(b):
                rows = slice(i * group, (i + 1) * group)
                o[h, rows], lse[h, rows] = state(q[h, rows], sk[i, :sl[i], h], sv[i, :sl[i], h])
        out[name] = (o, lse)
    return out


def check_row_states(got, want, b, group, names=("pre", "suf")):
    """Kernel partial states ``got = [(o [n, Hkv, >= B G, D], lse [n, Hkv, >= B G]), ...]``
    (each merged over its ``n`` sets) against :func:`decode_row_states`' ``want[name]``: no
    NaN, ``-inf`` exactly where no key was seen (with ``o = 0``), bf16 tolerances."""
    for (o, lse), name in zip(got, names):
        o, lse = merge_partials(o.astype(jnp.float32), lse)
        o, lse = np.asarray(o)[:, :b * group], np.asarray(lse)[:, :b * group]
        wo, wl = want[name]
        assert not np.isnan(o).any() and not np.isnan(lse).any(), name
        fin = np.isfinite(wl)
        assert (np.isfinite(lse) == fin).all(), name
        assert (o[~fin] == 0).all(), name
        if fin.any():
            rel = np.linalg.norm(o - wo) / np.linalg.norm(wo)
            assert rel < 2e-2, (name, rel)
        np.testing.assert_allclose(lse[fin], wl[fin], atol=2e-2, rtol=1e-3, err_msg=name)


# ---------------------------------------------------------------- numerics and shared-prefix cases

def rel_err(x, ref):
    """Relative error ||x - ref|| / ||ref|| in float64."""
    x = np.asarray(x, np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
def make_case(seed, *, b=3, tq=1, hq=4, hkv=2, d=16, g=0, p=20, s=9, dtype=jnp.float32,
              suffix_lengths=None, prefix_lengths=None):
    """Random inputs; ``g = 0`` means one prefix given as ``[P, Hkv, D]``."""
    rng = np.random.default_rng(seed)
    gg = max(g, 1)

    def rnd(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)
    q = rnd(b, tq, hq, d)
    pk, pv = rnd(gg, p, hkv, d), rnd(gg, p, hkv, d)
    sk, sv = rnd(b, s, hkv, d), rnd(b, s, hkv, d)
    if suffix_lengths is None:
        suffix_lengths = rng.integers(0, s + 1, size=b)
    kw = dict(suffix_lengths=jnp.asarray(suffix_lengths, jnp.int32))
    if g == 0:
        pk, pv = pk[0], pv[0]
        plen = np.full((1,), p)
        s2p = np.zeros((b,), np.int64)
    else:
        plen = (rng.integers(0, p + 1, size=g) if prefix_lengths is None
                else np.asarray(prefix_lengths))
        s2p = rng.integers(0, g, size=b)
        kw.update(prefix_lengths=jnp.asarray(plen, jnp.int32),
                  seq_to_prefix=jnp.asarray(s2p, jnp.int32))
    return (q, pk, pv, sk, sv), kw, (plen, s2p)


def oracle(args, kw, meta):
    """reference.attention over the explicit per-sequence concatenation ``[prefix[:L0], suffix[:sl]]``
    (zeros past each sequence's length), built and attended in float32 in one jitted program
    on the default device."""
    q, pk, pv, sk, sv = args
    plen, s2p = meta
    p = pk.shape[-3]
    pk4, pv4 = (jnp.reshape(x, (-1,) + x.shape[-3:]) for x in (pk, pv))
    return concat_oracle_jit(q, pk4, pv4, sk, sv, jnp.asarray(kw["suffix_lengths"], jnp.int32),
                             jnp.asarray(np.minimum(plen, p), jnp.int32),
                             jnp.asarray(s2p, jnp.int32))


@jax.jit
def concat_oracle_jit(q, pk4, pv4, sk, sv, sl, plen, s2p):
    """``q [B, Tq, Hq, D]``, prefixes ``[G, P, Hkv, D]``, suffixes ``[B, S, Hkv, D]``: each
    sequence's keys ``[pk4[s2p][:plen[s2p]], sk[:sl]]`` padded with zeros to ``P + S``."""
    p, s = pk4.shape[1], sk.shape[1]
    l0 = plen[s2p]                                          # [B]
    j = jnp.arange(p + s)[None, :]                          # [1, P + S]
    si = j - l0[:, None]
    keep = lambda m: m[:, :, None, None]  # noqa: E731

    def concat(pre, suf):
        out = jnp.zeros((sk.shape[0], p + s) + suf.shape[2:], suf.dtype)
        if p:
            rows = pre[s2p[:, None], jnp.broadcast_to(jnp.clip(j, 0, p - 1), si.shape)]
            out = jnp.where(keep(j < l0[:, None]), rows, out)
        if s:
            rows = jnp.take_along_axis(suf, jnp.clip(si, 0, s - 1)[:, :, None, None], axis=1)
            out = jnp.where(keep((si >= 0) & (si < sl[:, None])), rows, out)
        return out.astype(jnp.float32)
    return reference.attention(q.astype(jnp.float32), concat(pk4, sk), concat(pv4, sv),
                               causal=True, kv_lengths=l0 + sl)


@jax.jit
def ref_attention_jit(q, k, v, lens):
    return reference.attention(q, k, v, causal=True, kv_lengths=lens)


def check(out, lse, ref, dtype):
    ro, rl = ref
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all()
    assert rel_err(out, ro) < TOL[dtype], rel_err(out, ro)
    fin = np.isfinite(np.asarray(rl))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), fin)
    atol = 1e-4 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(rl)[fin], rtol=atol, atol=atol)
    np.testing.assert_array_equal(out[~fin], 0.0)


def rows_oracle(q_hmd, sources, scale):
    """numpy: row r of head h attends to keys [:lim[r]] of entry idx[r] of every source."""
    q = np.asarray(q_hmd, np.float64)
    hkv, m, d = q.shape
    o = np.zeros((hkv, m, d))
    lse = np.full((hkv, m), -np.inf)
    sources = [(np.asarray(k, np.float64), np.asarray(v, np.float64), idx, lim)
               for k, v, idx, lim in sources]
    for h in range(hkv):
        for r in range(m):
            ks, vs = [], []
            for k, v, idx, lim in sources:
                ks.append(k[idx[r], :lim[r], h])
                vs.append(v[idx[r], :lim[r], h])
            kk, vv = np.concatenate(ks), np.concatenate(vs)
            if len(kk) == 0:
                continue
            s = kk @ q[h, r] * scale
            mx = s.max()
            p = np.exp(s - mx)
            o[h, r] = p @ vv / p.sum()
            lse[h, r] = mx + np.log(p.sum())
    return o, lse


def kv_pool(rng, n, s, hkv, d, dtype):
    return (jnp.asarray(rng.standard_normal((n, s, hkv, d), np.float32)).astype(dtype),
            jnp.asarray(rng.standard_normal((n, s, hkv, d), np.float32)).astype(dtype))


def check_rows(o, lse, ro, rl, tol):
    o = np.asarray(o, np.float32)
    assert np.isfinite(o).all()
    assert rel_err(o, ro) < tol, rel_err(o, ro)
    fin = np.isfinite(rl)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), fin)
    np.testing.assert_allclose(np.asarray(lse)[fin], rl[fin], rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(o[~fin], 0.0)
