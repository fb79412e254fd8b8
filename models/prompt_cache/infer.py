"""Cached inference: prompts of one schema served from the stored K/V of their modules.

`cached_generate(model, params, encoded, prompts)` for `P` laid-out prompts (`PromptLayout`s
of `encoded.schema`), `n` samples each:

1. Segments. Each prompt attends to the kept K/V (placeholders dropped) of the modules it
   includes; a scaffold of `encoded` whose modules a prompt all includes replaces them.
2. Levels. The segments are stored as shared prefix levels (`models.kv_cache.PrefixCache`),
   never per sample: `plan_levels` sorts the prompts by segment list (a trie of import lists)
   and maps it onto uniform levels, e.g. the modules every prompt imports form the root node
   and the modules of each group of prompts (equal lists) one node below it; groups of unequal
   size are padded with copies of one of their prompts whose rows are dropped. A segment is
   stored more than once only where the trie's branches cannot be split evenly and a copy reads
   fewer bytes than the padding (`models.prompt_cache.levels` says how groups map to levels).
   The nodes are gathered from the packed encoded K/V `[L, N, Hkv, D]` in one indexed copy
   per level on the device; host-tier NumPy K/V first cross to the device, only the rows the
   batch uses (one transfer per run of adjacent rows).
3. Prefill (`prefill_at_positions`: `Llama.extend` at explicit positions). The uncached tokens
   (arguments at their placeholders' positions, new text where the layout puts it) are the
   per-sequence suffix, at explicit RoPE positions: each attends to all of its prompt's module
   K/V (masked by valid length only; the positions are inside the keys, so gaps in them are
   fine) and causally to the uncached tokens before it in prompt order, through the
   shared-prefix attention of `models.attention.cache_attention`.
4. Decode (`models.generate.generate_from_cache`): the decode loop of `models.generate`, with
   positions continuing after the prompt's last position (`pos_offset = last + 1 - n_new`).

The first token's logits come from the last uncached token, so a prompt must end with new text
(more precisely: its last uncached token must hold its largest position); otherwise ValueError.

`prefill_generate` is the same without the cache: an ordinary causal prefill of each prompt's
assembled tokens (`assemble`: module tokens and uncached tokens sorted by position) at the same
position ids, then the same decode loop; for time-to-first-token comparisons and as the exact
reference: a prompt that imports only modules at the start of the schema with contiguous
positions and no parameters (one module, or a scaffold of several), followed by new text, gives
the same tokens both ways and as `models.generate` on the assembled ids.

Timings: `ttft_s` runs from the call to the first sampled token on the host (planning, the K/V
copies, host-to-device transfers and the prefill included; the first call also compiles).
`max_new_tokens=1` stops there: the first token is the output and no decode step runs.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models import kv_cache as kvc
from models.decoder import require_family
from models.generate import generate_from_cache, resolve_layout
from models.kv_cache import KVCache, PrefixCache
from models.llama import PREFIX_ALIGN, Llama
from models.prefix_sharing import MIN_SHARED_TOKENS, bucket_length
from models.prompt_cache.encode import EncodedSchema, check_encoded
from models.prompt_cache.layout import PromptLayout
from models.prompt_cache.levels import LevelPlan, plan_levels
from models.sampling import GREEDY, SamplingConfig, sample_keys
from models.token_step import choose_tokens, initial_counts, prompt_seen

__all__ = ["PromptCacheOutput", "assemble", "cached_generate", "prefill_at_positions", "prefill_generate",
           "prompt_segments"]


@dataclasses.dataclass(frozen=True, eq=False)
class PromptCacheOutput:
    """Completions of `P` prompts, `n` samples each; row `j * n + i` is sample `i` of prompt `j`.

    `tokens` int32 `[P * n, max_new_tokens]` (pad id after a row finished), `lengths` int32
    `[P * n]` (EOS included), `logprobs` float32 `[P * n, max_new_tokens]` when asked;
    `prompt_token_ids[j]` the assembled prompt ids of prompt `j` in position order; `ttft_s`,
    `total_s` seconds; `cached_tokens`: module tokens the prefix levels hold (level padding
    excluded), `new_tokens`: uncached tokens prefilled (over all batch rows); `plan`: the levels
    (None without the cache); `cache`: the final decode state, rows in batch order
    (`row_prompt[r]`, `row_sample[r]`: the prompt and sample of batch row `r`; `row_padding[r]`:
    a padding row of the plan, decoded and dropped)."""
    tokens: np.ndarray
    lengths: np.ndarray
    logprobs: np.ndarray | None
    prompt_token_ids: tuple
    ttft_s: float
    total_s: float
    cached_tokens: int
    new_tokens: int
    plan: LevelPlan | None
    cache: KVCache
    row_prompt: np.ndarray
    row_sample: np.ndarray
    row_padding: np.ndarray


# ------------------------------------------------------------------ segments
def prompt_segments(encoded: EncodedSchema, layout: PromptLayout) -> tuple[int, ...]:
    """Ascending rows of `encoded` a prompt attends to: its included modules, with each scaffold
    whose modules it all includes in their place (larger scaffolds first)."""
    included = set(layout.modules)
    unknown = sorted(included - set(encoded.names))
    if unknown:
        raise ValueError(f"prompts: modules {unknown} are not in encoded schema {encoded.schema!r}")
    scaffolds = sorted(((r, set(name.split("+"))) for r, name in enumerate(encoded.names) if "+" in name),
                       key=lambda s: -len(s[1]))
    rows, covered = [], set()
    for r, members in scaffolds:
        if members <= included and not members & covered:
            rows.append(r)
            covered |= members
    rows += [encoded.names.index(name) for name in layout.modules if name not in covered]
    return tuple(sorted(rows))


def assemble(encoded: EncodedSchema, layout: PromptLayout) -> tuple[np.ndarray, np.ndarray]:
    """`(token_ids, positions)` int32 of the whole prompt sorted by position (stable: module
    tokens, then uncached tokens in prompt order), placeholders left out."""
    rows = prompt_segments(encoded, layout)
    ids = [np.asarray(encoded.token_ids)[encoded.kept(r)] for r in rows] + [layout.new_token_ids]
    pos = [np.asarray(encoded.positions)[encoded.kept(r)] for r in rows] + [layout.new_positions]
    ids, pos = np.concatenate(ids).astype(np.int32), np.concatenate(pos).astype(np.int32)
    order = np.argsort(pos, kind="stable")
    return ids[order], pos[order]


# ------------------------------------------------------------------ prefill at explicit positions
def prefill_at_positions(model: Llama, params: dict, prefix: PrefixCache, tokens_bt: jax.Array,
                         positions_bt: jax.Array, n_tokens_b: jax.Array, *, capacity: int):
    """`Llama.prefill` (backend "shared") with explicit RoPE positions (`Llama.extend`'s
    `positions_bt`).

    `tokens_bt`, `positions_bt`: int32 `[B, T]` left-padded (the last `n_tokens_b[b] >= 1`
    columns of row `b` are real); each real token attends to its prefix path in `prefix` (no
    causal mask there) and causally to the real tokens before it. Returns `(logits [B, V]
    float32 of each row's last token, KVCache)` with `lengths = n_tokens`, `pos_offset` such
    that the next token gets position `positions_bt[:, -1] + 1`, suffix capacity `capacity`."""
    stacked = kvc.is_stacked(params["layers"])
    cache = kvc.init_kv_cache(model.config, prefix, tokens_bt.shape[0], capacity, params["embed"].dtype,
                              backend="shared", stacked=stacked)
    n_b = jnp.asarray(n_tokens_b, jnp.int32)
    positions_bt = jnp.asarray(positions_bt, jnp.int32)
    logits, layers, lengths = model.extend(params, prefix, cache.layers, cache.lengths, cache.pos_offset,
                                           jnp.asarray(tokens_bt, jnp.int32), n_b, backend="shared",
                                           positions_bt=positions_bt)
    return logits, cache.replace(layers=layers, lengths=lengths, pos_offset=positions_bt[:, -1] + 1 - n_b)


@functools.partial(jax.jit, static_argnames=("model", "capacity"))
def _plain_prefill(model, params, tokens_bt, positions_bt, n_b, *, capacity):
    prefix = kvc.empty_prefix_cache(model.config, params["embed"].dtype, stacked=kvc.is_stacked(params["layers"]))
    return prefill_at_positions(model, params, prefix, tokens_bt, positions_bt, n_b, capacity=capacity)


@functools.partial(jax.jit, static_argnames=("model", "capacity", "tree_nodes"))
def _cached_prefill(model, params, level_k, level_v, level_lengths, tokens_bt, positions_bt, n_b, *, capacity,
                    tree_nodes):
    """Level K/V `[L, G_l, P_l, Hkv, D]` into a PrefixCache in the parameters' layout, then prefill."""
    if kvc.is_stacked(params["layers"]):
        layers = {"k": tuple(level_k), "v": tuple(level_v)}
    else:
        layers = [{"k": tuple(k[i] for k in level_k), "v": tuple(v[i] for v in level_v)}
                  for i in range(len(params["layers"]))]
    prefix = PrefixCache(layers=layers, lengths=tuple(level_lengths), last_logits=None, tree_nodes=tree_nodes)
    return prefill_at_positions(model, params, prefix, tokens_bt, positions_bt, n_b, capacity=capacity)


