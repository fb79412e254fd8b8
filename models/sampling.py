"""Token sampling: greedy, temperature, top-k and top-p (nucleus), with per-sequence PRNG keys.

:class:`SamplingConfig` is static (hashable): a jit-compiled decode loop is specialised to it.

* ``temperature == 0``: greedy (``argmax``; top-k/top-p are irrelevant);
* otherwise logits are divided by ``temperature``, then masked to ``-inf`` outside the ``top_k``
  largest (``top_k = 0``: off; ties with the k-th value are kept) and outside the nucleus: the
  smallest set of most probable tokens whose probability reaches ``top_p`` (the token that
  crosses ``top_p`` is kept, so the most probable token always survives; ``top_p = 1``: off);
* sequence ``b`` at step ``i`` draws with ``fold_in(keys[b], i)``, so a sequence's samples do not
  depend on the rest of the batch.

Speed (CPU, ``B = 6``, ``V = 49152``): a full sort of the vocabulary costs ~0.2 s per step, so
no path sorts it.  ``top_k`` uses ``lax.top_k`` with the static ``k`` (its
values and indices are passed through ``lax.optimization_barrier``: XLA otherwise rewrites a
``TopK`` whose indices are unused into a full sort); top-p after top-k works on the ``k``
sorted survivors (exact: tokens tied with the k-th value can only join at the threshold value).
Top-p alone first takes the ``TOP_P_CANDIDATES`` largest logits; when their probability mass
reaches ``p`` in every row the nucleus threshold lies among them (exact), otherwise a
``lax.cond`` falls back to an exact bisection on the threshold value (32 passes over the row, no
sort).  When every surviving token is a candidate the draw is
a categorical over the candidates, else over the whole masked row -- the same distribution
either way (different random streams: a draw is deterministic given key, step and logits).
Measured per step, a full sort of the row against these paths (CPU, 2 shared cores, logits
``3 * normal``, temperature 0.8): top-k 50: 303 vs 8 ms; top-p 0.9 (nucleus ~480 tokens:
bisection): 266 vs 53 ms; both: 443 vs 8 ms; with peaked logits (``10 * normal``) top-p 0.9: 315
vs 12 ms.  Temperature alone (a categorical over the whole row) takes ~30 ms.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

__all__ = ["TOP_P_CANDIDATES", "SamplingConfig", "filter_logits", "sample_tokens", "top_k_mask", "top_p_mask"]


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise ValueError(f"temperature must be a float >= 0 (0 = greedy), got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


TOP_P_CANDIDATES = 256  # largest logits examined before top-p (alone) falls back to bisection

def _top_k(logits_bv: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``lax.top_k`` (values descending ``[B, k]``, indices ``[B, k]``) that stays a TopK.

    The barrier stops XLA from rewriting a TopK with unused indices or a sliced result into a
    sort of the whole row (measured: 1.3 ms -> 160 ms on CPU for ``[6, 49152]``, k = 50).
    """
    vals, idx = jax.lax.top_k(logits_bv, k)
    return jax.lax.optimization_barrier((vals, idx))


def _nucleus(cand_desc_bc: jax.Array, log_z_b1: jax.Array, p: float) -> tuple[jax.Array, jax.Array]:
    """Top-p threshold from the row's largest logits.

    Args:
      cand_desc_bc: the ``C`` largest logits of each row, descending.
      log_z_b1: ``logsumexp`` of the whole row ``[B, 1]`` (the softmax normaliser).
    Returns:
      ``(threshold [B, 1], decided [B])``: the smallest logit kept among the candidates, and
      whether the candidates' mass reached ``p`` (then the threshold is the full-sort one).
    """
    probs = jnp.exp(cand_desc_bc - log_z_b1)
    keep = (jnp.cumsum(probs, axis=-1) - probs) < p
    last = jnp.maximum(jnp.sum(keep, axis=-1, keepdims=True) - 1, 0)
    return jnp.take_along_axis(cand_desc_bc, last, axis=-1), ~keep[:, -1]


def _float_key(x: jax.Array) -> jax.Array:
    """Order-preserving map float32 -> uint32 (and back: :func:`_key_float`)."""
    i = jax.lax.bitcast_convert_type(x, jnp.int32)
    i = jnp.where(i < 0, i ^ jnp.int32(0x7FFFFFFF), i)
    return jax.lax.bitcast_convert_type(i, jnp.uint32) ^ jnp.uint32(0x80000000)


def _key_float(u: jax.Array) -> jax.Array:
    i = jax.lax.bitcast_convert_type(u ^ jnp.uint32(0x80000000), jnp.int32)
    return jax.lax.bitcast_convert_type(jnp.where(i < 0, i ^ jnp.int32(0x7FFFFFFF), i), jnp.float32)


