"""Token sampling: greedy, temperature, min-p, top-k and top-p (nucleus), with per-sequence PRNG keys.

:class:`SamplingConfig` is a pytree whose static part is its :class:`SamplingMode` -- which
options are on (greedy or not, the ``top_k``, top-p, min-p, repetition penalty, presence /
frequency penalty) -- and whose leaves are the float values: a jit-compiled decode loop is
specialised to the mode, so an option left at its neutral value adds no operation to the decode
step, and takes the values as traced float32 scalars, so other values reuse the compilation.
Its penalty fields (``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``) are
applied to the logits before sampling by :func:`models.penalties.apply_penalties`, which needs the per-sequence token
counts the decode loop keeps; :func:`sample_tokens` itself applies temperature, ``min_p``, top-k
and top-p.
Its defaults -- ``temperature=0.8, top_k=50, top_p=0.95`` (:data:`DEFAULT_SAMPLING`) -- are the
defaults of :meth:`models.LLM.generate` and of ``jpa-sample``; :data:`GREEDY` is the default of
the low-level decode loop (:func:`models.generate.generate`), whose callers are parity tests and
benchmarks that want deterministic tokens.

* ``temperature == 0``: greedy (``argmax``; top-k/top-p are irrelevant);
* otherwise logits are divided by ``temperature``; ``min_p > 0`` masks to ``-inf`` the tokens whose
  probability is below ``min_p`` times the most probable token's (vLLM's rule, applied after
  temperature and before top-k / top-p: ``x_t < max(x) + log(min_p)``); then logits are masked
  to ``-inf`` outside the ``top_k``
  largest (``top_k = 0``: off; ties with the k-th value are kept) and outside the nucleus: the
  smallest set of most probable tokens whose probability reaches ``top_p`` (the token that
  crosses ``top_p`` is kept, so the most probable token always survives; ``top_p = 1``: off);
* a draw is the Gumbel-max ``argmax_t (x_t + g_t)`` over the surviving tokens, where the noise
  ``g_t`` of token ``t`` is a function of ``(key, step, t)`` only (threefry of the token id under
  ``fold_in(keys[b], step)``; ties go to the smallest token id).  So a sequence's samples do not
  depend on the rest of the batch -- neither on its size nor on which internal path (candidates
  or whole row, see below) the batch took -- only on its key, the step and its logits.
  :func:`sample_keys` derives the key of sample ``i`` of prompt ``j`` from ``(seed, j, i)``.

Speed (CPU, ``B = 6``, ``V = 49152``): a full sort of the vocabulary costs ~0.2 s per step, so
no path sorts it.  ``top_k`` uses ``lax.top_k`` with the static ``k`` (its
values and indices are passed through ``lax.optimization_barrier``: XLA otherwise rewrites a
``TopK`` whose indices are unused into a full sort); top-p after top-k works on the ``k``
sorted survivors (exact: tokens tied with the k-th value can only join at the threshold value).
Top-p alone first takes the ``TOP_P_CANDIDATES`` largest logits; a row whose candidates' mass
reaches ``p`` has its nucleus threshold among them (exact), the other rows take an exact
bisection on the threshold value (32 passes over the row, no sort), computed only when some row
needs it (``lax.cond``).  When every surviving token of every row is a candidate, the noise is
drawn for the candidates only; otherwise for the whole row.  Both give the same token: the
noise of a token does not depend on which tokens it is drawn with.
Measured per step, a full sort of the row against these paths (CPU, 2 shared cores, logits
``3 * normal``, temperature 0.8): top-k 50: 303 vs 8 ms; top-p 0.9 (nucleus ~480 tokens:
bisection): 266 vs 53 ms; both: 443 vs 8 ms; with peaked logits (``10 * normal``) top-p 0.9: 315
vs 12 ms.  Temperature alone (noise for the whole row) takes ~30 ms.

:func:`token_logprobs` gives the log-probability of chosen tokens under the model's raw
distribution (``log_softmax`` of the logits, before penalties, temperature, min-p, top-k and
top-p); :func:`top_logprobs` the ``k`` most probable tokens of that distribution.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry2x32_p

__all__ = ["DEFAULT_SAMPLING", "GREEDY", "SEED_MAX", "TOP_P_CANDIDATES", "VALUE_FIELDS", "SamplingConfig",
           "SamplingMode", "filter_logits", "min_p_mask", "sample_keys", "sample_tokens", "token_logprobs",
           "top_k_mask", "top_logprobs", "top_p_mask"]


_REAL = (int, float, np.integer, np.floating)


def _real(name: str, v, in_range, expected: str) -> float:
    """``v`` as a float: ``TypeError`` unless a real number (bool excluded), ``ValueError`` unless
    ``in_range(v)``; both name the field, what was received and ``expected``."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, _REAL):
        raise TypeError(f"{name}: received {type(v).__name__} {v!r}, expected {expected}")
    if not in_range(float(v)):
        raise ValueError(f"{name}: received {v!r}, expected {expected}")
    return float(v)


