"""Prompt batches as prefix trees, automatic detection of shared token prefixes, and the report
of what sharing saved.

* :class:`PromptBatch` -- ``B`` prompts described as a prefix tree: ``levels[l]`` holds the
  ``G_l`` distinct prefix nodes of level ``l`` (``G_{l-1}`` divides ``G_l``; the children of a
  node are contiguous) and ``suffixes[b]`` is sequence ``b``'s own continuation (may be empty);
  sequence ``b`` hangs from node ``b // (B // G_l)`` of each level.  Constructors:
  :meth:`PromptBatch.plain` (no sharing), :meth:`PromptBatch.shared` (one shared prefix, e.g.
  ``N`` samples of one prompt or several questions about one document) and
  :meth:`PromptBatch.two_level` (a shared root, one middle part per group, ``N`` samples each).
  :meth:`PromptBatch.single_level` folds the levels into one (each deepest node with its path),
  for a cache that holds one level of shared prompts.  :meth:`PromptBatch.validate` raises
  ``ValueError`` naming the numbers for empty prompts, token ids outside the vocabulary, group
  sizes that do not divide, and prompts plus ``max_new_tokens`` beyond the cache capacity.
* :func:`plan_prompt_batch` -- the batch for ``n`` samples of each of ``P`` tokenized prompts,
  rows ordered ``j * n + i`` (sample ``i`` of prompt ``j``): the longest token prefix common to
  all prompts becomes a shared root when it has at least ``min_shared_tokens`` tokens, and with
  ``n > 1`` each prompt is a node shared by its ``n`` samples -- two levels when both apply.
* :class:`SharingReport` / :func:`sharing_report` -- tokens stored once instead of per sequence
  and the KV-cache bytes that saves.
* :func:`bucket_length` -- array lengths rounded up so that calls with different prompt lengths
  reuse compiled functions.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

__all__ = ["ATTENTION_CACHE_LAYOUTS", "MIN_SHARED_TOKENS", "PromptBatch", "SharingReport", "bucket_length",
           "common_prefix_len", "format_bytes", "plan_prompt_batch", "sharing_report"]

# Cache layouts a batch can be validated for (``"none"`` skips attention: benchmarks only).
ATTENTION_CACHE_LAYOUTS = ("shared", "flat", "none")

# A prefix common to all prompts becomes its own shared level from this many tokens on: a level
# adds an attention pass and an exact merge per layer and step, which a few tokens do not repay.
MIN_SHARED_TOKENS = 16


def _as_tokens(name: str, toks) -> tuple[int, ...]:
    arr = np.asarray(toks)
    if arr.ndim != 1 or not (arr.size == 0 or np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"{name} must be a 1-D sequence of integer token ids, got shape {arr.shape} "
                         f"dtype {arr.dtype}")
    return tuple(int(t) for t in arr)


def bucket_length(n: int, minimum: int = 16) -> int:
    """``n`` rounded up to a power of two (at least ``minimum``) up to 1024, to a multiple of 1024
    above: at most 2x padding for short arrays, < 2x for long ones, few distinct shapes."""
    n = max(int(n), 1)
    if n <= 1024:
        return max(minimum, 1 << (n - 1).bit_length())
    return -(-n // 1024) * 1024


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """``B`` prompts as shared prefix levels plus per-sequence suffixes (see module docstring)."""
    levels: tuple[tuple[tuple[int, ...], ...], ...]
    suffixes: tuple[tuple[int, ...], ...]

    def __post_init__(self):
        levels = tuple(tuple(_as_tokens(f"levels[{l}][{g}]", n) for g, n in enumerate(lv))
                       for l, lv in enumerate(self.levels))
        object.__setattr__(self, "levels", levels)
        object.__setattr__(self, "suffixes", tuple(_as_tokens(f"suffixes[{b}]", s)
                                                   for b, s in enumerate(self.suffixes)))

    # -- constructors ------------------------------------------------------------------------
    @classmethod
    def plain(cls, prompts: Sequence[Sequence[int]]) -> "PromptBatch":
        """Independent prompts, nothing shared."""
        return cls(levels=(), suffixes=tuple(prompts))

    @classmethod
    def shared(cls, prefix: Sequence[int], suffixes: Sequence[Sequence[int]] | None = None,
               num_samples: int = 1) -> "PromptBatch":
        """One shared prefix; each suffix (default: one empty suffix) sampled ``num_samples`` times."""
        sufs = [()] if suffixes is None else list(suffixes)
        return cls(levels=((prefix,),), suffixes=tuple(s for s in sufs for _ in range(num_samples)))

    @classmethod
    def two_level(cls, root: Sequence[int], middles: Sequence[Sequence[int]], num_samples: int = 1,
                  suffixes: Sequence[Sequence[int]] | None = None) -> "PromptBatch":
        """Shared ``root``, one middle part per group, ``num_samples`` sequences per group
        (``suffixes``: optional per-sequence continuations, ``len(middles) * num_samples`` of them)."""
        b = len(middles) * num_samples
        sufs = tuple(() for _ in range(b)) if suffixes is None else tuple(suffixes)
        return cls(levels=((root,), tuple(middles)), suffixes=sufs)

    # -- derived -----------------------------------------------------------------------------
    @property
    def batch(self) -> int:
        return len(self.suffixes)

    def level_sizes(self) -> tuple[int, ...]:
        return tuple(len(lv) for lv in self.levels)

    def path_lengths(self) -> np.ndarray:
        """Prefix path length of each sequence ``[B]``."""
        b = self.batch
        out = np.zeros((b,), np.int64)
        for lv in self.levels:
            per = b // len(lv)
            out += np.asarray([len(lv[i // per]) for i in range(b)], np.int64)
        return out

    def suffix_lengths(self) -> np.ndarray:
        return np.asarray([len(s) for s in self.suffixes], np.int64)

    def full_prompt(self, b: int) -> list[int]:
        """Sequence ``b``'s whole prompt (prefix path + suffix)."""
        toks: list[int] = []
        for lv in self.levels:
            toks += lv[b // (self.batch // len(lv))]
        return toks + list(self.suffixes[b])

    def validate(self, vocab_size: int, *, max_new_tokens: int | None = None, capacity: int | None = None,
                 attention: str = "shared") -> int:
        """Raise ``ValueError`` on bad input; return the cache capacity the batch needs with the
        ``attention`` cache layout (``"shared"``, ``"flat"`` or ``"none"``)."""
        b = self.batch
        if b < 1:
            raise ValueError("the batch must hold at least one sequence, got 0 suffixes")
        prev = 1
        for l, lv in enumerate(self.levels):
            if len(lv) < 1:
                raise ValueError(f"prefix level {l} has no node")
            if len(lv) % prev:
                raise ValueError(f"mismatched group sizes: prefix level {l} has {len(lv)} nodes, not a multiple "
                                 f"of the {prev} nodes of level {l - 1} (each node needs the same number of "
                                 f"children)")
            prev = len(lv)
            for g, node in enumerate(lv):
                if not node:
                    raise ValueError(f"empty prompt: prefix node {g} of level {l} has 0 tokens")
        if b % prev:
            raise ValueError(f"mismatched group sizes: {b} sequences cannot be split evenly over the {prev} "
                             f"nodes of the deepest prefix level")
        for name, toks in ([(f"levels[{l}][{g}]", n) for l, lv in enumerate(self.levels) for g, n in enumerate(lv)]
                           + [(f"suffixes[{i}]", s) for i, s in enumerate(self.suffixes)]):
            if toks and (min(toks) < 0 or max(toks) >= vocab_size):
                bad = min(toks) if min(toks) < 0 else max(toks)
                raise ValueError(f"token id {bad} in {name} is outside the vocabulary [0, {vocab_size})")
        suf = self.suffix_lengths()
        if not self.levels and (suf == 0).any():
            i = int(np.argmin(suf))
            raise ValueError(f"empty prompt: sequence {i} has 0 tokens (no prefix and an empty suffix)")
        if attention not in ATTENTION_CACHE_LAYOUTS:
            raise ValueError(f"attention must be one of {ATTENTION_CACHE_LAYOUTS}, got {attention!r}")
        if max_new_tokens is not None and (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int)
                                           or max_new_tokens < 1):
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        held = suf + (self.path_lengths() if attention == "flat" else 0)
        need = int(held.max()) + (max_new_tokens or 0)
        if capacity is not None and need > capacity:
            i = int(np.argmax(held))
            where = "prefix path + suffix" if attention == "flat" else "suffix"
            raise ValueError(f"sequence {i}'s prompt ({where}: {int(held[i])} tokens) + max_new_tokens "
                             f"({max_new_tokens or 0}) = {need} exceeds the cache capacity {capacity}")
        return need

    def single_level(self) -> "PromptBatch":
        """The same prompts with their prefix levels folded into one: each node of the deepest
        level with its whole path (its ancestors' tokens first); a batch of at most one level is
        returned as it is."""
        if len(self.levels) <= 1:
            return self
        g = len(self.levels[-1])
        per, paths = self.batch // g, self.path_lengths()
        nodes = tuple(tuple(self.full_prompt(j * per)[:int(paths[j * per])]) for j in range(g))
        return PromptBatch(levels=(nodes,), suffixes=self.suffixes)

    # -- arrays ------------------------------------------------------------------------------
    def level_arrays(self, *, buckets: bool = False) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
        """Left-padded node tokens ``[G_l, P_l]`` and lengths ``[G_l]`` per level (``buckets``:
        ``P_l`` rounded up by :func:`bucket_length`)."""
        toks, lens = [], []
        for lv in self.levels:
            p = max(len(n) for n in lv)
            p = bucket_length(p) if buckets else p
            arr = np.zeros((len(lv), p), np.int32)
            for g, n in enumerate(lv):
                arr[g, p - len(n):] = n
            toks.append(arr)
            lens.append(np.asarray([len(n) for n in lv], np.int32))
        return tuple(toks), tuple(lens)

    def suffix_arrays(self, *, buckets: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Left-padded suffixes ``[B, T]`` and their lengths ``[B]`` (``buckets``: a nonzero ``T``
        rounded up by :func:`bucket_length`)."""
        t = max((len(s) for s in self.suffixes), default=0)
        t = bucket_length(t) if buckets and t else t
        arr = np.zeros((self.batch, t), np.int32)
        for i, s in enumerate(self.suffixes):
            if s:
                arr[i, t - len(s):] = s
        return arr, self.suffix_lengths().astype(np.int32)


# ---------------------------------------------------------------------------------------------
# automatic detection
# ---------------------------------------------------------------------------------------------
def common_prefix_len(seqs: Sequence[Sequence[int]]) -> int:
    """Length of the longest token prefix common to all of ``seqs`` (0 for no sequence)."""
    if not seqs:
        return 0
    n = min(len(s) for s in seqs)
    for i in range(n):
        t = seqs[0][i]
        if any(s[i] != t for s in seqs):
            return i
    return n


def plan_prompt_batch(prompts: Sequence[Sequence[int]], n: int = 1, *,
                      min_shared_tokens: int = MIN_SHARED_TOKENS) -> PromptBatch:
    """The :class:`PromptBatch` of ``n`` samples of each prompt (row ``j * n + i``: sample ``i``
    of prompt ``j``), sharing what can be shared.

    * one prompt: with ``n > 1`` the prompt is one node shared by the ``n`` samples;
    * several prompts whose common token prefix has ``r >= min_shared_tokens`` tokens: that
      prefix is a shared root; with ``n == 1`` each prompt's rest is its sequence's suffix (may
      be empty), with ``n > 1`` it is a second-level node shared by the prompt's samples (the
      root then stops one token short of the shortest prompt, so no node is empty);
    * otherwise with ``n > 1`` one level of the whole prompts, and with ``n == 1`` nothing shared.
    """
    prompts = [list(p) for p in prompts]
    if not prompts:
        raise ValueError("prompts must hold at least one prompt, got 0")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    for j, p in enumerate(prompts):
        if not p:
            raise ValueError(f"empty prompt: prompt {j} has 0 tokens")
    if len(prompts) == 1:
        return PromptBatch.shared(prompts[0], num_samples=n) if n > 1 else PromptBatch.plain(prompts)
    r = common_prefix_len(prompts)
    if n > 1:
        r = min(r, min(len(p) for p in prompts) - 1)
    if r >= max(min_shared_tokens, 1):
        root, rests = prompts[0][:r], [p[r:] for p in prompts]
        if n == 1:
            return PromptBatch.shared(root, suffixes=rests)
        return PromptBatch.two_level(root, rests, num_samples=n)
    if n > 1:
        return PromptBatch(levels=(tuple(tuple(p) for p in prompts),),
                           suffixes=tuple(() for _ in range(len(prompts) * n)))
    return PromptBatch.plain(prompts)


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------
def format_bytes(n: float) -> str:
    """``1536 -> '1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


