"""Log-probabilities of given completions, each prompt computed once (Llama, and DeepSeek through
:meth:`models.deepseek.Deepseek.completion_hidden`).

:func:`completion_logprobs` scores ``N`` completions of each of ``G`` prompts (RL and
preference training: GRPO samples 8-64 completions per prompt).  Inputs are right-padded:
``prompt_tokens [G, P]`` with ``prompt_lengths [G]`` (each >= 1) and ``completion_tokens
[G, N, C]`` with ``completion_lengths [G, N]``.  Prompt token ``i`` sits at RoPE position ``i``,
completion token ``t`` of group ``g`` at ``prompt_lengths[g] + t``.  The result ``[G, N, C]``
float32 holds ``log p(completion[g, n, t] | prompt[g], completion[g, n, :t])`` for
``t < completion_lengths[g, n]`` and exactly 0 past it; token ``t`` is predicted from the hidden
state of the token before it (the last prompt token for ``t = 0``).

``impl`` picks how the prompt is attended:

* ``"shared"``: the layers run over the ``G`` prompts once (``[G, P]`` rows, causal), keeping each
  layer's prompt keys/values ``[G, P, Hkv, D]``; the ``G * N`` completions run as ``[G * N, C]``
  rows whose attention is :func:`jax_prefix_attn.shared_prefix_attention` over their prompt
  (grouped prefixes, ``seq_to_prefix = b // N``, ``prefix_lengths = prompt_lengths``) and,
  causally, over their own keys/values (``Tq = C``).  The backward runs the library's kernels:
  a prompt's ``dK``/``dV`` are summed over its ``N`` completions inside the kernel, and flow into
  the prompt's layers, which run once forward and once backward.
* ``"flat"``: every completion gets its own copy of its prompt: ``[G * N, P + C]`` rows of
  ``[prompt[:L]; completion; padding]``, one causal :func:`jax_prefix_attn.attention` per layer
  (the baseline; the same numbers up to rounding).
* ``"auto"``: ``"shared"`` when ``N > 1``, else ``"flat"`` (one completion per prompt shares
  nothing).

Memory.  The logits are never materialised whole: the hidden states that predict completion
tokens go through the final norm, then the LM head and log-softmax run over chunks of
``logits_chunk`` tokens (``lax.map``) and, with ``vocab_chunk``, over vocabulary slices too
(online log-sum-exp).  The head has its own VJP: the backward recomputes each chunk's logits,
forms ``softmax - onehot`` (plus the entropy term) in float32 and accumulates the head's weight
gradient in float32 across chunks, so only ``[chunk, V]`` float32 is live at a time (at 128K
vocabulary and 16K completion tokens whole logits would take 8 GB).  ``remat=True``
rematerialises each layer in the backward (:func:`jax.checkpoint`; ``remat_policy`` is passed
as its ``policy``, e.g. ``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``), so the
saved activations are one ``[rows, H]`` layer input per layer.  Parameters may be bfloat16:
matmuls run in the parameters' dtype with float32 accumulation, norms, softmax and the
log-probabilities in float32.

Everything is traceable: ``completion_logprobs`` works under ``jax.jit``, ``jax.grad`` and
``jax.value_and_grad`` with respect to ``params``; value checks (lengths, token ids, context
length) run when the arrays are concrete, shape checks always.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

import jax_prefix_attn
from jax_prefix_attn.planner import BACKWARDS as SHARED_BACKWARDS
from models.layer_layout import layer_loop
from models.layers import embed, rms_norm
from models.llama import Llama

__all__ = ["IMPLS", "completion_logprobs", "resolve_impl", "token_logprobs"]

IMPLS = ("auto", "shared", "flat")
LOGITS_ELEMENTS = 1 << 27   # default token chunk: about this many logits ([chunk, V] float32, 512 MB) at a time


def resolve_impl(impl: str, num_completions: int) -> str:
    """``"shared"`` or ``"flat"`` for ``impl`` with ``N = num_completions`` per prompt."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "shared" if num_completions > 1 else "flat"
    return impl


