"""Log-probabilities of every token of branching token trees, each node computed once.

A *token tree* is a forest of nodes, each a run of tokens hanging below its parent: a shared
prompt, then turns that branch (agent trajectories, multi-turn conversations, tree search).  A
node's context is the concatenation of the tokens on its root-to-node path.
:func:`tree_completion_logprobs` scores every token of every node given the path above it,
running each node's tokens through the layers once, however many leaves lie below it.

Input format (host structure, device tokens):

* ``parents [M]`` int: parent node of each node, ``-1`` for a root (several roots: a forest).
  A parent may come after its child in the list.
* ``node_lengths [M]`` int ``>= 1``: tokens per node.
* ``node_tokens [M_pad, T]`` int: node ``u``'s tokens right-padded in row ``u`` (rows ``>= M``
  are padding); :meth:`TreeLayout.pad_tokens` builds it from per-node token lists.

:func:`tree_layout` turns the structure into a :class:`TreeLayout` (host work: the library's
:class:`~jax_prefix_attn.PrefixTree` and its :class:`~jax_prefix_attn.TreeMetadata`); the
layout is a pytree, so a jitted training step takes it as an argument.  Node token ``j`` of
node ``u`` sits at RoPE position ``path_start[u] + j`` (``path_start``: tokens on the path above
``u``).  The result ``[M_pad, T]`` float32 holds ``log p(token[u, j] | path above u,
token[u, :j])`` for ``j < node_lengths[u]``, and exactly 0 past the lengths, on padding rows,
at a root's first token (nothing predicts it) and where ``score_mask`` is False.  Token ``j > 0``
is predicted by the hidden state of token ``j - 1``; a node's first token by its parent's last.

How a node is computed once.  Each node is one row ``[T]`` of a ``[M_pad, T]`` batch.  In every
layer the rows' keys/values ``[M_pad, T, Hkv, D]`` are both the *pool* of
:func:`jax_prefix_attn.tree_attention` (reshaped to ``[M_pad * T, Hkv, D]``; inner node ``u``'s
span is ``[u * T, u * T + node_lengths[u])``) and each row's *suffix*: row ``u`` attends to the
spans of its ancestors (the attention tree has one node per inner token-tree node, and row ``u``
hangs from ``parents[u]``; roots hang from an empty node) and, causally, to its own keys.  The
right padding of a row is seen only by the padding queries after it.  The backward is
``tree_attention``'s: a node's ``dK``/``dV`` are summed over all the rows below it (on a GPU in
the backward kernels), so gradients of shared nodes are summed over their descendants and each
node's layers run once forward and once backward.  The LM head and log-softmax run in chunks
(:func:`models.training.logprobs.token_logprobs`: the logits are never whole).

Compile sharing.  The jitted computation depends on the layout's shapes ``(M_pad, T)`` and on the
attention metadata's table shapes and static fields.  :func:`tree_layout` buckets ``M_pad`` with
:func:`models.batch_buckets.batch_bucket` (power of two up to 8, multiple of 8 above) and ``T``
with :func:`length_bucket` (power of two up to 64, multiple of 64 above); ``TreeMetadata``
buckets its own tables (powers of two) but holds one level schedule per depth of the inner
nodes.  So two forests share a compilation when their ``(M_pad, T)`` buckets agree, their inner
nodes (nodes with children) span the same number of depths with the same per-level buckets, and
the library makes the same static choices (``preferred`` schedule, single-level, shallow): for
example batches of trajectories of one agent loop (a fixed number of turns) whose turn lengths
and branch counts vary.  ``pad_nodes_to`` / ``pad_length_to`` fix ``(M_pad, T)`` for a whole run.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import jax_prefix_attn
from models.batch_buckets import batch_bucket
from models.layer_layout import layer_loop
from models.layers import embed, rms_norm
from models.llama import Llama
from models.training.logprobs import token_logprobs

__all__ = ["TreeLayout", "length_bucket", "tree_completion_logprobs", "tree_layout"]

LENGTH_POW2_UP_TO = 64   # node-length bucket: powers of two up to this, multiples of it above
ATTENTION_IMPLS = ("auto", "flatten", "levelwise", "nodes")


def length_bucket(n: int) -> int:
    """``n`` rounded up to a power of two up to :data:`LENGTH_POW2_UP_TO`, to a multiple of it above."""
    return batch_bucket(n, pow2_up_to=LENGTH_POW2_UP_TO)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class TreeLayout:
    """Device description of a token forest padded to ``[M_pad, T]`` (a pytree: jit argument).

    ``parents [M_pad]`` int32 (``-1`` roots and padding rows), ``node_lengths [M_pad]`` int32
    (0 on padding rows), ``positions [M_pad, T]`` int32 RoPE positions, ``pred_index [M_pad, T]``
    int32 flat index (into ``[M_pad * T]``) of the hidden state that predicts each token, and
    ``meta`` the :class:`~jax_prefix_attn.TreeMetadata` of the attention tree (queries ``Tq = T``).
    """
    parents: Any
    node_lengths: Any
    positions: Any
    pred_index: Any
    meta: Any

    def tree_flatten(self):
        return (self.parents, self.node_lengths, self.positions, self.pred_index, self.meta), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)

    @property
    def shape(self) -> tuple[int, int]:
        """``(M_pad, T)``: rows (nodes and padding) and tokens per row."""
        return tuple(self.positions.shape)

    def pad_tokens(self, tokens: Sequence[Sequence[int]], pad_id: int = 0) -> np.ndarray:
        """``[M_pad, T]`` int32 from one token list per node (host; the layout must be concrete)."""
        lengths = np.asarray(self.node_lengths)
        m = int((lengths > 0).sum())
        if len(tokens) != m:
            raise ValueError(f"tokens must hold one token list per node ({m} nodes), got {len(tokens)}")
        out = np.full(self.shape, pad_id, np.int32)
        for u, toks in enumerate(tokens):
            if len(toks) != lengths[u]:
                raise ValueError(f"tokens[{u}] must have node_lengths[{u}] = {lengths[u]} tokens, got {len(toks)}")
            out[u, :len(toks)] = toks
        return out


# ---------------------------------------------------------------------------------- host layout
def _int_vector(name: str, x) -> np.ndarray:
    if isinstance(x, jax.core.Tracer):
        raise TypeError(f"{name} must be concrete (host) ints: the tree's structure is built outside jit")
    arr = np.asarray(x)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"{name} must be a one-dimensional int sequence [M], got shape {arr.shape} "
                         f"dtype {arr.dtype}")
    return arr.astype(np.int64)


def _path_starts(parents: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Tokens on the path above each node; raises on a cycle."""
    m = parents.shape[0]
    start = np.full(m, -1, np.int64)
    for i in range(m):
        path, u = [], i
        while u != -1 and start[u] < 0:
            if len(path) > m:
                raise ValueError(f"parents has a cycle through node {i}: every node must lead to a root (-1)")
            path.append(u)
            u = int(parents[u])
        s = 0 if u == -1 else int(start[u] + lengths[u])
        for v in reversed(path):
            start[v] = s
            s += int(lengths[v])
    return start