@dataclasses.dataclass(frozen=True)
class SamplingMode:
    """The static part of a :class:`SamplingConfig`: which operations a compiled step runs.
    ``greedy`` (temperature 0), ``top_k`` (the k, a shape; 0 = off), ``top_p`` (nucleus on),
    ``min_p`` (on), ``repetition`` (a repetition penalty: the prompt-token mask is needed),
    ``additive`` (a presence or frequency penalty)."""
    greedy: bool
    top_k: int
    top_p: bool
    min_p: bool
    repetition: bool
    additive: bool

    @property
    def penalized(self) -> bool:
        return self.repetition or self.additive


# the fields of SamplingConfig passed to a compiled step as traced float32 scalars
VALUE_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """``temperature`` (0 = greedy), ``top_k`` (0 = off), ``top_p`` (1 = off), ``min_p`` (0 =
    off), ``repetition_penalty`` (1 = off), ``presence_penalty`` and ``frequency_penalty`` (0 =
    off); see module docstring and :mod:`models.penalties`.

    A pytree: its :class:`SamplingMode` (:attr:`mode`) is the static structure and the six
    :data:`VALUE_FIELDS` are its leaves, so a jitted function taking a config as an argument is
    compiled once per mode and receives the values as float32 scalars (another temperature,
    top-p, min-p or penalty value reuses the compilation).  It is also hashable, usable as a
    static argument (the values are then constants of the compiled function)."""
    temperature: float = 0.8
    top_k: int = 50
    top_p: float = 0.95
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self):
        checked = {
            "temperature": _real("temperature", self.temperature, lambda v: 0 <= v < np.inf,
                                 "a finite float >= 0 (0 = greedy)"),
            "top_p": _real("top_p", self.top_p, lambda v: 0 < v <= 1, "a float in (0, 1] (1 = off)"),
            "min_p": _real("min_p", self.min_p, lambda v: 0 <= v <= 1, "a float in [0, 1] (0 = off)"),
            "repetition_penalty": _real("repetition_penalty", self.repetition_penalty, lambda v: 0 < v < np.inf,
                                        "a finite float > 0 (1 = off)"),
        }
        for name in ("presence_penalty", "frequency_penalty"):
            checked[name] = _real(name, getattr(self, name), lambda v: -2 <= v <= 2, "a float in [-2, 2] (0 = off)")
        k = self.top_k
        if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer)):
            raise TypeError(f"top_k: received {type(k).__name__} {k!r}, expected an int >= 0 (0 = off)")
        if k < 0:
            raise ValueError(f"top_k: received {k!r}, expected an int >= 0 (0 = off)")
        checked["top_k"] = int(k)
        for name, v in checked.items():
            object.__setattr__(self, name, v)
        object.__setattr__(self, "_mode", SamplingMode(
            greedy=checked["temperature"] == 0, top_k=checked["top_k"], top_p=checked["top_p"] < 1,
            min_p=checked["min_p"] > 0, repetition=checked["repetition_penalty"] != 1,
            additive=checked["presence_penalty"] != 0 or checked["frequency_penalty"] != 0))

    @property
    def mode(self) -> SamplingMode:
        """What a compiled step runs (static)."""
        return self._mode

    @property
    def greedy(self) -> bool:
        return self._mode.greedy

    @property
    def penalized(self) -> bool:
        """Whether any penalty is on (the decode loop then keeps per-sequence token counts)."""
        return self._mode.penalized

    def tree_flatten(self):
        return tuple(_leaf(getattr(self, name)) for name in VALUE_FIELDS), self._mode

    @classmethod
    def tree_unflatten(cls, mode: SamplingMode, values) -> "SamplingConfig":
        # values may be tracers or placeholders: no check, the mode is carried as it is
        cfg = object.__new__(cls)
        for name, v in zip(VALUE_FIELDS, values):
            object.__setattr__(cfg, name, v)
        object.__setattr__(cfg, "top_k", mode.top_k)
        object.__setattr__(cfg, "_mode", mode)
        return cfg