# ---------------------------------------------------------------------------------- validation
def _concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _int_array(name: str, x, ndim: int, layout: str):
    if not hasattr(x, "shape"):
        try:
            x = np.asarray(x)
        except (TypeError, ValueError) as e:
            raise TypeError(f"{name} must be an integer array {layout}, got {type(x).__name__}") from e
    if x.ndim != ndim:
        raise ValueError(f"{name} must have rank {ndim} {layout}, got shape {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array {layout}, got dtype {x.dtype}")
    return x


def _check_range(name: str, x, lo: int, hi: int, what: str) -> None:
    if _concrete(x):
        v = np.asarray(x)
        if v.size and (v.min() < lo or v.max() > hi):
            raise ValueError(f"{name} must be in [{lo}, {hi}] ({what}), got values in [{v.min()}, {v.max()}]")


def _validate(model, params, prompt_tokens, prompt_lengths, completion_tokens, completion_lengths, impl,
              return_entropy, remat, logits_chunk, vocab_chunk, temperature):
    if not isinstance(model, Llama) and not hasattr(model, "completion_hidden"):
        raise TypeError(f"model must be a models.Llama or a family with completion_hidden "
                        f"(models.deepseek.Deepseek), got {type(model).__name__}")
    if not isinstance(params, dict) or "embed" not in params or "layers" not in params:
        raise TypeError("params must be the parameter dict of models.weights (with 'embed' and 'layers'), got "
                        f"{type(params).__name__}")
    for name, val in (("return_entropy", return_entropy), ("remat", remat)):
        if not isinstance(val, bool):
            raise TypeError(f"{name} must be a bool, got {type(val).__name__}")
    cfg = model.config
    for name, val in (("logits_chunk", logits_chunk), ("vocab_chunk", vocab_chunk)):
        if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < 1):
            raise ValueError(f"{name} must be a positive int or None, got {val!r}")
    if vocab_chunk is not None and cfg.vocab_size % vocab_chunk:
        raise ValueError(f"vocab_chunk must divide vocab_size={cfg.vocab_size}, got {vocab_chunk}")
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not temperature > 0:
        raise ValueError(f"temperature must be a number > 0, got {temperature!r}")
    pt = _int_array("prompt_tokens", prompt_tokens, 2, "[G, P]")
    pl = _int_array("prompt_lengths", prompt_lengths, 1, "[G]")
    ct = _int_array("completion_tokens", completion_tokens, 3, "[G, N, C]")
    cl = _int_array("completion_lengths", completion_lengths, 2, "[G, N]")
    g, p = pt.shape
    if g < 1 or p < 1:
        raise ValueError(f"prompt_tokens [G, P] needs G >= 1 and P >= 1, got shape {tuple(pt.shape)}")
    if pl.shape != (g,):
        raise ValueError(f"prompt_lengths must have shape [G={g}] (prompt_tokens is {tuple(pt.shape)}), got "
                         f"{tuple(pl.shape)}")
    if ct.shape[0] != g or ct.shape[1] < 1 or ct.shape[2] < 1:
        raise ValueError(f"completion_tokens must have shape [G={g}, N >= 1, C >= 1], got {tuple(ct.shape)}")
    if cl.shape != ct.shape[:2]:
        raise ValueError(f"completion_lengths must have shape [G, N]={tuple(ct.shape[:2])} (completion_tokens is "
                         f"{tuple(ct.shape)}), got {tuple(cl.shape)}")
    c = ct.shape[2]
    _check_range("prompt_lengths", pl, 1, p, "each prompt needs a token to predict its first completion token")
    _check_range("completion_lengths", cl, 0, c, "at most C, the completion axis")
    if c > cfg.max_position_embeddings:
        raise ValueError(f"completion_tokens: C={c} is longer than the model's context "
                         f"(max_position_embeddings={cfg.max_position_embeddings})")
    if all(map(_concrete, (pt, pl, ct, cl))):
        pl_, cl_ = np.asarray(pl), np.asarray(cl)
        total = int((pl_[:, None] + cl_).max())
        if total > cfg.max_position_embeddings:
            raise ValueError(f"completion_lengths: prompt + completion reaches {total} tokens, longer than the "
                             f"model's context (max_position_embeddings={cfg.max_position_embeddings})")
        for name, toks, mask in (("prompt_tokens", pt, np.arange(p)[None] < pl_[:, None]),
                                 ("completion_tokens", ct, np.arange(c)[None, None] < cl_[..., None])):
            v = np.asarray(toks)[mask]
            if v.size and (v.min() < 0 or v.max() >= cfg.vocab_size):
                raise ValueError(f"{name}: token ids within the lengths must be in [0, {cfg.vocab_size}), got "
                                 f"[{v.min()}, {v.max()}]")
    return resolve_impl(impl, ct.shape[1]), pt, pl, ct, cl


