"""GRPO (group relative policy optimisation) on top of :func:`models.training.logprobs.completion_logprobs`.

For ``G`` prompts with ``N`` sampled completions each (a :class:`GRPOBatch`):

* :func:`group_advantages` -- ``A[g, n] = (r[g, n] - mean_n r[g]) / (std_n r[g] + eps)``, the
  population standard deviation of the group (``scale_by_std=False``: the centred rewards only);
  a group whose rewards are all equal gets ``A = 0`` (no signal).
* :func:`grpo_loss` -- the clipped policy-ratio objective from the log-probabilities under the
  sampling policy (``old_logprobs``), per valid token ``t`` of completion ``(g, n)``::

      ratio = exp(logp - old_logp)
      pg    = -min(ratio * A, clip(ratio, 1 - clip_eps, 1 + clip_eps_high) * A)
      kl    = exp(ref_logp - logp) - (ref_logp - logp) - 1        (the k3 estimator, >= 0)
      loss  = normalise(pg + kl_beta * kl)

  ``normalisation`` (of :class:`GRPOConfig`): ``"token"`` (default) -- the sum over all valid
  tokens of the batch divided by their number, so every token weighs the same (DAPO's
  token-level mean); ``"sequence"`` -- the mean over completions of each completion's token mean
  (the original GRPO; completions of length 0 are left out); ``"constant"`` -- the sum divided
  by ``G * N * C`` (Dr. GRPO: no length bias).  Without ``old_logprobs`` the batch is taken as
  on-policy: ``old_logp = stop_gradient(logp)``, so ``ratio = 1`` with the policy gradient's
  derivative.
* :func:`grpo_objective` -- log-probs through the model (each prompt computed once with
  ``impl="shared"``) and :func:`grpo_loss`: ``(loss, metrics)``.
* :func:`make_train_step` -- one optimizer step ``(params, opt_state, batch) -> (params,
  opt_state, metrics)`` as one jitted function (``optimizer``: any ``optax``
  ``GradientTransformation``), with the parameters and optimizer state donated and optional mixed
  precision (master parameters in their own dtype, the forward and backward in
  ``compute_dtype``).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from models.llama import Llama
from models.training.logprobs import IMPLS, SHARED_BACKWARDS, completion_logprobs

__all__ = ["GRPOBatch", "GRPOConfig", "NORMALISATIONS", "group_advantages", "grpo_loss", "grpo_objective",
           "make_train_step"]

NORMALISATIONS = ("token", "sequence", "constant")


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """Hyper-parameters of the GRPO loss and of the log-probability computation.

    ``clip_eps`` / ``clip_eps_high``: the ratio is clipped to ``[1 - clip_eps, 1 +
    clip_eps_high]`` (``clip_eps_high`` defaults to ``clip_eps``; a larger one is DAPO's
    "clip higher"); ``kl_beta``: weight of the k3 KL estimate against the reference policy (needs
    ``ref_logprobs`` in the batch when > 0); ``normalisation``: see the module docstring;
    ``impl``, ``remat``, ``logits_chunk``, ``vocab_chunk``, ``temperature``,
    ``attention_backward``: passed to :func:`~models.training.logprobs.completion_logprobs` (use
    the sampling temperature).
    """
    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    kl_beta: float = 0.0
    normalisation: str = "token"
    impl: str = "auto"
    remat: bool = True
    logits_chunk: int | None = None
    vocab_chunk: int | None = None
    temperature: float = 1.0
    attention_backward: str = "auto"

    def __post_init__(self):
        for name in ("clip_eps", "kl_beta"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, (int, float)) or val < 0:
                raise ValueError(f"{name} must be a number >= 0, got {val!r}")
        if self.clip_eps_high is not None and (not isinstance(self.clip_eps_high, (int, float))
                                               or self.clip_eps_high < 0):
            raise ValueError(f"clip_eps_high must be a number >= 0 or None, got {self.clip_eps_high!r}")
        if self.normalisation not in NORMALISATIONS:
            raise ValueError(f"normalisation must be one of {NORMALISATIONS}, got {self.normalisation!r}")
        if self.impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {self.impl!r}")
        if self.attention_backward not in SHARED_BACKWARDS:
            raise ValueError(f"attention_backward must be one of {SHARED_BACKWARDS}, got "
                             f"{self.attention_backward!r}")


@struct.dataclass
class GRPOBatch:
    """One GRPO batch (a pytree; every field an array, ``None`` where absent).

    ``prompt_tokens [G, P]``, ``prompt_lengths [G]``, ``completion_tokens [G, N, C]``,
    ``completion_lengths [G, N]`` as for :func:`~models.training.logprobs.completion_logprobs`;
    ``advantages [G, N]`` float32 (e.g. :func:`group_advantages`); ``old_logprobs [G, N, C]``
    (the sampling policy's; None = on-policy) and ``ref_logprobs [G, N, C]`` (the reference
    policy's, for the KL term) float32.
    """
    prompt_tokens: Any
    prompt_lengths: Any
    completion_tokens: Any
    completion_lengths: Any
    advantages: Any
    old_logprobs: Any = None
    ref_logprobs: Any = None


def group_advantages(rewards_gn, *, eps: float = 1e-6, scale_by_std: bool = True) -> jax.Array:
    """Group-normalised advantages ``[G, N]`` float32 of rewards ``[G, N]`` (see the module docstring)."""
    r = jnp.asarray(rewards_gn, jnp.float32)
    if r.ndim != 2:
        raise ValueError(f"rewards must have shape [G, N], got {tuple(r.shape)}")
    centred = r - r.mean(axis=1, keepdims=True)
    if not scale_by_std:
        return centred
    return centred / (r.std(axis=1, keepdims=True) + eps)


def _valid_mask(completion_lengths_gn, c: int) -> jax.Array:
    return jnp.arange(c)[None, None] < jnp.asarray(completion_lengths_gn, jnp.int32)[..., None]


def _normalise(x_gnc, mask_gnc, normalisation: str) -> jax.Array:
    x = jnp.where(mask_gnc, x_gnc, 0.0)
    if normalisation == "token":
        return x.sum() / jnp.maximum(mask_gnc.sum(), 1)
    if normalisation == "constant":
        return x.sum() / x.size
    per_seq = mask_gnc.sum(axis=-1)
    seq_mean = x.sum(axis=-1) / jnp.maximum(per_seq, 1)
    return seq_mean.sum() / jnp.maximum((per_seq > 0).sum(), 1)


def grpo_loss(logprobs_gnc, advantages_gn, completion_lengths_gn, config: GRPOConfig = GRPOConfig(), *,
              old_logprobs=None, ref_logprobs=None) -> tuple[jax.Array, dict]:
    """The GRPO loss (scalar float32) of log-probs ``[G, N, C]`` and metrics (module docstring).

    Metrics (float32 scalars, normalised as the loss): ``pg_loss``, ``kl`` (0 without
    ``ref_logprobs``), ``clip_fraction`` (tokens whose clipped term was the minimum and differs
    from the unclipped one), ``ratio_mean``; and ``tokens``, the number of valid tokens.
    """
    if not isinstance(config, GRPOConfig):
        raise TypeError(f"config must be a GRPOConfig, got {type(config).__name__}")
    lp = jnp.asarray(logprobs_gnc, jnp.float32)
    if lp.ndim != 3:
        raise ValueError(f"logprobs must have shape [G, N, C], got {tuple(lp.shape)}")
    for name, x in (("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs)):
        if x is not None and tuple(jnp.shape(x)) != lp.shape:
            raise ValueError(f"{name} must have the shape of logprobs {tuple(lp.shape)}, got {tuple(jnp.shape(x))}")
    if tuple(jnp.shape(advantages_gn)) != lp.shape[:2]:
        raise ValueError(f"advantages must have shape [G, N]={lp.shape[:2]}, got {tuple(jnp.shape(advantages_gn))}")
    if tuple(jnp.shape(completion_lengths_gn)) != lp.shape[:2]:
        raise ValueError(f"completion_lengths must have shape [G, N]={lp.shape[:2]}, got "
                         f"{tuple(jnp.shape(completion_lengths_gn))}")
    if config.kl_beta > 0 and ref_logprobs is None:
        raise ValueError(f"ref_logprobs is required when kl_beta > 0 (kl_beta={config.kl_beta})")
    mask = _valid_mask(completion_lengths_gn, lp.shape[2])
    old = jax.lax.stop_gradient(lp) if old_logprobs is None else jnp.asarray(old_logprobs, jnp.float32)
    adv = jnp.asarray(advantages_gn, jnp.float32)[..., None]
    ratio = jnp.exp(jnp.where(mask, lp - old, 0.0))
    hi = config.clip_eps if config.clip_eps_high is None else config.clip_eps_high
    unclipped, clipped = ratio * adv, jnp.clip(ratio, 1.0 - config.clip_eps, 1.0 + hi) * adv
    pg = -jnp.minimum(unclipped, clipped)
    if ref_logprobs is None:
        kl = jnp.zeros_like(lp)
    else:
        d = jnp.where(mask, jnp.asarray(ref_logprobs, jnp.float32) - lp, 0.0)
        kl = jnp.exp(d) - d - 1.0
    norm = config.normalisation
    pg_loss, kl_mean = _normalise(pg, mask, norm), _normalise(kl, mask, norm)
    metrics = {"pg_loss": pg_loss, "kl": kl_mean,
               "clip_fraction": _normalise((clipped < unclipped).astype(jnp.float32), mask, norm),
               "ratio_mean": _normalise(ratio, mask, norm), "tokens": mask.sum().astype(jnp.float32)}
    return pg_loss + config.kl_beta * kl_mean, metrics


def grpo_objective(model: Llama, params: dict, batch: GRPOBatch,
                   config: GRPOConfig = GRPOConfig()) -> tuple[jax.Array, dict]:
    """``(loss, metrics)`` of ``batch`` under ``params``: :func:`completion_logprobs` then
    :func:`grpo_loss` (differentiable with respect to ``params``)."""
    if not isinstance(batch, GRPOBatch):
        raise TypeError(f"batch must be a GRPOBatch, got {type(batch).__name__}")
    lp = completion_logprobs(model, params, batch.prompt_tokens, batch.prompt_lengths, batch.completion_tokens,
                             batch.completion_lengths, impl=config.impl, remat=config.remat,
                             logits_chunk=config.logits_chunk, vocab_chunk=config.vocab_chunk,
                             temperature=config.temperature, attention_backward=config.attention_backward)
    return grpo_loss(lp, batch.advantages, batch.completion_lengths, config, old_logprobs=batch.old_logprobs,
                     ref_logprobs=batch.ref_logprobs)


def make_train_step(model: Llama, optimizer, config: GRPOConfig = GRPOConfig(), *, compute_dtype=None,
                    donate: bool = True):
    """One jitted GRPO optimizer step ``(params, opt_state, batch) -> (params, opt_state, metrics)``.

    ``optimizer``: an ``optax.GradientTransformation`` (``opt_state = optimizer.init(params)``);
    ``compute_dtype``: run the forward and backward with the parameters cast to it (e.g.
    ``jnp.bfloat16`` over float32 master parameters; the gradients arrive in the master dtype);
    ``donate``: donate ``params`` and ``opt_state`` (updated in place; the caller must not reuse
    the arrays it passed).  ``metrics`` holds :func:`grpo_loss`'s plus ``loss`` and ``grad_norm``.
    """
    if not isinstance(model, Llama) and not hasattr(model, "completion_hidden"):
        raise TypeError(f"model must be a models.Llama or a family with completion_hidden "
                        f"(models.deepseek.Deepseek), got {type(model).__name__}")
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise TypeError(f"optimizer must be an optax GradientTransformation, got {type(optimizer).__name__}")
    if not isinstance(config, GRPOConfig):
        raise TypeError(f"config must be a GRPOConfig, got {type(config).__name__}")

    def loss_fn(params, batch):
        if compute_dtype is not None:
            params = jax.tree_util.tree_map(lambda x: x.astype(compute_dtype), params)
        return grpo_objective(model, params, batch, config)

    def step(params, opt_state, batch):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = jax.tree_util.tree_map(lambda p, u: (p + u).astype(p.dtype), params, updates)
        sq = sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree_util.tree_leaves(grads))
        return params, opt_state, dict(metrics, loss=loss, grad_norm=jnp.sqrt(sq))

    return jax.jit(step, donate_argnums=(0, 1) if donate else ())