@jax.jit
def _gather_device(k, v, index):
    return tuple(jnp.take(k, i, axis=1) for i in index), tuple(jnp.take(v, i, axis=1) for i in index)


def _gather(encoded: EncodedSchema, index: tuple, rows: Sequence[int]):
    """Level K/V `[L, G, P, Hkv, D]` at packed-axis indices `[G, P]` (rows `rows` are used).

    Device-tier K/V are gathered in place. Host-tier (NumPy) K/V: the used rows only cross to
    the device, adjacent rows as one contiguous run per transfer (all of them in one when the
    prompts use every row), then the same gather runs on the device."""
    if isinstance(encoded.k, jax.Array):
        return _gather_device(encoded.k, encoded.v, index)
    if not index:          # no prompt imports a module: no level, nothing to transfer
        return (), ()
    runs: list = []
    for r in rows:
        sp = encoded.span(r)
        if runs and runs[-1][1] == sp.start:
            runs[-1][1] = sp.stop
        else:
            runs.append([sp.start, sp.stop])
    remap = np.zeros(encoded.tokens, np.int32)
    base = 0
    for a, b in runs:
        remap[a:b] = np.arange(base, base + b - a)
        base += b - a

    def moved(x):
        parts = [jax.device_put(x[:, a:b]) for a, b in runs]
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)

    return _gather_device(moved(encoded.k), moved(encoded.v), tuple(remap[i] for i in index))


