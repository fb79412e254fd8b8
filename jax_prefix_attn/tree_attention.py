"""Tree attention: exact attention for a batch of sequences whose prefixes form a forest.

``tree_attention(q, tree, k_pool, v_pool, suffix_k, suffix_v, *, suffix_lengths, ...)``
computes, for every sequence ``b``, ``reference.attention`` of its ``Tq`` queries over its
full context ``concat(spans of tree.path(b)) ++ suffix_k[b, :suffix_lengths[b]]`` with the
bottom-right causal rule (queries are the last ``Tq`` context tokens), without ever
materialising those contexts: shared spans are read once for all the rows below them.

Algorithms (``impl``):

* ``"levelwise"`` (Hydragen section 3.3): one launch per tree depth; item = (node, block of
  the rows of every sequence below it) looping over the node's span; partials merged along
  each path.
* ``"flatten"`` (DeFT-Flatten): node KV flattened depth-first into ``block_kv``-token chunks,
  each paired with its rows; one launch computes a partial per (chunk, row block); a
  tree-topology-aware static reduction merges them per row.  Equal-sized items keep every SM
  busy on unbalanced trees, where a node-granular item is bounded by its longest node.
* ``"nodes"`` (the DeFT-Node analogue, a baseline): every node one item, one launch.
* ``"hybrid"`` (decoding, ``Tq == 1``): the root read by several sequences through the
  shared-prefix path's prefix kernel (every sequence's query heads as the rows of one matrix
  product), the other shared nodes through the tree kernel, and each sequence's exclusive node
  (e.g. a tree-of-thought leaf) streamed in place by the decode suffix kernel together with its
  suffix, which merges everything in its epilogue
  (:func:`jax_prefix_attn.tree_paths.hybrid_attention`).
* ``"auto"``: the schedule of :func:`jax_prefix_attn.planner.plan_tree_attention` (a
  :class:`~jax_prefix_attn.tree_plan.TreePlan`; :func:`auto_path` names it).

Every schedule is a leaf module of :mod:`jax_prefix_attn.leaves` (``tree_*``); the call runs
through the planned leaf's ``run`` with the forward paths of :data:`FORWARDS`.
* ``"reference"``: gathers each sequence's context and calls ``reference.attention``.

``interpret=True`` runs the Pallas kernels of a named algorithm in interpret mode (CPU
tests).  ``platform`` (``"gpu"`` or ``"cpu"``, default :func:`default_platform`) is where the
call runs: on ``"gpu"`` the schedules run the compiled Pallas kernels; elsewhere
``"flatten"``, ``"levelwise"`` and ``"nodes"`` run a pure-JAX mirror of the same schedule
(same metadata, same reduction) unless ``interpret``.  As for every entry point of the
library, ``"auto"`` runs kernels only on a GPU (in interpret mode there when ``interpret``);
elsewhere it runs pure JAX (the mirror of the schedule it picks) whatever ``interpret`` is.

Differentiable: the kernel paths' gradients (``backward="kernels"``, the default) come from
backward kernels (:func:`jax_prefix_attn.tree_grad.grads_via_kernels`: the tree part over the
flatten schedule's metadata whichever schedule ran the forward, the suffix part with the merged
statistics), so nothing of size rows x keys is materialised.  ``backward="mirror"`` and the
pure-JAX paths differentiate the pure-JAX mirror of the flatten schedule instead (it
materialises the scores of every work item), and so does grad of grad.  The single-level and
shallow paths differentiate through :func:`jax_prefix_attn.shared_prefix_attention` and the
decode suffix merge's own ``custom_vjp``.

Speculative decoding token trees (``draft_parents``): see :mod:`jax_prefix_attn.tree_drafts`.

Shapes and values: any GQA group and head_dim run (the kernel paths pad each kv head's query
heads with zero dummy heads to a power of two, and head_dim with zero columns to one, dropping
what the padding produced); traced ``suffix_lengths`` are clamped to ``[0, S_max]`` (to
``[Tq, S_max]`` with draft trees) and reported under ``checkify``, as everywhere in the library.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_prefix_attn._validation import (check_array, check_bool, check_gqa, check_impl, check_kv, check_lengths,
                                         check_sm_scale)
from jax_prefix_attn.leaves.base import TreeCall, TreeForwards
from jax_prefix_attn.planner import plan_tree_attention, tree_leaf
from jax_prefix_attn.prefix_tree import PrefixTree
from jax_prefix_attn.tree_drafts import check_draft_parents
from jax_prefix_attn.tree_grad import grads_via_kernels, mirror_grads
from jax_prefix_attn.tree_metadata import TreeMetadata, build_tree_metadata
from jax_prefix_attn.tree_paths import schedule_forward, shallow_attention, single_level_attention
from jax_prefix_attn.tree_plan import (PLATFORMS, TREE_IMPLS, default_platform, hybrid_unsupported_shapes,
                                       shallow_takes, single_level_takes)
from jax_prefix_attn.tree_reference import tree_reference_attention
from pallas_kernels._common import (flag_nonfinite, kernel_group, kernel_head_dim, pad_axis, pad_group,
                                     unpad_group)

__all__ = ["tree_attention", "auto_path", "default_platform", "use_single_level", "use_shallow",
           "hybrid_unsupported", "IMPLS", "BACKWARDS", "PLATFORMS", "FORWARDS"]

IMPLS = TREE_IMPLS
# Backward of the kernel paths: "kernels" (the backward kernels) or "mirror" (autodiff of the
# pure-JAX mirror of the flatten schedule).
BACKWARDS = ("kernels", "mirror")


def _validate(q, tree, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, sm_scale, impl, interpret, backward,
              platform, check_ranges):
    check_impl(impl, IMPLS)
    check_bool("interpret", interpret)
    if backward not in BACKWARDS:
        raise ValueError(f"backward must be one of {BACKWARDS}, got {backward!r}")
    if platform not in (None,) + PLATFORMS:
        raise ValueError(f"platform must be None or one of {PLATFORMS}, got {platform!r}")
    check_array("q", q, 4, layout="[batch, seq_q, heads_q, head_dim]")
    check_kv("k_pool", k_pool, "v_pool", v_pool, 3, layout="[pool_tokens, heads_kv, head_dim]",
             dtype=q.dtype, dtype_of="q")
    check_kv("suffix_k", suffix_k, "suffix_v", suffix_v, 4, layout="[batch, suffix_len, heads_kv, head_dim]",
             dtype=q.dtype, dtype_of="q")
    b, tq, hq, d = q.shape
    if k_pool.shape[2] != d or suffix_k.shape[3] != d:
        raise ValueError(f"head_dim must agree: q has {d}, k_pool {k_pool.shape[2]}, suffix_k {suffix_k.shape[3]}")
    if k_pool.shape[1] != suffix_k.shape[2]:
        raise ValueError(f"k_pool and suffix_k must have the same heads_kv, got {k_pool.shape[1]} and "
                         f"{suffix_k.shape[2]}")
    check_gqa(hq, k_pool.shape[1])
    if suffix_k.shape[0] != b:
        raise ValueError(f"suffix_k must have batch {b} (one suffix per sequence, like q), got {suffix_k.shape[0]}")
    if tq < 1:
        raise ValueError(f"q must have at least one query per sequence, got seq_q={tq}")
    check_lengths("suffix_lengths", suffix_lengths, b, suffix_k.shape[1], checked=check_ranges)
    check_sm_scale(sm_scale)
    if isinstance(tree, PrefixTree):
        if tree.num_seqs != b:
            raise ValueError(f"tree attaches {tree.num_seqs} sequences (len(leaf_of_seq)) but q has batch {b}")
        tree.check_pool(k_pool.shape[0])
    elif isinstance(tree, TreeMetadata):
        if tree.num_seqs != b or tree.tq != tq or tree.group != kernel_group(hq // k_pool.shape[1]):
            raise ValueError(f"tree metadata was built for (num_seqs, tq, kernel group) = "
                             f"{(tree.num_seqs, tree.tq, tree.group)}, but the inputs have "
                             f"{(b, tq, kernel_group(hq // k_pool.shape[1]))}; rebuild it with "
                             f"build_tree_metadata")
        if tree.pool_size != k_pool.shape[0]:
            raise ValueError(f"tree metadata was built for a pool of {tree.pool_size} tokens, but k_pool has "
                             f"{k_pool.shape[0]}")
    else:
        raise TypeError(f"tree must be a PrefixTree or a TreeMetadata, got {type(tree).__name__}")



def use_single_level(meta: TreeMetadata, q, suffix_k) -> bool:
    """Whether the single-level path takes these inputs (:func:`tree_plan.single_level_takes`)."""
    return single_level_takes(meta, q.shape, q.dtype, suffix_k.shape[1])


def use_shallow(meta: TreeMetadata, q) -> bool:
    """Whether the shallow path takes these inputs (:func:`tree_plan.shallow_takes`)."""
    return shallow_takes(meta, q.shape, q.dtype)


def hybrid_unsupported(meta: TreeMetadata, q) -> str | None:
    """``None`` when the hybrid schedule can run these inputs, else why not
    (:func:`tree_plan.hybrid_unsupported_shapes`)."""
    return hybrid_unsupported_shapes(meta, q.shape, q.dtype)


def auto_path(meta: TreeMetadata, q, suffix_k, *, draft_parents=None, platform: str | None = None) -> str:
    """What ``impl="auto"`` runs for these (static) shapes: the ``schedule`` of
    :func:`jax_prefix_attn.planner.plan_tree_attention` (``"single_level"``, ``"shallow"``,
    ``"hybrid"``, ``"levelwise"`` or ``"flatten"``)."""
    return plan_tree_attention(meta, q_shape=q.shape, dtype=q.dtype, suffix_len=suffix_k.shape[1],
                               draft=draft_parents is not None, platform=platform).schedule


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11))
def _tree_attn(q, meta, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, draft_parents, scale, schedule,
               backend, backward):
    return schedule_forward(q, meta, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, draft_parents,
                            scale=scale, schedule=schedule, backend=backend)


def _tree_attn_fwd(q, meta, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, draft_parents, scale, schedule,
                   backend, backward):
    out = _tree_attn(q, meta, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, draft_parents, scale, schedule,
                     backend, backward)
    res = (q, meta, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, draft_parents, out)
    return out, res


def _tree_attn_bwd(scale, schedule, backend, backward, res, cts):
    q, meta, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, draft_parents, (out, lse) = res
    f0 = lambda x: np.zeros(x.shape, jax.dtypes.float0)  # noqa: E731
    zero_meta = jax.tree_util.tree_map(f0, meta)
    zero_dp = None if draft_parents is None else f0(draft_parents)
    if backward == "kernels" and backend in ("pallas", "interpret"):
        d_out, d_lse = cts
        dq, dkp, dvp, dks, dvs = grads_via_kernels(q, meta, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths,
                                                   draft_parents, out, lse, d_out, d_lse, scale,
                                                   backend == "interpret")
    else:
        dq, dkp, dvp, dks, dvs = mirror_grads(q, meta, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths,
                                              draft_parents, cts, scale)
    return dq, zero_meta, dkp, dvp, dks, dvs, f0(suffix_lengths), zero_dp


_tree_attn.defvjp(_tree_attn_fwd, _tree_attn_bwd)


def _tree_kernels(call: TreeCall, schedule: str, backend: str):
    """A tree-kernel schedule's forward (:func:`schedule_forward`) with its backward."""
    return _tree_attn(call.q, call.meta, call.k_pool, call.v_pool, call.suffix_k, call.suffix_v,
                      call.suffix_lengths, call.draft_parents, call.scale, schedule, backend, call.backward)