# ---------------------------------------------------------------------------------- layers
def _causal_self(model: Llama):
    def attend(q, k, v):
        return jax_prefix_attn.attention(q, k, v, causal=True, impl=model.impl, interpret=model.interpret)[0]
    return attend


def _shared_hidden(model, params, prompt_gp, plen_g, comp_bc, n, remat, policy, attention_backward):
    """Hidden states ``[G*N, C, H]`` predicting each completion token; prompts run once."""
    g, p = prompt_gp.shape
    b, c = comp_bc.shape
    dtype = params["embed"].dtype
    s2p = jnp.arange(b, dtype=jnp.int32) // n
    pos_p = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (g, p))
    pos_c = plen_g[s2p][:, None] + jnp.arange(c, dtype=jnp.int32)[None]
    full = jnp.full((b,), c, jnp.int32)      # right-padded: causality hides the padding from real rows
    causal = _causal_self(model)

    def body(carry, lp):
        x_p, x_c = carry
        x_p, (k_p, v_p) = model.layer_forward(lp, x_p, pos_p, causal)

        def over_prompt(q, k, v):
            return jax_prefix_attn.shared_prefix_attention(
                q, k_p, v_p, k, v, suffix_lengths=full, prefix_lengths=plen_g, seq_to_prefix=s2p,
                impl=model.impl, interpret=model.interpret, backward=attention_backward)
        x_c, _ = model.layer_forward(lp, x_c, pos_c, over_prompt)
        return x_p, x_c

    x0 = (embed(params["embed"], prompt_gp).astype(dtype), embed(params["embed"], comp_bc).astype(dtype))
    x_p, x_c = layer_loop(body, x0, params["layers"], remat, policy)
    last = x_p[jnp.arange(g), plen_g - 1]                                   # [G, H]
    return jnp.concatenate([last[s2p][:, None], x_c[:, :-1]], axis=1)


def _flat_hidden(model, params, prompt_gp, plen_g, comp_bc, n, remat, policy):
    """The same hidden states from ``[G*N, P + C]`` rows ``[prompt[:L]; completion; pad]``."""
    p = prompt_gp.shape[1]
    b, c = comp_bc.shape
    s2p = jnp.arange(b, dtype=jnp.int32) // n
    length = plen_g[s2p][:, None]                                           # [B, 1]
    j = jnp.arange(p + c, dtype=jnp.int32)[None]
    from_prompt = jnp.take_along_axis(prompt_gp[s2p], jnp.minimum(j, p - 1), axis=1)
    from_comp = jnp.take_along_axis(comp_bc, jnp.clip(j - length, 0, c - 1), axis=1)
    tokens = jnp.where(j < length, from_prompt, from_comp)
    pos = jnp.broadcast_to(j, (b, p + c))
    causal = _causal_self(model)
    x = embed(params["embed"], tokens).astype(params["embed"].dtype)
    x = layer_loop(lambda x, lp: model.layer_forward(lp, x, pos, causal)[0], x, params["layers"], remat, policy)
    idx = length - 1 + jnp.arange(c, dtype=jnp.int32)[None]
    return jnp.take_along_axis(x, idx[..., None], axis=1)


