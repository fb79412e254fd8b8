"""Text in, text out: :class:`LLM` loads a model and its tokenizer and generates completions of
many prompts, sharing their common prefixes without being told.

    from models import LLM
    llm = LLM.load()                                   # the built-in SmolLM2-135M-Instruct
    out = llm.generate(["The capital of France is", "The capital of Italy is"], n=2, seed=1)
    out[1][0].text, out[1][0].finish_reason           # prompt 1, sample 0
    out.sharing                                        # what was stored once, bytes saved

* :meth:`LLM.load` -- a GGUF file, a Hugging Face directory, or (no path) the built-in model.
* :meth:`LLM.generate` -- a list (one per prompt) of lists (one per sample) of
  :class:`Completion`; the list is a :class:`Generation` with ``.sharing``
  (:class:`~models.prefix_sharing.SharingReport`) and ``.timings`` (:class:`Timings`).
* :meth:`LLM.stream` -- ``(prompt_index, sample_index, text_delta)`` as tokens arrive;
  :meth:`LLM.events` -- the same run as :class:`PhaseEvent`, :class:`TokenEvent`,
  :class:`FinishEvent`, :class:`StepEvent` and a final :class:`DoneEvent` (what ``jpa-sample``
  displays).

Semantics:

* prompts: a string, token ids, or (``chat=True``) a list of ``{"role", "content"}`` messages --
  one of them or a list of them.  ``chat=True`` renders the model's chat template (a string is
  the user message); ``shared_prompt`` is text before every prompt (with ``chat``: the system
  message) and is shared even when shorter than ``MIN_SHARED_TOKENS``.
* sampling: ``temperature`` / ``top_k`` / ``top_p`` with the defaults of
  :data:`~models.sampling.DEFAULT_SAMPLING`; ``temperature=0`` is greedy.  Sample ``i`` of
  prompt ``j`` draws with the key ``fold_in(fold_in(PRNGKey(seed), j), i)``
  (:func:`~models.sampling.sample_keys`) and every row draws independently, so it is the same
  with any ``n`` and any other prompts in the call -- up to floating-point differences of the
  batched forward pass (another batch size or sharing layout can change logits in the last bits,
  which flips a draw only when two candidates are that close).
* ends: a sample stops at an end-of-sequence id of the tokenizer or the config (always), at the
  first occurrence of a ``stop`` string in its text, or after ``max_new_tokens``.
  ``finish_reason`` is ``"stop"`` for the first two, else ``"length"``.  ``text`` excludes the
  end-of-sequence token and the stop string (and anything after it); ``token_ids`` are all
  generated tokens up to and including the one that ended the sample.  With several stop
  strings the one completed first wins.
* ``logprobs=True``: one float per token id, the model's raw log-probability
  ``log_softmax(logits)[token]`` (before temperature, top-k and top-p), as vLLM reports by default.
* sharing: :func:`~models.prefix_sharing.plan_prompt_batch` finds the token prefix common to all
  prompts (a root stored once) and, with ``n > 1``, shares each prompt among its samples (a
  second level).  ``attention`` (``"auto"`` | ``"shared"`` | ``"flat"``) picks the cache layout as
  in :func:`models.generate.generate`; ``"flat"`` still prefills each shared node once.
* speed: ``generate`` without ``stop`` strings runs the fused ``lax.while_loop`` decode
  (:func:`models.generate.generate`); with ``stop`` strings, :meth:`stream` and :meth:`events` it
  runs one jitted step at a time (:func:`models.generate.generate_stream`) and ends when every
  sample has ended.  Array shapes are bucketed (``shape_buckets``), so calls with other prompt
  lengths usually reuse the compiled functions.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import time
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models.config import LlamaConfig
from models.generate import ATTENTION, generate, generate_stream, resolve_attention
from models.gguf import CheckpointError, default_gguf_path, load_gguf, open_gguf
from models.llama import Llama
from models.prefix_sharing import MIN_SHARED_TOKENS, PromptBatch, SharingReport, plan_prompt_batch, sharing_report
from models.sampling import DEFAULT_SAMPLING, SamplingConfig, sample_keys
from models.tokenizer import Tokenizer
from models.weights import load_hf_checkpoint, params_from_hf_state_dict

__all__ = ["DEFAULT_MAX_NEW_TOKENS", "Completion", "CompileWatch", "DoneEvent", "FinishEvent", "Generation", "LLM",
           "PhaseEvent", "StepEvent", "Timings", "TokenEvent", "load_checkpoint", "missing_model_file", "model_for"]

DEFAULT_MAX_NEW_TOKENS = 64
DTYPES = ("float32", "bfloat16", "float16")


# ---------------------------------------------------------------------------------------------
# results and events
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Completion:
    """One sample: ``text``, ``token_ids``, ``finish_reason`` (``"stop"`` | ``"length"``) and
    ``logprobs`` (one per token id, or ``None``); see the module docstring."""
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    logprobs: tuple[float, ...] | None = None


@dataclasses.dataclass(frozen=True)
class Timings:
    """Wall times of one call in seconds.  ``compile_s``: JAX tracing and compilation inside it
    (0 once every shape was compiled before).  ``prefill_s`` (prefill and the first sampling),
    ``first_token_s`` (call start to the first tokens on the host), ``decode_s`` (first to last
    token) and ``decode_compile_s`` are ``None`` for the fused loop, which returns only at the end.
    ``new_tokens``: all generated tokens; ``decode_tokens``: those after each sample's first."""
    total_s: float
    compile_s: float
    new_tokens: int
    decode_tokens: int
    prefill_s: float | None = None
    first_token_s: float | None = None
    decode_s: float | None = None
    decode_compile_s: float | None = None

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Decode rate without the decode step's compilation (``None`` when not measured)."""
        if self.decode_s is None:
            return None
        busy = self.decode_s - (self.decode_compile_s or 0.0)
        return self.decode_tokens / busy if busy > 0 else None