def _bisect_threshold(logits_bv: jax.Array, p: float) -> jax.Array:
    """Top-p threshold ``[B, 1]`` without sorting: the smallest logit ``t`` of the row whose
    strictly-larger logits hold probability mass ``< p`` (= the full-sort definition: the first
    token of ``t``'s tie group is the last one kept).  The mass above ``t`` is a non-increasing
    step function changing only at row values, so 32 bisection steps over the order-preserving
    integer keys of float32 land exactly on a row value (each step is one pass over the row)."""
    probs = jnp.exp(logits_bv - jax.nn.logsumexp(logits_bv, axis=-1, keepdims=True))
    lo = _float_key(jnp.min(logits_bv, axis=-1))
    hi = _float_key(jnp.max(logits_bv, axis=-1))

    def step(_, lohi):
        lo, hi = lohi
        mid = lo + (hi - lo) // 2
        above = jnp.sum(jnp.where(logits_bv > _key_float(mid)[:, None], probs, 0.0), axis=-1)
        ok = above < p
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    lo, _ = jax.lax.fori_loop(0, 32, step, (lo, hi))
    return _key_float(lo)[:, None]


def top_k_mask(logits_bv: jax.Array, k: int) -> jax.Array:
    """Boolean ``[B, V]``: True for logits >= the k-th largest of the row."""
    k = min(int(k), logits_bv.shape[-1])
    return logits_bv >= _top_k(logits_bv, k)[0][:, -1:]


def _top_p_candidates(logits_bv: jax.Array, p: float, candidates: int = TOP_P_CANDIDATES):
    """``(threshold [B, 1], cand_vals [B, C], cand_idx [B, C], exact [])`` for top-p alone."""
    v = logits_bv.shape[-1]
    c = min(candidates, v)
    vals, idx = _top_k(logits_bv, c)
    thr, decided = _nucleus(vals, jax.nn.logsumexp(logits_bv, axis=-1, keepdims=True), p)
    if c == v:
        return thr, vals, idx, jnp.bool_(True)
    exact = jnp.all(decided)
    thr = jax.lax.cond(exact, lambda: thr, lambda: _bisect_threshold(logits_bv, p))
    return thr, vals, idx, exact


def top_p_mask(logits_bv: jax.Array, p: float, *, candidates: int = TOP_P_CANDIDATES) -> jax.Array:
    """Boolean ``[B, V]``: True inside the nucleus of probability ``p`` (see module docstring);
    ``candidates``: how many of the largest logits are examined before the bisection."""
    return logits_bv >= _top_p_candidates(logits_bv, p, candidates)[0]


def _filter(logits_bv: jax.Array, cfg: SamplingConfig):
    """``(x [B, V], cand)``: temperature-scaled logits with masked entries ``-inf``, and
    ``cand = (vals [B, C], idx [B, C], exact [])`` -- candidates (non-survivors ``-inf``) that
    hold every survivor when ``exact`` -- or ``None`` without top-k / top-p."""
    x = logits_bv.astype(jnp.float32) / cfg.temperature
    if cfg.top_k:
        vals, idx = _top_k(x, min(cfg.top_k, x.shape[-1]))
        x = jnp.where(x >= vals[:, -1:], x, -jnp.inf)
        exact = jnp.bool_(True)
        if cfg.top_p < 1:
            # the survivors are the k candidates plus tokens tied with the k-th value, which sort
            # after them: the threshold is among the candidates or equals the k-th value
            thr, _ = _nucleus(vals, jax.nn.logsumexp(x, axis=-1, keepdims=True), cfg.top_p)
            x = jnp.where(x >= thr, x, -jnp.inf)
            vals = jnp.where(vals >= thr, vals, -jnp.inf)
    elif cfg.top_p < 1:
        thr, vals, idx, exact = _top_p_candidates(x, cfg.top_p)
        x = jnp.where(x >= thr, x, -jnp.inf)
        vals = jnp.where(vals >= thr, vals, -jnp.inf)
    else:
        return x, None
    # every survivor is a candidate unless tokens outside the candidates tie with the threshold
    n_row = jnp.sum(x > -jnp.inf, axis=-1)
    n_cand = jnp.sum(vals > -jnp.inf, axis=-1)
    return x, (vals, idx, exact & jnp.all(n_row == n_cand))


def filter_logits(logits_bv: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """Temperature-scaled logits with masked entries set to ``-inf``."""
    return _filter(logits_bv, cfg)[0]


def sample_tokens(logits_bv: jax.Array, keys_b: jax.Array, step, cfg: SamplingConfig) -> jax.Array:
    """Next tokens ``[B]`` int32; ``keys_b`` is ``[B]`` typed keys (or ``[B, 2]`` raw uint32)."""
    if cfg.greedy:
        return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    x, cand = _filter(logits_bv, cfg)
    step_keys = jax.vmap(lambda k: jax.random.fold_in(k, step))(keys_b)
    full = lambda: jax.vmap(jax.random.categorical)(step_keys, x).astype(jnp.int32)  # noqa: E731
    if cand is None:
        return full()
    vals, idx, exact = cand

    def among_candidates():
        j = jax.vmap(jax.random.categorical)(step_keys, vals)
        return jnp.take_along_axis(idx, j[:, None], axis=-1)[:, 0].astype(jnp.int32)

    return jax.lax.cond(exact, among_candidates, full)
