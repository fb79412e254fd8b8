"""DeepSeek's mixture-of-experts MLP: the router (scoring, top-k selection, normalisation,
scaling), the routed experts as batched matrix products over per-expert buckets of rows, and
the shared experts.

Routing of each token (:func:`route`), in float32, from ``logits = x @ router [H, E]``:

* ``scoring_func``: ``"softmax"`` (over the experts) or ``"sigmoid"`` (each expert);
* ``topk_method``:
  - ``"greedy"``: the ``num_experts_per_tok`` best scores;
  - ``"group_limited_greedy"`` (DeepSeek-V2): the experts are split into ``n_group`` groups, a
    group is scored by its best expert, experts outside the ``topk_group`` best groups are
    scored 0, then the best ``num_experts_per_tok``;
  - ``"noaux_tc"`` (DeepSeek-V3): selection by ``score + e_score_correction_bias``, a group
    scored by the sum of its two best, experts outside the ``topk_group`` best groups excluded;
    the weights are the scores without the bias;
* ``norm_topk_prob``: the selected weights are divided by their sum (``+ 1e-20``);
* then multiplied by ``routed_scaling_factor``.

Ties are broken toward the lower expert index (``jax.lax.top_k``).

The routed experts (:func:`routed_experts`): the ``N x K`` (token, expert) pairs are sorted by
expert; each expert's rows go through its SwiGLU and the outputs, times the routing weights, are
summed back per token.  Nothing of size ``[N, E, ...]`` is built.  The expert products run in
buckets (:func:`bucketed_experts`): the rows of each expert are gathered into a bucket of ``C``
rows (``[E, C, H]``, rows past the expert's count zero) and the experts run as batched matrix
products ``[E, C, H] x [E, H, I]``, which cost ``E * C`` rows; ``C = expert_capacity(N * K, E)``,
twice the mean rows per expert, rounded up to 8.  An expert with more than ``C`` rows takes
more rounds: round ``r`` holds the rows of rank ``[r * C, (r + 1) * C)`` within their expert,
and the step runs ``ceil(max rows / C)`` rounds (branches on the device, decided by the
routing).  Balanced routing takes one round (about twice the multiply-adds the routing asks
for); the worst case, every token on one expert, takes ``E / (2 K)`` rounds.

:func:`grouped_experts` is the same products through ``jax.lax.ragged_dot``.  XLA's generic
lowering of ``ragged_dot`` (its ragged-dot rewriter, which the GPU takes unless cuDNN's grouped
GEMM is enabled) multiplies every row with every expert: ``E / K`` times the multiply-adds the
routing asks for (64 / 6 for DeepSeek-V2-Lite), so the routed experts do not use it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from models.deepseek.config import DeepseekConfig
from models.layers import swiglu_mlp

__all__ = ["moe_mlp", "route", "routed_experts", "bucketed_experts", "grouped_experts",
           "expert_capacity"]


def _group_mask(config: DeepseekConfig, group_scores_ng: jax.Array) -> jax.Array:
    """``[N, E]`` bool: experts in the ``topk_group`` best groups of each token."""
    n, g = group_scores_ng.shape
    _, top = jax.lax.top_k(group_scores_ng, config.topk_group)                    # [N, topk_group]
    keep_g = jnp.zeros((n, g), bool).at[jnp.arange(n)[:, None], top].set(True)
    return jnp.repeat(keep_g, config.n_routed_experts // g, axis=1)


def route(config: DeepseekConfig, router_he: jax.Array, bias_e: jax.Array | None,
          x_nh: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(experts [N, K] int32, weights [N, K] float32)`` of each token (module docstring)."""
    logits = jnp.einsum("nh,he->ne", x_nh.astype(jnp.float32), router_he.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST)
    scores = jax.nn.softmax(logits, axis=-1) if config.scoring_func == "softmax" else jax.nn.sigmoid(logits)
    k, n, e = config.num_experts_per_tok, scores.shape[0], scores.shape[1]
    if config.topk_method == "greedy":
        weights, experts = jax.lax.top_k(scores, k)
    elif config.topk_method == "group_limited_greedy":
        group_scores = jnp.max(scores.reshape(n, config.n_group, e // config.n_group), axis=-1)
        masked = jnp.where(_group_mask(config, group_scores), scores, 0.0)
        weights, experts = jax.lax.top_k(masked, k)
    else:  # noaux_tc
        choice = scores + bias_e.astype(jnp.float32)[None, :]
        top2, _ = jax.lax.top_k(choice.reshape(n, config.n_group, e // config.n_group), 2)
        masked = jnp.where(_group_mask(config, jnp.sum(top2, axis=-1)), choice, -jnp.inf)
        _, experts = jax.lax.top_k(masked, k)
        weights = jnp.take_along_axis(scores, experts, axis=-1)
    if config.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return experts.astype(jnp.int32), weights * config.routed_scaling_factor


def expert_capacity(pairs: int, n_experts: int) -> int:
    """Rows of one expert's bucket for ``pairs`` (token, expert) pairs over ``n_experts``:
    twice the mean, rounded up to a multiple of 8, at most ``pairs``."""
    mean = -(-pairs // n_experts)
    return max(1, min(pairs, -(-2 * mean // 8) * 8))


def _precision(dtype):
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def grouped_experts(xs_mh, sizes_e, w_gate_ehi, w_up_ehi, w_down_eih) -> jax.Array:
    """SwiGLU of the expert-sorted rows ``xs [M, H]`` (``sizes [E]`` rows per expert, in expert
    order) through ``jax.lax.ragged_dot``: ``[M, H]``."""
    prec = _precision(w_gate_ehi.dtype)
    gate = jax.lax.ragged_dot(xs_mh, w_gate_ehi, sizes_e, precision=prec)
    up = jax.lax.ragged_dot(xs_mh, w_up_ehi, sizes_e, precision=prec)
    return jax.lax.ragged_dot(jax.nn.silu(gate) * up, w_down_eih, sizes_e, precision=prec)


def bucketed_experts(xs_mh, sizes_e, w_gate_ehi, w_up_ehi, w_down_eih, capacity: int,
                     offset=0) -> jax.Array:
    """SwiGLU of the expert-sorted rows ``xs [M, H]`` (``sizes [E]`` rows per expert, in expert
    order) through buckets of ``capacity`` rows per expert (batched products over
    ``[E, capacity, H]``): ``[M, H]``, exact for the rows whose rank within their expert is in
    ``[offset, offset + capacity)`` and zero for the others.  ``offset`` may be traced."""
    m = xs_mh.shape[0]
    starts = jnp.cumsum(sizes_e) - sizes_e                                   # [E]
    slot = offset + jnp.arange(capacity, dtype=jnp.int32)
    valid = slot[None, :] < sizes_e[:, None]                                 # [E, C]
    rows = jnp.where(valid, starts[:, None] + slot[None, :], 0)
    xe = jnp.where(valid[..., None], xs_mh[rows], 0)                        # [E, C, H]
    prec = _precision(w_gate_ehi.dtype)
    gate = jnp.einsum("ech,ehi->eci", xe, w_gate_ehi, precision=prec)
    up = jnp.einsum("ech,ehi->eci", xe, w_up_ehi, precision=prec)
    ye = jnp.einsum("eci,eih->ech", jax.nn.silu(gate) * up, w_down_eih, precision=prec)
    expert = jnp.repeat(jnp.arange(sizes_e.shape[0], dtype=jnp.int32), sizes_e,
                        total_repeat_length=m)                               # [M] sorted rows
    rank = jnp.arange(m, dtype=jnp.int32) - starts[expert] - offset
    inside = (rank >= 0) & (rank < capacity)
    return jnp.where(inside[:, None], ye[expert, jnp.where(inside, rank, 0)], 0)


def routed_experts(x_nh: jax.Array, experts_nk: jax.Array, weights_nk: jax.Array,
                   w_gate_ehi: jax.Array, w_up_ehi: jax.Array, w_down_eih: jax.Array, *,
                   capacity: int | None = None) -> jax.Array:
    """``sum_k weights[n, k] * expert_{experts[n, k]}(x[n])`` ``[N, H]``; experts are SwiGLU
    with ``[E, H, I]``/``[E, I, H]`` weights.  The products run in buckets of ``capacity`` rows
    per expert (default :func:`expert_capacity`), in as many rounds as the fullest expert needs
    (module docstring): exact whatever the routing."""
    n, k = experts_nk.shape
    e = w_gate_ehi.shape[0]
    flat = experts_nk.reshape(-1)
    order = jnp.argsort(flat, stable=True)                     # (token, slot) pairs by expert
    token = order // k
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    xs = x_nh[token].astype(w_gate_ehi.dtype)
    cap = min(expert_capacity(n * k, e) if capacity is None else int(capacity), n * k)
    weights = (w_gate_ehi, w_up_ehi, w_down_eih)
    y = bucketed_experts(xs, sizes, *weights, cap)
    rounds = (jnp.max(sizes) + cap - 1) // cap
    most = -(-n // cap)              # (an expert holds at most one row per token)
    if most > 1:
        # One branch when one round holds every row (the common case: a single device branch per
        # layer); else a loop with static bounds (a scan, reverse-differentiable) whose rounds
        # past the routing's are skipped.
        def round_r(r, acc):
            return jax.lax.cond(r < rounds, lambda a: a + bucketed_experts(
                xs, sizes, *weights, cap, offset=r * cap), lambda a: a, acc)

        y = jax.lax.cond(rounds > 1, lambda a: jax.lax.fori_loop(1, most, round_r, a),
                         lambda a: a, y)
    y = y.astype(jnp.float32) * weights_nk.reshape(-1)[order][:, None]      # [N*K, H]
    return jnp.zeros((n, y.shape[1]), jnp.float32).at[token].add(y).astype(x_nh.dtype)


def moe_mlp(config: DeepseekConfig, lp: dict, x_bth: jax.Array) -> jax.Array:
    """The MoE MLP of one layer: routed experts plus the shared experts (when there are any).

    ``lp`` holds ``router [H, E]``, optional ``e_score_correction_bias [E]``,
    ``experts_gate``/``experts_up [E, H, I]``, ``experts_down [E, I, H]`` and, with shared
    experts, ``shared_gate``/``shared_up [H, n_shared * I]``, ``shared_down``."""
    b, t, h = x_bth.shape
    x = x_bth.reshape(b * t, h)
    experts, weights = route(config, lp["router"], lp.get("e_score_correction_bias"), x)
    out = routed_experts(x, experts, weights, lp["experts_gate"], lp["experts_up"], lp["experts_down"])
    out = out.reshape(b, t, h)
    if "shared_gate" in lp:
        out = out + swiglu_mlp(x_bth, lp["shared_gate"], lp["shared_up"], lp["shared_down"]).astype(out.dtype)
    return out