# ---------------------------------------------------------------------------------- LM head
@dataclasses.dataclass(frozen=True)
class _HeadSpec:
    tied: bool                  # weight is the embedding [V, H] (else lm_head [H, V])
    vocab_chunk: int | None     # vocabulary slice per step (None: the whole vocabulary)
    temperature: float
    entropy: bool


def _vocab_slices(spec: _HeadSpec, w):
    v = w.shape[0] if spec.tied else w.shape[1]
    vc = spec.vocab_chunk or v
    return v // vc, vc


def _logits(spec: _HeadSpec, h_th, w, i, vc):
    """float32 logits ``[t, vc]`` of vocabulary slice ``i`` (divided by the temperature)."""
    if vc != (w.shape[0] if spec.tied else w.shape[1]):
        w = jax.lax.dynamic_slice_in_dim(w, i * vc, vc, axis=0 if spec.tied else 1)
    prec = jax.lax.Precision.HIGHEST if w.dtype == jnp.float32 else None
    z = jnp.einsum("th,vh->tv" if spec.tied else "th,hv->tv", h_th.astype(w.dtype), w, precision=prec,
                   preferred_element_type=jnp.float32)
    return z if spec.temperature == 1.0 else z / spec.temperature


def _chunk_stats(spec: _HeadSpec, h_th, w, tgt_t):
    """``(chosen logit, lse, E_p[logit])`` ``[t]`` float32, online over vocabulary slices."""
    n_slices, vc = _vocab_slices(spec, w)
    t = h_th.shape[0]

    def step(carry, i):
        m, s, u, chosen = carry
        z = _logits(spec, h_th, w, i, vc)
        m_new = jnp.maximum(m, z.max(axis=-1))
        a, e = jnp.exp(m - m_new), jnp.exp(z - m_new[:, None])
        j = tgt_t - i * vc
        hit = jnp.take_along_axis(z, jnp.clip(j, 0, vc - 1)[:, None], axis=-1)[:, 0]
        chosen = chosen + jnp.where((j >= 0) & (j < vc), hit, 0.0)
        u = u * a + (e * z).sum(axis=-1) if spec.entropy else u
        return (m_new, s * a + e.sum(axis=-1), u, chosen), None

    zeros = jnp.zeros((t,), jnp.float32)
    init = (jnp.full((t,), -jnp.inf, jnp.float32), zeros, zeros, zeros)
    if n_slices == 1:
        (m, s, u, chosen), _ = step(init, 0)
    else:
        (m, s, u, chosen), _ = jax.lax.scan(step, init, jnp.arange(n_slices))
    return chosen, m + jnp.log(s), u / s


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _head(h_kth, w, tgt_kt, spec):
    lp, ent, _ = _head_forward(h_kth, w, tgt_kt, spec)
    return lp, ent


def _head_forward(h_kth, w, tgt_kt, spec):
    def one(args):
        chosen, lse, ez = _chunk_stats(spec, args[0], w, args[1])
        return chosen - lse, lse - ez if spec.entropy else jnp.zeros_like(lse), lse
    return jax.lax.map(one, (h_kth, tgt_kt))


def _head_fwd(h_kth, w, tgt_kt, spec):
    lp, ent, lse = _head_forward(h_kth, w, tgt_kt, spec)
    return (lp, ent), (h_kth, w, tgt_kt, lse, ent)