def _pad_to(name: str, value, need: int, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < need:
        raise ValueError(f"{name} must be an int >= {need}, got {value!r}")
    return int(value)


def tree_layout(model: Llama, parents, node_lengths, *, pad_nodes_to: int | None = None,
                pad_length_to: int | None = None) -> TreeLayout:
    """The :class:`TreeLayout` of a token forest for ``model`` (host work, cached by the library).

    Args:
      model: the :class:`~models.llama.Llama` (its heads set the metadata's GQA group; its
        context length bounds the paths).
      parents: int ``[M]`` parent of each node, ``-1`` for a root.
      node_lengths: int ``[M]`` tokens per node, each ``>= 1``.
      pad_nodes_to: rows ``M_pad >= M`` (default ``batch_bucket(M)``).
      pad_length_to: tokens per row ``T >= max(node_lengths)`` (default
        ``length_bucket(max(node_lengths))``).
    """
    if not isinstance(model, Llama):
        raise TypeError(f"model must be a models.Llama, got {type(model).__name__}")
    p = _int_vector("parents", parents)
    ln = _int_vector("node_lengths", node_lengths)
    m = p.shape[0]
    if m == 0:
        raise ValueError("parents must describe at least one node, got 0 nodes")
    if ln.shape[0] != m:
        raise ValueError(f"node_lengths must have one entry per node ([M={m}]), got {ln.shape[0]}")
    bad = np.nonzero((p < -1) | (p >= m) | (p == np.arange(m)))[0]
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"parents[{i}] = {int(p[i])}: expected -1 (root) or another node's index in [0, {m})")
    if ln.min() < 1:
        i = int(np.argmin(ln))
        raise ValueError(f"node_lengths must be >= 1, got node_lengths[{i}] = {int(ln[i])}")
    start = _path_starts(p, ln)
    ctx = model.config.max_position_embeddings
    if int((start + ln).max()) > ctx:
        i = int(np.argmax(start + ln))
        raise ValueError(f"node_lengths: the path to node {i} holds {int(start[i] + ln[i])} tokens, longer than "
                         f"the model's context (max_position_embeddings={ctx})")
    m_pad = _pad_to("pad_nodes_to", pad_nodes_to, m, batch_bucket(m))
    t = _pad_to("pad_length_to", pad_length_to, int(ln.max()), length_bucket(int(ln.max())))
    parents_r = np.concatenate([p, np.full(m_pad - m, -1, np.int64)])
    lengths_r = np.concatenate([ln, np.zeros(m_pad - m, np.int64)])
    start_r = np.concatenate([start, np.zeros(m_pad - m, np.int64)])
    # attention tree: one node per inner token-tree node (span = its row in the pool) + an empty root
    inner = np.unique(p[p >= 0])
    att = np.full(m, -1, np.int64)
    att[inner] = np.arange(inner.size)
    empty = inner.size
    att_parents = np.append(np.where(p[inner] >= 0, att[np.maximum(p[inner], 0)], -1), -1)
    tree = jax_prefix_attn.PrefixTree(att_parents, np.append(inner * t, 0), np.append(ln[inner], 0),
                                      np.where(parents_r >= 0, att[np.maximum(parents_r, 0)], empty))
    cfg = model.config
    meta = jax_prefix_attn.build_tree_metadata(tree, tq=t, group=cfg.num_attention_heads // cfg.num_key_value_heads,
                                               pool_size=m_pad * t)
    j = np.arange(t)[None]
    pred = np.arange(m_pad)[:, None] * t + j - 1
    last_of_parent = np.maximum(parents_r, 0) * t + lengths_r[np.maximum(parents_r, 0)] - 1
    pred[:, 0] = np.where(parents_r >= 0, last_of_parent, 0)
    return TreeLayout(parents=jnp.asarray(parents_r, jnp.int32), node_lengths=jnp.asarray(lengths_r, jnp.int32),
                      positions=jnp.asarray(start_r[:, None] + j, jnp.int32),
                      pred_index=jnp.asarray(pred, jnp.int32), meta=meta)