def _leaf(v):
    """A concrete value as a float32 scalar (one abstract type whatever the Python type); a
    traced or device value as it is."""
    return np.float32(v) if isinstance(v, float) else v


DEFAULT_SAMPLING = SamplingConfig()
GREEDY = SamplingConfig(temperature=0.0, top_k=0, top_p=1.0)
SEED_MAX = 2**32 - 1  # jax.random.PRNGKey keeps the low 32 bits of a seed (without x64)


def sample_keys(seed: int, prompt_index, sample_index) -> jax.Array:
    """PRNG keys ``[B, 2]`` uint32: row ``b`` is ``fold_in(fold_in(PRNGKey(seed), j_b), i_b)`` for
    ``prompt_index [B]`` (``j``) and ``sample_index [B]`` (``i``): sample ``i`` of prompt ``j``
    gets the same key whatever else is in the batch."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed <= SEED_MAX:
        raise ValueError(f"seed must be an int in [0, {SEED_MAX}], got {seed!r}")
    return _fold_keys(jax.random.PRNGKey(int(seed)), jnp.asarray(prompt_index, jnp.uint32),
                      jnp.asarray(sample_index, jnp.uint32))


@jax.jit
def _fold_keys(base, j_b, i_b):
    return jax.vmap(lambda a, b: jax.random.fold_in(jax.random.fold_in(base, a), b))(j_b, i_b)


TOP_P_CANDIDATES = 256  # largest logits examined before top-p (alone) falls back to bisection

def _top_k(logits_bv: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``lax.top_k`` (values descending ``[B, k]``, indices ``[B, k]``) that stays a TopK.

    The barrier stops XLA from rewriting a TopK with unused indices or a sliced result into a
    sort of the whole row (measured: 1.3 ms -> 160 ms on CPU for ``[6, 49152]``, k = 50). One
    barrier per output: XLA:CPU's TopK decomposer rejects a tuple barrier when the program is
    partitioned over several devices.
    """
    vals, idx = jax.lax.top_k(logits_bv, k)
    return jax.lax.optimization_barrier(vals), jax.lax.optimization_barrier(idx)


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


def min_p_mask(logits_bv: jax.Array, min_p) -> jax.Array:
    """Boolean ``[B, V]``: True where ``softmax(logits) >= min_p * max(softmax(logits))``, i.e.
    ``logits >= max(logits) + log(min_p)`` (no normalisation needed; ``min_p`` a float or a
    traced float32 scalar)."""
    x = logits_bv.astype(jnp.float32)
    return x >= jnp.max(x, axis=-1, keepdims=True) + jnp.log(jnp.asarray(min_p, jnp.float32))


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
    thr = jax.lax.cond(exact, lambda: thr,
                       lambda: jnp.where(decided[:, None], thr, _bisect_threshold(logits_bv, p)))
    return thr, vals, idx, exact


def top_p_mask(logits_bv: jax.Array, p: float, *, candidates: int = TOP_P_CANDIDATES) -> jax.Array:
    """Boolean ``[B, V]``: True inside the nucleus of probability ``p`` (see module docstring);
    ``candidates``: how many of the largest logits are examined before the bisection."""
    return logits_bv >= _top_p_candidates(logits_bv, p, candidates)[0]


def _filter(logits_bv: jax.Array, cfg: SamplingConfig):
    """``(x [B, V], cand)``: temperature-scaled logits with masked entries ``-inf``, and
    ``cand = (vals [B, C], idx [B, C], exact [])`` -- candidates (non-survivors ``-inf``) that
    hold every survivor when ``exact`` -- or ``None`` without top-k / top-p.  Which steps run is
    ``cfg.mode`` (static); the values may be traced."""
    mode = cfg.mode
    x = logits_bv.astype(jnp.float32) / jnp.asarray(cfg.temperature, jnp.float32)
    if mode.min_p:
        x = jnp.where(min_p_mask(x, cfg.min_p), x, -jnp.inf)
    if mode.top_k:
        vals, idx = _top_k(x, min(mode.top_k, x.shape[-1]))
        x = jnp.where(x >= vals[:, -1:], x, -jnp.inf)
        exact = jnp.bool_(True)
        if mode.top_p:
            # the survivors are the k candidates plus tokens tied with the k-th value, which sort
            # after them: the threshold is among the candidates or equals the k-th value
            thr, _ = _nucleus(vals, jax.nn.logsumexp(x, axis=-1, keepdims=True), cfg.top_p)
            x = jnp.where(x >= thr, x, -jnp.inf)
            vals = jnp.where(vals >= thr, vals, -jnp.inf)
    elif mode.top_p:
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
    """Temperature-scaled logits with masked entries (min-p, top-k, top-p) set to ``-inf``."""
    return _filter(logits_bv, cfg)[0]