class Generation(list):
    """``list[list[Completion]]`` (prompt, then sample) with ``.sharing``
    (:class:`~models.prefix_sharing.SharingReport`) and ``.timings`` (:class:`Timings`)."""

    def __init__(self, completions, *, sharing: SharingReport, timings: Timings):
        super().__init__(completions)
        self.sharing = sharing
        self.timings = timings


@dataclasses.dataclass(frozen=True)
class PhaseEvent:
    """A phase starts: ``"prefill"`` (including compilation) or ``"decode"``."""
    name: str


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """A generated token of sample ``sample_index`` of prompt ``prompt_index`` and the text it
    adds (``""`` while a character or a possible stop string is incomplete)."""
    prompt_index: int
    sample_index: int
    token_id: int
    logprob: float
    text: str


@dataclasses.dataclass(frozen=True)
class FinishEvent:
    """A sample ended (after its last :class:`TokenEvent`)."""
    prompt_index: int
    sample_index: int
    completion: Completion


@dataclasses.dataclass(frozen=True)
class StepEvent:
    """A decode step ended: ``step`` steps taken, ``new_tokens`` generated, ``running`` samples."""
    step: int
    new_tokens: int
    running: int


@dataclasses.dataclass(frozen=True)
class DoneEvent:
    result: Generation


# ---------------------------------------------------------------------------------------------
# compile time
# ---------------------------------------------------------------------------------------------
_TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
_LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_COMPILE_START_EVENT = "/jax/compilation_cache/compile_requests_use_cache"


class CompileWatch:
    """While active (``with CompileWatch() as w``): ``w.seconds`` of JAX tracing, lowering and
    compilation so far, and ``w.compiling`` (a compilation is running; read from another thread
    for a live display).  Built on ``jax.monitoring`` listeners."""

    def __init__(self):
        self.seconds = 0.0
        self.compiling = False

    def _on_duration(self, event: str, duration: float, **_: Any) -> None:
        if event in (_TRACE_EVENT, _LOWER_EVENT, _COMPILE_EVENT):
            self.seconds += duration
            self.compiling = event != _COMPILE_EVENT

    def _on_event(self, event: str, **_: Any) -> None:
        if event == _COMPILE_START_EVENT:
            self.compiling = True

    def __enter__(self) -> "CompileWatch":
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        jax.monitoring.register_event_listener(self._on_event)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._on_duration)
        jax.monitoring.unregister_event_listener(self._on_event)
        self.compiling = False