# ---------------------------------------------------------------------------------- computation
def _check_args(model, params, layout, node_tokens, score_mask, attention_impl, return_entropy, remat,
                logits_chunk, vocab_chunk, temperature):
    if not isinstance(model, Llama):
        raise TypeError(f"model must be a models.Llama, got {type(model).__name__}")
    if not isinstance(params, dict) or "embed" not in params or "layers" not in params:
        raise TypeError(f"params must be the parameter dict of models.weights, got {type(params).__name__}")
    if not isinstance(layout, TreeLayout):
        raise TypeError(f"layout must be a TreeLayout (from tree_layout), got {type(layout).__name__}")
    if attention_impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {attention_impl!r}")
    for name, val in (("return_entropy", return_entropy), ("remat", remat)):
        if not isinstance(val, bool):
            raise TypeError(f"{name} must be a bool, got {type(val).__name__}")
    for name, val in (("logits_chunk", logits_chunk), ("vocab_chunk", vocab_chunk)):
        if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < 1):
            raise ValueError(f"{name} must be a positive int or None, got {val!r}")
    if vocab_chunk is not None and model.config.vocab_size % vocab_chunk:
        raise ValueError(f"vocab_chunk must divide vocab_size={model.config.vocab_size}, got {vocab_chunk}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be a number > 0, got {temperature!r}")
    shape = layout.shape
    tok = node_tokens if hasattr(node_tokens, "shape") else np.asarray(node_tokens)
    if tuple(tok.shape) != shape or not jnp.issubdtype(tok.dtype, jnp.integer):
        raise ValueError(f"node_tokens must be an int array of the layout's shape [M_pad, T]={shape}, got shape "
                         f"{tuple(tok.shape)} dtype {tok.dtype}")
    if not any(isinstance(x, jax.core.Tracer) for x in (tok, layout.node_lengths)):
        v = np.asarray(tok)[np.arange(shape[1])[None] < np.asarray(layout.node_lengths)[:, None]]
        if v.size and (v.min() < 0 or v.max() >= model.config.vocab_size):
            raise ValueError(f"node_tokens: token ids within the node lengths must be in "
                             f"[0, {model.config.vocab_size}), got [{v.min()}, {v.max()}]")
    if score_mask is not None:
        sm = score_mask if hasattr(score_mask, "shape") else np.asarray(score_mask)
        if tuple(sm.shape) not in (shape, shape[:1]) or sm.dtype != jnp.bool_:
            raise ValueError(f"score_mask must be a bool array [M_pad]={shape[:1]} (per node) or [M_pad, T]={shape} "
                             f"(per token), got shape {tuple(sm.shape)} dtype {sm.dtype}")
    return jnp.asarray(tok, jnp.int32)