# The forward paths the tree leaves' ``run`` goes through (they plan through the planner that
# holds the tree registry, so the leaves take them as an argument).
FORWARDS = TreeForwards(tree_kernels=_tree_kernels, single_level=single_level_attention,
                        shallow=shallow_attention)


def tree_attention(q, tree, k_pool, v_pool, suffix_k, suffix_v, *, suffix_lengths, sm_scale=None,
                   return_lse: bool = False, impl: str = "auto", interpret: bool = False, draft_parents=None,
                   backward: str = "kernels", platform: str | None = None, check_ranges: bool = False):
    """Exact attention of a batch of sequences whose shared prefixes form a forest.

    Args:
      q: queries ``[B, Tq, Hq, D]``; the ``Tq`` queries of sequence ``b`` are the last ``Tq``
        tokens of its context.
      tree: a :class:`~jax_prefix_attn.prefix_tree.PrefixTree` with ``B`` sequences (metadata is
        built and cached on the host; pass it as a static / closed-over value under ``jit``), or
        a :class:`~jax_prefix_attn.tree_metadata.TreeMetadata` from ``build_tree_metadata`` (a
        pytree: pass it as a ``jit`` argument).
      k_pool, v_pool: flat shared KV pool ``[N_tokens, Hkv, D]`` holding every node's span.
      suffix_k, suffix_v: per-sequence suffixes ``[B, S_max, Hkv, D]`` (``S_max`` may be 0).
      suffix_lengths: int ``[B]`` valid suffix tokens (dynamic: no rebuild when they grow).
      sm_scale: score scale, default ``1/sqrt(D)``.
      return_lse: also return ``lse [B, Tq, Hq]`` (float32, natural log).
      impl: ``"auto"``, ``"levelwise"``, ``"flatten"``, ``"nodes"``, ``"hybrid"`` (decoding
        only) or ``"reference"``; see the module doc.
      interpret: run the chosen algorithm's Pallas kernels in interpret mode.
      draft_parents: optional int ``[Tq]`` or ``[B, Tq]`` (speculative decoding token trees):
        the ``Tq`` queries are draft tokens forming a tree, stored as the last ``Tq`` suffix
        tokens (``suffix_lengths >= Tq``); ``draft_parents[t]`` is the parent draft (``< t``)
        or ``-1`` (child of the committed context).  Query ``t`` then sees the shared path, the
        committed suffix and only its own ancestors among the drafts (and itself) instead of
        the causal rule.  The suffix part of this mode is computed in pure JAX (no kernel).
      backward: gradients of the kernel paths, ``"kernels"`` (backward kernels) or ``"mirror"``
        (autodiff of the pure-JAX mirror of the flatten schedule).
      platform: ``"gpu"`` (compiled Pallas GPU kernels, the GPU's choices in ``"auto"``) or
        ``"cpu"`` (pure-JAX mirror); default :func:`default_platform`.
      check_ranges: add ``checkify`` checks of traced ``suffix_lengths`` and ``draft_parents``
        (out-of-range values are clamped); the caller wraps the call in
        ``checkify.checkify(..., errors=checkify.user_checks)``.  Off: no check is compiled.

    Returns:
      ``out [B, Tq, Hq, D]`` in ``q``'s dtype (and ``lse`` if ``return_lse``).  Semantics:
      ``reference.attention(q, ctx_k, ctx_v, causal=True, kv_lengths=path_len + suffix_lengths)``
      with ``ctx`` each sequence's concatenated path spans followed by its suffix.
    """
    check_bool("check_ranges", check_ranges)
    _validate(q, tree, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, sm_scale, impl, interpret, backward,
              platform, check_ranges)
    check_bool("return_lse", return_lse)
    platform = platform or default_platform()
    draft_parents = check_draft_parents(draft_parents, q.shape[0], q.shape[1], suffix_lengths,
                                        checked=check_ranges)
    # The clamp rule: suffix lengths to [0, S_max] (to [Tq, S_max] with draft token trees)
    s_max = suffix_k.shape[1]
    lo = min(q.shape[1], s_max) if draft_parents is not None else 0
    suffix_lengths = jnp.clip(jnp.asarray(suffix_lengths, jnp.int32), lo, s_max)
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    if impl == "reference":
        if not isinstance(tree, PrefixTree):
            raise TypeError("impl='reference' needs a PrefixTree (it gathers the paths on the host), "
                            "got TreeMetadata")
        out, lse = tree_reference_attention(q, tree, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, scale,
                                            draft_parents)
        return (out, lse) if return_lse else out
    # The kernels' shapes: each kv head's query heads padded with zero dummy heads to a power of
    # two (dropped below), head_dim zero-padded to a power of two (scores unchanged).
    hkv, g = k_pool.shape[1], q.shape[2] // k_pool.shape[1]
    dk = kernel_head_dim(d)
    q = pad_axis(pad_group(q, hkv, kernel_group(g)), 3, dk)
    k_pool, v_pool, suffix_k, suffix_v = (pad_axis(x, x.ndim - 1, dk)
                                          for x in (k_pool, v_pool, suffix_k, suffix_v))
    out, lse = _kernel_shapes_attention(q, tree, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths,
                                        draft_parents, scale=scale, impl=impl, interpret=interpret,
                                        backward=backward, platform=platform)
    out, lse = unpad_group(out[..., :d], hkv, g), unpad_group(lse, hkv, g)
    if return_lse:  # (kernels leave a finite LSE on rows whose NaN came from a value)
        lse = flag_nonfinite(jax.lax.stop_gradient(out), lse)
    return (out, lse) if return_lse else out


def _kernel_shapes_attention(q, tree, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths,
                             draft_parents, *, scale, impl, interpret, backward, platform):
    """:func:`tree_attention` past validation, on the kernels' shapes (a power-of-two group and
    head_dim); returns ``(out, lse)``."""
    if isinstance(tree, PrefixTree):
        meta = build_tree_metadata(tree, tq=q.shape[1], group=q.shape[2] // k_pool.shape[1],
                                   pool_size=k_pool.shape[0], device=False)  # host arrays: jit constants
    else:
        meta = tree
    # Planned before the arrays become jnp arrays: host metadata carries the modelled times.
    plan = plan_tree_attention(meta, q_shape=q.shape, dtype=q.dtype, suffix_len=suffix_k.shape[1],
                               draft=draft_parents is not None, impl=impl, platform=platform,
                               interpret=interpret)
    meta = jax.tree_util.tree_map(jnp.asarray, meta)
    call = TreeCall(q, meta, k_pool, v_pool, suffix_k, suffix_v, suffix_lengths, draft_parents, scale,
                    backward)
    return tree_leaf(plan.schedule).run(plan, call, FORWARDS)