@dataclasses.dataclass(frozen=True)
class SharingReport:
    """What a batch shared.

    * ``attention``: the cache layout used, ``"shared"`` (shared levels stored once) or
      ``"flat"`` (every sequence its own copy of its whole prompt);
    * ``sequences``; ``levels``: per shared level ``(nodes, tokens of each node)``;
    * ``prompt_tokens``: the prompt tokens of all sequences counted per sequence (what a flat
      cache holds); ``prefill_tokens``: tokens run through prefill (each node once plus suffixes);
    * ``tokens_shared``: prompt tokens the cache does not hold per sequence (0 for ``"flat"``);
    * ``bytes_per_token``: KV bytes of one token over all layers; ``bytes_saved`` =
      ``tokens_shared * bytes_per_token``;
    * ``kv_bytes`` / ``kv_bytes_flat``: KV cache the batch needs (prompts, padding to each
      level's longest node, ``max_new_tokens`` per sequence) with the layout used and with flat.
    """
    attention: str
    sequences: int
    levels: tuple[tuple[int, tuple[int, ...]], ...]
    prompt_tokens: int
    prefill_tokens: int
    tokens_shared: int
    bytes_per_token: int
    kv_bytes: int
    kv_bytes_flat: int

    @property
    def bytes_saved(self) -> int:
        return self.tokens_shared * self.bytes_per_token

    def __str__(self) -> str:
        if not self.levels:
            seqs = f"{self.sequences} sequence{'s' if self.sequences > 1 else ''}"
            return f"nothing shared ({seqs}, {self.prompt_tokens} prompt tokens)"
        lv = ", ".join(f"{nodes} node{'s' if nodes > 1 else ''} of {min(t)}"
                       + (f"-{max(t)}" if max(t) != min(t) else "") + " tokens" for nodes, t in self.levels)
        stored = (f"{self.tokens_shared} of {self.prompt_tokens} prompt tokens stored once, KV cache "
                  f"{format_bytes(self.kv_bytes)} vs {format_bytes(self.kv_bytes_flat)} flat"
                  if self.attention == "shared" else
                  f"KV cache {format_bytes(self.kv_bytes)} flat (the shared layout would store "
                  f"{self.prompt_tokens - self.prefill_tokens} fewer prompt tokens)")
        return (f"shared levels: {lv}; {self.sequences} sequences; prefill {self.prefill_tokens} of "
                f"{self.prompt_tokens} prompt tokens; {stored}")


def sharing_report(batch: PromptBatch, *, attention: str, bytes_per_token: int,
                   max_new_tokens: int) -> SharingReport:
    """The :class:`SharingReport` of ``batch`` decoded with the ``attention`` cache layout."""
    suf = batch.suffix_lengths()
    prompt = batch.path_lengths() + suf
    stored = sum(len(n) for lv in batch.levels for n in lv) + int(suf.sum())
    shared_alloc = sum(len(lv) * max(len(n) for n in lv) for lv in batch.levels)
    shared_alloc += batch.batch * (int(suf.max()) + max_new_tokens)
    flat_alloc = batch.batch * (int(prompt.max()) + max_new_tokens)
    flat = attention != "shared"
    return SharingReport(
        attention=attention, sequences=batch.batch,
        levels=tuple((len(lv), tuple(len(n) for n in lv)) for lv in batch.levels),
        prompt_tokens=int(prompt.sum()), prefill_tokens=stored,
        tokens_shared=0 if flat else int(prompt.sum()) - stored, bytes_per_token=bytes_per_token,
        kv_bytes=(flat_alloc if flat else shared_alloc) * bytes_per_token,
        kv_bytes_flat=flat_alloc * bytes_per_token)