# ------------------------------------------------------------------ shared by both paths
def _check(model, params, encoded, prompts, n, max_new_tokens) -> list:
    require_family(model, "Prompt Cache (cached_generate)")
    if not isinstance(model, Llama) or model.model_axis is not None:
        raise TypeError(f"model: received {type(model).__name__}, expected a one-device models.Llama")
    if not isinstance(encoded, EncodedSchema):
        raise TypeError(f"encoded: received {type(encoded).__name__}, expected EncodedSchema")
    prompts = list(prompts) if not isinstance(prompts, PromptLayout) else [prompts]
    if not prompts:
        raise ValueError("prompts: received no prompt, expected at least one PromptLayout")
    for j, p in enumerate(prompts):
        if not isinstance(p, PromptLayout):
            raise TypeError(f"prompts[{j}]: received {type(p).__name__}, expected PromptLayout")
        if p.schema != encoded.schema:
            raise ValueError(f"prompts[{j}]: laid out for schema {p.schema!r}, expected {encoded.schema!r}")
        ids = p.new_token_ids
        if ids.size and (ids.min() < 0 or ids.max() >= model.config.vocab_size):
            raise ValueError(f"prompts[{j}]: token ids span [{ids.min()}, {ids.max()}], expected "
                             f"[0, {model.config.vocab_size})")
    for name, v in (("n", n), ("max_new_tokens", max_new_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: received {v!r}, expected an int >= 1")
    if np.dtype(encoded.k.dtype) != np.dtype(params["embed"].dtype):
        raise ValueError(f"encoded: K/V of dtype {np.dtype(encoded.k.dtype)}, expected the parameters' "
                         f"{np.dtype(params['embed'].dtype)}")
    check_encoded(model.config, params["embed"].dtype, encoded)
    return prompts


def _left_pad(rows_ids: list, rows_pos: list, buckets: bool):
    t = max(len(r) for r in rows_ids)
    t = bucket_length(t) if buckets else t
    toks = np.zeros((len(rows_ids), t), np.int32)
    pos = np.zeros((len(rows_ids), t), np.int32)
    for b, (i, p) in enumerate(zip(rows_ids, rows_pos)):
        toks[b, t - len(i):] = i
        pos[b, t - len(p):] = p
    return toks, pos, np.asarray([len(i) for i in rows_ids], np.int32)


def _capacity(n_b: np.ndarray, max_new_tokens: int, buckets: bool) -> int:
    need = int(n_b.max()) + max_new_tokens
    return bucket_length(need, minimum=64) if buckets else need


@functools.partial(jax.jit, static_argnames=("model", "sampling"))
def _first_token(logits_bv, keys_b, seen_bv, *, model, sampling):
    """The decode loop's first token and its log-probability (same logits, keys, step and
    penalties: `choose_tokens` with no token generated yet), sampled alone for the TTFT."""
    done = jnp.zeros(logits_bv.shape[:1], bool)
    tok, lp, _, _ = choose_tokens(model, logits_bv, keys_b, 0, done, initial_counts(sampling, logits_bv), seen_bv,
                                  cfg=sampling, pad_id=0, top_k=0)
    return tok, lp


def _generate(model, params, logits, cache, t0, order, padding, n, *, max_new_tokens, sampling, seed, keys,
              eos_token_ids, pad_token_id, logprobs, shape_buckets, prompt_token_ids, cached_tokens,
              plan) -> PromptCacheOutput:
    """Sample the first token (TTFT), run the decode loop and put rows in output order; batch
    row `u * n + i` is sample `i` of prompt `order[u]`, dropped when `padding[u]`.
    `prompt_token_ids()` gives the prompts' assembled ids (called after the first token unless
    a penalty needs them: each row's penalties count its prompt's ids). With `max_new_tokens == 1` the first token is the output: no decode step runs (the cache is
    the prefilled one, as the decode loop would return it)."""
    row_prompt = np.repeat(np.asarray(order, np.int32), n)
    row_sample = np.tile(np.arange(n, dtype=np.int32), len(order))
    row_padding = np.repeat(np.asarray(padding, bool), n)
    out_rows = row_prompt * n + row_sample
    if keys is None:
        keys = sample_keys(seed, row_prompt, row_sample)
    else:
        keys = jnp.asarray(keys)
        if keys.shape[0] != len(out_rows):
            raise ValueError(f"keys: received {keys.shape[0]} keys, expected one per prompt and sample "
                             f"({len(out_rows)})")
        keys = keys[jnp.asarray(out_rows)]
    prompt_ids = prompt_token_ids() if sampling.penalized else None
    row_ids = None if prompt_ids is None else [prompt_ids[j] for j in row_prompt]
    seen = prompt_seen(sampling, row_ids, len(row_prompt), model.config.vocab_size)
    first, first_lp = _first_token(logits, keys, seen, model=model, sampling=sampling)
    first = np.asarray(first)
    ttft = time.perf_counter() - t0
    new_tokens = int(np.asarray(cache.lengths).sum())
    if max_new_tokens == 1:
        tokens, lengths, lps = first[:, None], np.ones(len(first), np.int32), np.asarray(first_lp)[:, None]
    else:
        out = generate_from_cache(model, params, cache, logits, max_new_tokens=max_new_tokens, sampling=sampling,
                                  keys=keys, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id,
                                  shape_buckets=shape_buckets, prompt_token_ids=row_ids)
        tokens, lengths, lps, cache = out.tokens, out.lengths, out.logprobs, out.cache
    real = np.flatnonzero(~row_padding)
    pick = real[np.argsort(out_rows[real])]
    return PromptCacheOutput(tokens[pick], lengths[pick], lps[pick] if logprobs else None,
                             tuple(prompt_token_ids() if prompt_ids is None else prompt_ids), ttft, time.perf_counter() - t0, cached_tokens, new_tokens,
                             plan, cache, row_prompt, row_sample, row_padding)


def _level_index(plan: LevelPlan, kept: list, buckets: bool):
    """Per level: indices `[G, P]` into the packed axis of the encoded K/V (`kept[r]`: row `r`'s
    kept tokens) and node lengths `[G]`; `P` is the longest node (bucketed with `buckets`),
    above `PREFIX_ALIGN` rounded up to a multiple of it as `Llama.prefill_prefixes` stores
    levels. Columns past a node's length index token 0 (masked)."""
    index, lengths = [], []
    for nodes, toks in zip(plan.levels, plan.node_tokens):
        p_len = bucket_length(max(toks)) if buckets else max(toks)
        p_len = p_len if p_len <= PREFIX_ALIGN else -(-p_len // PREFIX_ALIGN) * PREFIX_ALIGN
        idx = np.zeros((len(nodes), p_len), np.int32)
        for g, node in enumerate(nodes):
            flat = np.concatenate([kept[r] for r in node]) if node else np.zeros((0,), np.int64)
            idx[g, :len(flat)] = flat
        index.append(idx)
        lengths.append(np.asarray(toks, np.int32))
    return tuple(index), tuple(lengths)


# ------------------------------------------------------------------ the two paths
def cached_generate(model: Llama, params: dict, encoded: EncodedSchema, prompts: Sequence[PromptLayout], *,
                    max_new_tokens: int, n: int = 1, sampling: SamplingConfig = GREEDY, seed: int = 0,
                    keys: jax.Array | None = None, eos_token_ids: Sequence[int] | None = None,
                    pad_token_id: int | None = None, logprobs: bool = False, shape_buckets: bool = False,
                    layout: str = "auto", level_cost: int = MIN_SHARED_TOKENS) -> PromptCacheOutput:
    """Generate for `prompts` from the stored module K/V `encoded` (module docstring).

    `n` samples per prompt; sample `i` of prompt `j` draws with `sample_keys(seed, j, i)` (or
    `keys[j * n + i]`); `eos_token_ids` / `pad_token_id` default to the config's;
    `shape_buckets` rounds the level, suffix and output sizes up (fewer compilations); `layout`
    as in `models.generate.resolve_layout`; `level_cost` as in `plan_levels`. `sampling`'s
    penalties (`models.penalties`) count each prompt's assembled ids (`assemble`) and its
    generated tokens, the first token included, as `models.generate` counts a prompt's ids."""
    t0 = time.perf_counter()
    prompts = _check(model, params, encoded, prompts, n, max_new_tokens)
    params = resolve_layout(model, params, layout)
    kept = [encoded.kept(r) for r in range(len(encoded.names))]
    positions = np.asarray(encoded.positions)
    segments = []
    for j, p in enumerate(prompts):
        rows = prompt_segments(encoded, p)
        last = max((int(positions[kept[r]].max(initial=-1)) for r in rows), default=-1)
        if not p.new_token_ids.size:
            raise ValueError(f"prompts[{j}]: no uncached token; cached inference needs new text at the end of a "
                             f"prompt")
        if int(p.new_positions[-1]) < max(last, int(p.new_positions.max())):
            raise ValueError(f"prompts[{j}]: its last uncached token (position {int(p.new_positions[-1])}) is not "
                             f"at its last position (modules reach {last}); cached inference needs new text at "
                             f"the end of a prompt")
        segments.append(rows)
    plan = plan_levels(segments, [len(c) for c in kept], samples=n, level_cost=level_cost)
    index, lengths = _level_index(plan, kept, shape_buckets)
    rows = [prompts[j] for j in plan.order for _ in range(n)]
    toks, pos, n_b = _left_pad([p.new_token_ids for p in rows], [p.new_positions for p in rows], shape_buckets)
    level_k, level_v = _gather(encoded, index, sorted({r for lv in plan.levels for node in lv for r in node}))
    tree_nodes = tuple(map(tuple, plan.node_tokens)) if model.shared_impl == "tree" else None
    logits, cache = _cached_prefill(model, params, level_k, level_v, lengths, toks, pos, n_b,
                                    capacity=_capacity(n_b, max_new_tokens, shape_buckets), tree_nodes=tree_nodes)
    return _generate(model, params, logits, cache, t0, plan.order, plan.padding, n, max_new_tokens=max_new_tokens,
                     sampling=sampling, seed=seed, keys=keys, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id,
                     logprobs=logprobs, shape_buckets=shape_buckets,
                     prompt_token_ids=lambda: [assemble(encoded, p)[0] for p in prompts],
                     cached_tokens=int(sum(map(sum, plan.node_tokens))), plan=plan)


def prefill_generate(model: Llama, params: dict, encoded: EncodedSchema, prompts: Sequence[PromptLayout], *,
                     max_new_tokens: int, n: int = 1, sampling: SamplingConfig = GREEDY, seed: int = 0,
                     keys: jax.Array | None = None, eos_token_ids: Sequence[int] | None = None,
                     pad_token_id: int | None = None, logprobs: bool = False, shape_buckets: bool = False,
                     layout: str = "auto") -> PromptCacheOutput:
    """The same generation without the cache: an ordinary causal prefill of each prompt's
    assembled tokens at their position ids (every row its own copy), then the same decode loop.
    Arguments as in `cached_generate`."""
    t0 = time.perf_counter()
    prompts = _check(model, params, encoded, prompts, n, max_new_tokens)
    params = resolve_layout(model, params, layout)
    assembled = [assemble(encoded, p) for p in prompts]
    rows = [assembled[j] for j in range(len(prompts)) for _ in range(n)]
    toks, pos, n_b = _left_pad([a[0] for a in rows], [a[1] for a in rows], shape_buckets)
    capacity = _capacity(n_b, max_new_tokens, shape_buckets)
    logits, cache = _plain_prefill(model, params, toks, pos, n_b, capacity=capacity)
    order = tuple(range(len(prompts)))
    return _generate(model, params, logits, cache, t0, order, (False,) * len(order), n, max_new_tokens=max_new_tokens,
                     sampling=sampling, seed=seed, keys=keys, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id,
                     logprobs=logprobs, shape_buckets=shape_buckets, prompt_token_ids=lambda: [a[0] for a in assembled],
                     cached_tokens=0, plan=None)