def _head_bwd(spec, res, cts):
    """Per token chunk and vocabulary slice: ``dz = g_lp (onehot - p) - g_ent p (log p + H)``;
    ``dh = dz W^T``, ``dW += h^T dz`` accumulated in float32."""
    h_kth, w, tgt_kt, lse_kt, ent_kt = res
    g_lp, g_ent = cts
    n_slices, vc = _vocab_slices(spec, w)
    axis = 0 if spec.tied else 1
    prec = jax.lax.Precision.HIGHEST if w.dtype == jnp.float32 else None

    def chunk(dw, xs):
        h, tgt, lse, ent, glp, gent = xs

        def piece(carry, i):
            dh, dw = carry
            z = _logits(spec, h, w, i, vc)
            p = jnp.exp(z - lse[:, None])
            onehot = jnp.arange(vc, dtype=jnp.int32)[None] == (tgt - i * vc)[:, None]
            dz = glp[:, None] * (onehot - p)
            if spec.entropy:
                dz = dz - gent[:, None] * p * (z - lse[:, None] + ent[:, None])
            dz = (dz / spec.temperature).astype(w.dtype)
            w_i = w if n_slices == 1 else jax.lax.dynamic_slice_in_dim(w, i * vc, vc, axis=axis)
            dh = dh + jnp.einsum("tv,vh->th" if spec.tied else "tv,hv->th", dz, w_i, precision=prec,
                                 preferred_element_type=jnp.float32)
            dw_i = jnp.einsum("th,tv->vh" if spec.tied else "th,tv->hv", h.astype(w.dtype), dz, precision=prec,
                              preferred_element_type=jnp.float32)
            if n_slices == 1:
                return (dh, dw + dw_i), None
            old = jax.lax.dynamic_slice_in_dim(dw, i * vc, vc, axis=axis)
            return (dh, jax.lax.dynamic_update_slice_in_dim(dw, old + dw_i, i * vc, axis=axis)), None

        init = (jnp.zeros(h.shape, jnp.float32), dw)
        if n_slices == 1:
            (dh, dw), _ = piece(init, 0)
        else:
            (dh, dw), _ = jax.lax.scan(piece, init, jnp.arange(n_slices))
        return dw, dh.astype(h_kth.dtype)

    dw, dh = jax.lax.scan(chunk, jnp.zeros(w.shape, jnp.float32), (h_kth, tgt_kt, lse_kt, ent_kt, g_lp, g_ent))
    return dh, dw.astype(w.dtype), None


_head.defvjp(_head_fwd, _head_bwd)