def _step_words(keys_b: jax.Array, step) -> tuple[jax.Array, jax.Array]:
    """The two uint32 words ``[B, 1]`` of each row's key for this step (``fold_in(key, step)``)."""
    step_keys = jax.vmap(lambda k: jax.random.fold_in(k, step))(keys_b)
    if jnp.issubdtype(step_keys.dtype, jax.dtypes.prng_key):
        step_keys = jax.random.key_data(step_keys)
    words = step_keys.reshape(step_keys.shape[0], -1).astype(jnp.uint32)
    return words[:, :1], words[:, 1:2]


def _gumbel_at(words, idx_bc: jax.Array) -> jax.Array:
    """Gumbel noise ``[B, C]`` float32 of token ids ``idx [B, C]``: a function of (key words, id)."""
    k1, k2 = (jnp.broadcast_to(w, idx_bc.shape) for w in words)
    idx = idx_bc.astype(jnp.uint32)
    b1, b2 = threefry2x32_p.bind(k1, k2, jnp.zeros_like(idx), idx)
    mant = jax.lax.shift_right_logical(b1 ^ b2, jnp.uint32(9)) | jnp.uint32(0x3F800000)
    u = jax.lax.bitcast_convert_type(mant, jnp.float32) - 1.0          # [0, 1)
    u = jnp.maximum(u, jnp.finfo(jnp.float32).tiny)
    return -jnp.log(-jnp.log(u))


def sample_tokens(logits_bv: jax.Array, keys_b: jax.Array, step, cfg: SamplingConfig) -> jax.Array:
    """Next tokens ``[B]`` int32; ``keys_b`` is ``[B]`` typed keys (or ``[B, 2]`` raw uint32).

    Row ``b``'s token depends only on ``(keys_b[b], step, logits_bv[b], cfg)``."""
    if cfg.mode.greedy:
        return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    x, cand = _filter(logits_bv, cfg)
    words = _step_words(keys_b, step)

    def full():
        ids = jnp.broadcast_to(jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape)
        return jnp.argmax(x + _gumbel_at(words, ids), axis=-1).astype(jnp.int32)  # first max: lowest id

    if cand is None:
        return full()
    vals, idx, exact = cand

    def among_candidates():
        score = vals + _gumbel_at(words, idx)
        best = jnp.max(score, axis=-1, keepdims=True)
        return jnp.min(jnp.where(score == best, idx, jnp.iinfo(jnp.int32).max), axis=-1).astype(jnp.int32)

    return jax.lax.cond(exact, among_candidates, full)


def token_logprobs(logits_bv: jax.Array, tokens_b: jax.Array) -> jax.Array:
    """``log_softmax(logits)[b, tokens[b]]`` ``[B]`` float32: the raw model log-probability of
    each chosen token (before penalties, temperature, min-p, top-k and top-p)."""
    x = logits_bv.astype(jnp.float32)
    picked = jnp.take_along_axis(x, tokens_b[:, None].astype(jnp.int32), axis=-1)[:, 0]
    return picked - jax.nn.logsumexp(x, axis=-1)


def top_logprobs(logits_bv: jax.Array, k: int, vocab_size: int | None = None) -> tuple[jax.Array, jax.Array]:
    """``(ids [B, k] int32, logprobs [B, k] float32)``: the ``k`` largest entries of the raw
    ``log_softmax(logits)``, descending (ties: lower id first).  ``vocab_size``: only the first
    ``vocab_size`` columns are real ids (the rest, padding of a split vocabulary, is ignored)."""
    x = logits_bv.astype(jnp.float32)
    if vocab_size is not None and vocab_size < x.shape[-1]:
        x = x[:, :vocab_size]
    vals, idx = _top_k(x, min(int(k), x.shape[-1]))
    return idx.astype(jnp.int32), vals - jax.nn.logsumexp(x, axis=-1, keepdims=True)