def tree_completion_logprobs(model: Llama, params: dict, layout: TreeLayout, node_tokens, *, score_mask=None,
                             return_entropy: bool = False, remat: bool = True, remat_policy=None,
                             logits_chunk: int | None = None, vocab_chunk: int | None = None,
                             temperature: float = 1.0, attention_impl: str = "auto"):
    """Log-probabilities ``[M_pad, T]`` float32 of every token of a token forest (module docstring).

    Args:
      model: a :class:`~models.llama.Llama` (``interpret`` runs the attention's Pallas kernels in
        interpret mode; ``impl="reference"`` runs the pure-JAX mirror of the tree schedule).
      params: the parameter tree of the loaders (stacked or list layout, any float dtype).
      layout: :func:`tree_layout` of the forest (a pytree; pass it as a ``jax.jit`` argument).
      node_tokens: int ``[M_pad, T]`` (``layout.shape``), node ``u``'s tokens right-padded in row ``u``.
      score_mask: optional bool ``[M_pad]`` (nodes to score, e.g. only the model's turns) or
        ``[M_pad, T]`` (tokens); unscored tokens get 0 and no gradient.
      return_entropy: also return the entropy ``[M_pad, T]`` of each predicted distribution.
      remat, remat_policy, logits_chunk, vocab_chunk, temperature: as in
        :func:`models.training.logprobs.completion_logprobs`.
      attention_impl: :func:`jax_prefix_attn.tree_attention`'s ``impl`` (``"auto"``,
        ``"flatten"``, ``"levelwise"`` or ``"nodes"``).

    Returns:
      ``logprobs [M_pad, T]`` (0 where not scored), or ``(logprobs, entropy)``.
    """
    tokens = _check_args(model, params, layout, node_tokens, score_mask, attention_impl, return_entropy, remat,
                         logits_chunk, vocab_chunk, temperature)
    m, t = layout.shape
    full = jnp.full((m,), t, jnp.int32)
    platform = "cpu" if model.impl == "reference" else None

    def attend(q, k, v):
        pool_k, pool_v = (x.reshape(m * t, *x.shape[2:]) for x in (k, v))
        return jax_prefix_attn.tree_attention(q, layout.meta, pool_k, pool_v, k, v, suffix_lengths=full,
                                              impl=attention_impl, interpret=model.interpret, platform=platform)

    def body(x, lp):
        return model.layer_forward(lp, x, layout.positions, attend)[0]

    x = embed(params["embed"], tokens).astype(params["embed"].dtype)
    x = layer_loop(body, x, params["layers"], remat, remat_policy)
    h = rms_norm(x.reshape(m * t, -1)[layout.pred_index.reshape(-1)], params["final_norm"], model.config.rms_norm_eps)
    j = jnp.arange(t)[None]
    valid = (j < layout.node_lengths[:, None]) & ((j > 0) | (layout.parents[:, None] >= 0))
    if score_mask is not None:
        score_mask = jnp.asarray(score_mask)
        valid = valid & (score_mask if score_mask.ndim == 2 else score_mask[:, None])
    lp, ent = token_logprobs(h, params, jnp.where(valid, tokens, 0).reshape(-1), logits_chunk=logits_chunk,
                             vocab_chunk=vocab_chunk, temperature=temperature, entropy=return_entropy)
    lp = jnp.where(valid, lp.reshape(m, t), 0.0)
    return (lp, jnp.where(valid, ent.reshape(m, t), 0.0)) if return_entropy else lp