# ---------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------
def missing_model_file(path: str) -> str | None:
    """The first file a Hugging Face directory lacks, in the order ``config.json``, the
    safetensors weights, ``tokenizer.json``; None when all are there."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        return "config.json"
    names = os.listdir(path)
    if not any(n.endswith(".safetensors") or n == "model.safetensors.index.json" for n in names):
        return "safetensors weights (model.safetensors, model.safetensors.index.json or *.safetensors)"
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        return "tokenizer.json"
    return None


def _dtype(dtype) -> Any:
    if dtype is None:
        return jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        name = None
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES} (None: bfloat16 on GPU, float32 elsewhere), got {dtype!r}")
    return jnp.dtype(name)


def load_checkpoint(path: str | os.PathLike | None, dtype=None) -> tuple[LlamaConfig, dict, Tokenizer, dict]:
    """``(config, params, tokenizer, info)`` of a GGUF file, a Hugging Face directory or (``None``)
    the built-in model.  A directory is checked for missing files first
    (:func:`missing_model_file`), then read cheapest first: config, tokenizer, weights.  Every
    problem with the files raises :class:`~models.gguf.CheckpointError` (one line).  ``info``:
    ``path``, ``format``, ``name``, ``bytes`` (weight files), ``config_sha256`` (of the config,
    not of the weights), ``num_parameters``, ``dtype``."""
    from safetensors import SafetensorError  # noqa: PLC0415

    dt = _dtype(dtype)
    path = default_gguf_path() if path is None else os.fspath(path)
    try:
        if os.path.isdir(path):
            missing = missing_model_file(path)
            if missing is not None:
                raise CheckpointError(f"model directory {path} has no {missing}")
            LlamaConfig.from_hf_config(path)  # first: an unsupported config is the error to report
            tokenizer = Tokenizer.from_hf_dir(path)
            config, params = load_hf_checkpoint(path, dt)
            weights = [os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors")]
            name, fmt = os.path.basename(os.path.abspath(path)), "hf"
        else:
            f = open_gguf(path)
            hf_config, state = load_gguf(f)  # first: an unsupported architecture is the error to report
            tokenizer = Tokenizer.from_gguf(f)
            config = LlamaConfig.from_hf_config(hf_config)
            params = params_from_hf_state_dict(config, state, dt)
            weights, fmt = [path], "gguf"
            name = f.metadata.get("general.name") or os.path.basename(path)
    except CheckpointError:
        raise
    except ValueError as e:  # config / weight / tokenizer checks
        raise CheckpointError(f"cannot load {path}: {e}") from None
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    except (KeyError, TypeError, AttributeError, SafetensorError) as e:  # malformed JSON or safetensors
        raise CheckpointError(f"cannot load {path}: {type(e).__name__}: {e}") from None
    if tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(f"tokenizer has {tokenizer.vocab_size} tokens but the model only {config.vocab_size}")
    cfg_json = json.dumps(dataclasses.asdict(config), sort_keys=True, default=str)
    info = {"path": os.path.abspath(path), "format": fmt, "name": str(name),
            "bytes": int(sum(os.path.getsize(w) for w in weights)),
            "config_sha256": hashlib.sha256(cfg_json.encode()).hexdigest(),
            "num_parameters": int(sum(x.size for x in jax.tree_util.tree_leaves(params))),
            "dtype": jnp.dtype(dt).name}
    return config, params, tokenizer, info


@functools.lru_cache(maxsize=4)
def model_for(config: LlamaConfig) -> Llama:
    """The :class:`~models.llama.Llama` of ``config``, shared by every :class:`LLM` of that config
    so that they reuse its compiled functions (a CLI run in the same process compiles nothing new)."""
    return Llama(config)


# ---------------------------------------------------------------------------------------------
# text of one sample: stop strings and deltas
# ---------------------------------------------------------------------------------------------
class _SampleText:
    """Decodes one sample's tokens incrementally; finds stop strings; holds back text that may
    be the start of a stop string, so deltas never contain one."""

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...], eos: frozenset):
        self._dec = tokenizer.stream_decoder(skip_special_tokens=True)
        self._stops = stops
        self._longest = max((len(s) for s in stops), default=0)
        self._eos = eos
        self.text = ""
        self._emitted = 0
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish: str | None = None

    def push(self, token_id: int, logprob: float, last: bool) -> str:
        """Add a token (``last``: the step limit is reached); returns the new text."""
        self.token_ids.append(int(token_id))
        self.logprobs.append(float(logprob))
        if token_id in self._eos:
            return self._add(self._dec.flush(), end="stop")
        piece = self._dec.push(int(token_id))
        if last:
            return self._add(piece + self._dec.flush(), end="length")
        return self._add(piece, end=None)

    def _add(self, piece: str, end: str | None) -> str:
        start = max(0, len(self.text) - self._longest + 1)
        self.text += piece
        hits = [p for p in (self.text.find(s, start) for s in self._stops) if p >= 0]
        if hits:
            cut = max(min(hits), self._emitted)
            self.text, self.finish = self.text[:cut], "stop"
        elif end is not None:
            self.finish = end
        safe = len(self.text) if self.finish else len(self.text) - self._held()
        delta, self._emitted = self.text[self._emitted:safe], max(safe, self._emitted)
        return delta

    def _held(self) -> int:
        """Length of the longest end of the text that is a proper start of a stop string."""
        for k in range(min(self._longest - 1, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(len(s) > k and s.startswith(tail) for s in self._stops):
                return k
        return 0

    def completion(self, logprobs: bool) -> Completion:
        return Completion(text=self.text, token_ids=tuple(self.token_ids), finish_reason=self.finish or "length",
                          logprobs=tuple(self.logprobs) if logprobs else None)


# ---------------------------------------------------------------------------------------------
# requests
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Request:
    prompt_ids: tuple[tuple[int, ...], ...]
    n: int
    batch: PromptBatch
    attention: str
    sampling: SamplingConfig
    keys: Any
    max_new_tokens: int
    stops: tuple[str, ...]
    logprobs: bool
    sharing: SharingReport


def _is_messages(x) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(m, dict) for m in x)


def _is_token_ids(x) -> bool:
    return (isinstance(x, (list, tuple, np.ndarray)) and len(x) > 0
            and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in x))


def _prompt_list(prompts) -> list:
    if isinstance(prompts, str) or _is_messages(prompts) or _is_token_ids(prompts):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a string, token ids, chat messages or a list of them, "
                        f"got {type(prompts).__name__}")
    if not prompts:
        raise ValueError("prompts must hold at least one prompt, got an empty list")
    return list(prompts)


def _stop_strings(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    for s in stops:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    return stops


def _check_int(name: str, v, lo: int) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")


class LLM:
    """A Llama model with its tokenizer and compiled functions (see module docstring).

    ``LLM(config, params, tokenizer, attention=..., info=...)`` wraps parameters you already
    have; :meth:`load` reads them.  Attributes: ``config``, ``params``, ``tokenizer``, ``model``
    (:class:`~models.llama.Llama`, holding the compiled functions), ``attention`` (default of
    :meth:`generate`), ``eos_token_ids`` (the config's and the tokenizer's), ``info``.
    """

    def __init__(self, config: LlamaConfig, params: dict, tokenizer: Tokenizer, *, attention: str = "auto",
                 info: dict | None = None):
        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
        self.config = config
        self.params = params
        self.tokenizer = tokenizer
        self.model = model_for(config)
        self.attention = attention
        self.eos_token_ids = tuple(sorted(set(config.eos_token_ids) | set(tokenizer.stop_token_ids)))
        self.info = dict(info or {})
        layer = params["embed"].dtype.itemsize * config.num_key_value_heads * config.head_dim
        self.kv_bytes_per_token = 2 * config.num_hidden_layers * layer

    @classmethod
    def load(cls, path: str | os.PathLike | None = None, *, dtype=None, attention: str = "auto") -> "LLM":
        """A GGUF file, a Hugging Face directory, or (``None``) the built-in SmolLM2-135M-Instruct.
        ``dtype``: ``"float32"``, ``"bfloat16"``, ``"float16"`` or None (bfloat16 on GPU, float32
        elsewhere).  Raises :class:`~models.gguf.CheckpointError` for unusable files."""
        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
        config, params, tokenizer, info = load_checkpoint(path, dtype)
        return cls(config, params, tokenizer, attention=attention, info=info)

    def __repr__(self) -> str:
        name = self.info.get("name", "llama")
        return f"LLM({name!r}, {self.config.num_hidden_layers} layers, attention={self.attention!r})"

    # -- prompts ----------------------------------------------------------------------------
    def prompt_text(self, prompt, *, chat: bool = False, shared_prompt: str | None = None) -> str | None:
        """The text a prompt is tokenized from (chat template rendered); None for token ids."""
        if _is_token_ids(prompt):
            if chat:
                raise TypeError("chat=True needs prompts as text or messages, got token ids")
            return None
        if not chat:
            if not isinstance(prompt, str):
                raise TypeError(f"a prompt must be a string or token ids (messages need chat=True), got "
                                f"{type(prompt).__name__}")
            return (shared_prompt or "") + prompt
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if not _is_messages(messages):
            raise TypeError(f"with chat=True a prompt must be a string or a list of messages, got {prompt!r}")
        if shared_prompt is not None:
            if any(m.get("role") == "system" for m in messages):
                raise ValueError("shared_prompt is the system message with chat=True, but a prompt has one already")
            messages = [{"role": "system", "content": shared_prompt}] + messages
        return self.tokenizer.apply_chat_template(messages)

    def prompt_ids(self, prompt, *, chat: bool = False, shared_prompt: str | None = None) -> list[int]:
        """The token ids of one prompt as :meth:`generate` reads it."""
        text = self.prompt_text(prompt, chat=chat, shared_prompt=shared_prompt)
        if text is None:
            head = self.tokenizer.encode(shared_prompt) if shared_prompt else []
            return head + [int(t) for t in prompt]
        return self.tokenizer.encode(text, add_special_tokens=not chat)

    def _prepare(self, prompts, *, n, max_new_tokens, temperature, top_p, top_k, seed, stop, chat, logprobs,
                 shared_prompt, attention) -> _Request:
        _check_int("n", n, 1)
        _check_int("max_new_tokens", max_new_tokens, 1)
        sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
        stops = _stop_strings(stop)
        if shared_prompt is not None and not isinstance(shared_prompt, str):
            raise TypeError(f"shared_prompt must be a string, got {type(shared_prompt).__name__}")
        attention = self.attention if attention is None else attention
        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
        ids = [self.prompt_ids(p, chat=chat, shared_prompt=shared_prompt) for p in _prompt_list(prompts)]
        ctx = self.config.max_position_embeddings
        for j, p in enumerate(ids):
            if not p:
                raise ValueError(f"empty prompt: prompt {j} has 0 tokens")
            if len(p) + max_new_tokens > ctx:
                raise ValueError(f"prompt {j} ({len(p)} tokens) + max_new_tokens ({max_new_tokens}) = "
                                 f"{len(p) + max_new_tokens} exceeds the model's context of {ctx} tokens")
        batch = plan_prompt_batch(ids, n, min_shared_tokens=1 if shared_prompt else MIN_SHARED_TOKENS)
        batch.validate(self.config.vocab_size, max_new_tokens=max_new_tokens)
        layout = resolve_attention(batch, attention)
        rows = np.arange(batch.batch)
        keys = sample_keys(seed, rows // n, rows % n)
        report = sharing_report(batch, attention=layout, bytes_per_token=self.kv_bytes_per_token,
                                max_new_tokens=max_new_tokens)
        return _Request(prompt_ids=tuple(tuple(p) for p in ids), n=n, batch=batch, attention=layout,
                        sampling=sampling, keys=keys, max_new_tokens=max_new_tokens, stops=stops,
                        logprobs=bool(logprobs), sharing=report)

    # -- generation -------------------------------------------------------------------------
    def generate(self, prompts, *, n: int = 1, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
                 temperature: float = DEFAULT_SAMPLING.temperature, top_p: float = DEFAULT_SAMPLING.top_p,
                 top_k: int = DEFAULT_SAMPLING.top_k, seed: int = 0, stop: str | Sequence[str] | None = None,
                 chat: bool = False, logprobs: bool = False, shared_prompt: str | None = None,
                 attention: str | None = None) -> Generation:
        """``n`` completions of every prompt (see module docstring); ``attention`` overrides the
        default given to :meth:`load` for this call."""
        req = self._prepare(prompts, n=n, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                            top_k=top_k, seed=seed, stop=stop, chat=chat, logprobs=logprobs,
                            shared_prompt=shared_prompt, attention=attention)
        if req.stops:
            for ev in self._run(req, time.perf_counter()):
                if isinstance(ev, DoneEvent):
                    return ev.result
        t0 = time.perf_counter()
        with CompileWatch() as watch:
            out = generate(self.model, self.params, req.batch, max_new_tokens=req.max_new_tokens,
                           attention=req.attention, sampling=req.sampling, keys=req.keys,
                           eos_token_ids=self.eos_token_ids, shape_buckets=True)
        total = time.perf_counter() - t0
        texts = [self._text(req) for _ in range(req.batch.batch)]
        for b, t in enumerate(texts):
            m = int(out.lengths[b])
            for s in range(m):
                t.push(int(out.tokens[b, s]), float(out.logprobs[b, s]), last=s + 1 == req.max_new_tokens)
                if t.finish:
                    break
        new = int(out.lengths.sum())
        timings = Timings(total_s=total, compile_s=watch.seconds, new_tokens=new, decode_tokens=new - req.batch.batch)
        return self._result(req, texts, timings)

    def stream(self, prompts, **kwargs) -> Iterator[tuple[int, int, str]]:
        """Same arguments as :meth:`generate`; yields ``(prompt_index, sample_index, text_delta)``
        as tokens arrive (non-empty deltas; a sample's deltas join to its ``generate`` text)."""
        for ev in self.events(prompts, **kwargs):
            if isinstance(ev, TokenEvent) and ev.text:
                yield ev.prompt_index, ev.sample_index, ev.text

    def events(self, prompts, *, n: int = 1, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
               temperature: float = DEFAULT_SAMPLING.temperature, top_p: float = DEFAULT_SAMPLING.top_p,
               top_k: int = DEFAULT_SAMPLING.top_k, seed: int = 0, stop: str | Sequence[str] | None = None,
               chat: bool = False, logprobs: bool = False, shared_prompt: str | None = None,
               attention: str | None = None) -> Iterator:
        """Same arguments as :meth:`generate`; yields the run's events (module docstring).
        Arguments are checked before the first ``next()``."""
        t0 = time.perf_counter()
        req = self._prepare(prompts, n=n, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                            top_k=top_k, seed=seed, stop=stop, chat=chat, logprobs=logprobs,
                            shared_prompt=shared_prompt, attention=attention)
        return self._run(req, t0)

    def _text(self, req: _Request) -> _SampleText:
        return _SampleText(self.tokenizer, req.stops, frozenset(self.eos_token_ids))

    def _result(self, req: _Request, texts: list[_SampleText], timings: Timings) -> Generation:
        comps = [t.completion(req.logprobs) for t in texts]
        return Generation([comps[j * req.n:(j + 1) * req.n] for j in range(len(req.prompt_ids))],
                          sharing=req.sharing, timings=timings)

    def _run(self, req: _Request, t0: float) -> Iterator:
        b, n, m = req.batch.batch, req.n, req.max_new_tokens
        texts = [self._text(req) for _ in range(b)]
        new_tokens = 0
        t_prefill = time.perf_counter()
        t_first = None
        with CompileWatch() as watch:
            yield PhaseEvent("prefill")
            steps = generate_stream(self.model, self.params, req.batch, max_new_tokens=m, attention=req.attention,
                                    sampling=req.sampling, keys=req.keys, eos_token_ids=self.eos_token_ids,
                                    shape_buckets=True, logprobs=True)
            try:
                for step, (tok, lp) in enumerate(steps):
                    if step == 0:
                        t_first, compile_at_first = time.perf_counter(), watch.seconds
                        yield PhaseEvent("decode")
                    for r in range(b):
                        t = texts[r]
                        if t.finish:
                            continue
                        delta = t.push(int(tok[r]), float(lp[r]), last=step + 1 == m)
                        new_tokens += 1
                        yield TokenEvent(r // n, r % n, int(tok[r]), float(lp[r]), delta)
                        if t.finish:
                            yield FinishEvent(r // n, r % n, t.completion(req.logprobs))
                    running = sum(not t.finish for t in texts)
                    yield StepEvent(step + 1, new_tokens, running)
                    if not running:
                        break
            finally:
                steps.close()
            t_end = time.perf_counter()
            compile_s = watch.seconds
        timings = Timings(total_s=t_end - t0, compile_s=compile_s, new_tokens=new_tokens,
                          decode_tokens=new_tokens - b, prefill_s=t_first - t_prefill, first_token_s=t_first - t0,
                          decode_s=t_end - t_first, decode_compile_s=compile_s - compile_at_first)
        yield DoneEvent(self._result(req, texts, timings))