def default_logits_chunk(vocab: int, tokens: int) -> int:
    """Tokens per LM-head chunk: a power of two with about :data:`LOGITS_ELEMENTS` logits per
    chunk (8 to 4096 tokens), at most ``tokens`` rounded up to a multiple of 8."""
    chunk = 1 << max(3, min(12, int(math.log2(max(LOGITS_ELEMENTS // vocab, 1)))))
    return min(chunk, -(-tokens // 8) * 8)


def token_logprobs(h_mh, params: dict, targets_m, *, logits_chunk: int | None = None,
                   vocab_chunk: int | None = None, temperature: float = 1.0, entropy: bool = False):
    """``(log p(targets), entropy)`` ``[M]`` float32 of final-normed hidden states ``h [M, H]``.

    The LM head (``params["lm_head"]``, or the tied embedding) and the log-softmax run over
    chunks of ``logits_chunk`` tokens and ``vocab_chunk`` vocabulary entries; the logits are
    never stored whole, in the forward or the backward (see the module docstring).  The entropy
    is zeros unless ``entropy``.
    """
    tied = params.get("lm_head") is None
    w = params["embed"] if tied else params["lm_head"]
    m = h_mh.shape[0]
    chunk = logits_chunk or default_logits_chunk(w.shape[0] if tied else w.shape[1], m)
    k = -(-m // chunk)
    pad = k * chunk - m
    h = jnp.pad(h_mh, ((0, pad), (0, 0))).reshape(k, chunk, -1)
    tgt = jnp.pad(jnp.asarray(targets_m, jnp.int32), (0, pad)).reshape(k, chunk)
    spec = _HeadSpec(tied=tied, vocab_chunk=vocab_chunk, temperature=float(temperature), entropy=entropy)
    lp, ent = _head(h, w, tgt, spec)
    return lp.reshape(-1)[:m], ent.reshape(-1)[:m]


# ---------------------------------------------------------------------------------- entry point
def completion_logprobs(model: Llama, params: dict, prompt_tokens, prompt_lengths, completion_tokens,
                        completion_lengths, *, impl: str = "auto", return_entropy: bool = False, remat: bool = True,
                        remat_policy=None, logits_chunk: int | None = None, vocab_chunk: int | None = None,
                        temperature: float = 1.0, attention_backward: str = "auto"):
    """Log-probabilities ``[G, N, C]`` float32 of ``N`` completions of each of ``G`` prompts.

    Args:
      model: a :class:`~models.llama.Llama` (its ``impl``/``interpret`` choose the attention
        kernels of every library call), or a family that supplies ``completion_hidden``
        (:class:`~models.deepseek.Deepseek`: the prompt's latents as the grouped shared prefix
        of :func:`jax_prefix_attn.mla_attention`).
      params: the parameter tree of the loaders (stacked or list layout, any float dtype).
      prompt_tokens: int ``[G, P]`` right-padded prompts; prompt_lengths: int ``[G]`` in ``[1, P]``.
      completion_tokens: int ``[G, N, C]`` right-padded completions; completion_lengths: int
        ``[G, N]`` in ``[0, C]``.
      impl: ``"shared"``, ``"flat"`` or ``"auto"`` (``"shared"`` when ``N > 1``); see the module
        docstring.
      return_entropy: also return the entropy ``[G, N, C]`` of each predicted distribution.
      remat: rematerialise each layer in the backward; remat_policy: ``jax.checkpoint``'s policy.
      logits_chunk: tokens per LM-head chunk (default: about 128M logits, 512 MB, per chunk);
        vocab_chunk: vocabulary entries per slice (must divide the vocabulary; default all).
      temperature: log-probabilities of ``softmax(logits / temperature)``.
      attention_backward: the backward of the shared path's attention over the prompts
        (``backward`` of :func:`jax_prefix_attn.shared_prefix_attention`: ``"auto"``,
        ``"kernels"``, ``"mgpu"`` or ``"reference"``); the Llama only.

    Returns:
      ``logprobs [G, N, C]`` (0 past each completion's length), or ``(logprobs, entropy)``.
    """
    path, prompt_tokens, prompt_lengths, completion_tokens, completion_lengths = _validate(
        model, params, prompt_tokens, prompt_lengths, completion_tokens, completion_lengths, impl, return_entropy,
        remat, logits_chunk, vocab_chunk, temperature)
    g, n, c = completion_tokens.shape
    b = g * n
    prompt_gp = jnp.asarray(prompt_tokens, jnp.int32)
    plen_g = jnp.asarray(prompt_lengths, jnp.int32)
    comp_bc = jnp.asarray(completion_tokens, jnp.int32).reshape(b, c)
    if attention_backward not in SHARED_BACKWARDS:
        raise ValueError(f"attention_backward must be one of {SHARED_BACKWARDS}, got {attention_backward!r}")
    if isinstance(model, Llama) and path == "shared":
        hidden = _shared_hidden(model, params, prompt_gp, plen_g, comp_bc, n, remat, remat_policy,
                                attention_backward)
    elif isinstance(model, Llama):
        hidden = _flat_hidden(model, params, prompt_gp, plen_g, comp_bc, n, remat, remat_policy)
    else:
        hidden = model.completion_hidden(params, prompt_gp, plen_g, comp_bc, n, shared=path == "shared",
                                         remat=remat, policy=remat_policy)
    h = rms_norm(hidden.reshape(b * c, -1), params["final_norm"], model.config.rms_norm_eps)
    valid = jnp.arange(c)[None] < jnp.asarray(completion_lengths, jnp.int32).reshape(b, 1)
    lp, ent = token_logprobs(h, params, jnp.where(valid, comp_bc, 0).reshape(-1), logits_chunk=logits_chunk,
                             vocab_chunk=vocab_chunk, temperature=temperature, entropy=return_entropy)
    lp = jnp.where(valid, lp.reshape(b, c), 0.0).reshape(g, n, c)
    if not return_entropy:
        return lp
    return lp, jnp.where(valid, ent.reshape(b, c), 0.0).reshape(g, n, c)
