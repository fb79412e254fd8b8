"""Text in, text out: :class:`LLM` loads a model and its tokenizer and generates completions of
many prompts, sharing their common prefixes without being told.

    from models import LLM
    llm = LLM.load()                                   # the built-in SmolLM2-135M-Instruct
    out = llm.generate(["The capital of France is", "The capital of Italy is"], n=2, seed=1)
    out[1][0].text, out[1][0].finish_reason           # prompt 1, sample 0
    out.sharing                                        # what was stored once, bytes saved

* :meth:`LLM.load` -- a GGUF file, a Hugging Face directory, or (no path) the built-in model;
  ``tensor_parallel=`` / ``data_parallel=`` (or ``mesh=``) run it on several devices.  A
  directory's family is picked from its ``config.json`` (:mod:`models.families`): Llama, or
  DeepSeek-V2/V3 (``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM``), which ``generate``,
  ``stream`` and ``events`` run with every sampling option through the same engine
  (:class:`~models.decoder.Decoder`); several devices, the Prompt Cache and GGUF files are
  Llama-only (``NotImplementedError`` naming the feature and the family); ``prompt_logprobs``,
  ``completion_logprobs`` and GRPO run both families.
* :meth:`LLM.generate` -- a list (one per prompt) of lists (one per sample) of
  :class:`~models.completion.Completion`; the list is a :class:`~models.completion.Generation`
  with ``.sharing`` (:class:`~models.prefix_sharing.SharingReport`) and ``.timings``
  (:class:`~models.completion.Timings`).
* :meth:`LLM.stream` -- ``(prompt_index, sample_index, text_delta)`` as tokens arrive (with
  ``logprobs``: one item per token, ``(..., text_delta, (token_id, logprob, top_logprobs))``);
  :meth:`LLM.events` -- the same run as :class:`~models.completion.PhaseEvent`,
  :class:`~models.completion.TokenEvent`, :class:`~models.completion.FinishEvent`,
  :class:`~models.completion.StepEvent` and a final :class:`~models.completion.DoneEvent`
  (what ``jpa-sample`` displays).

Semantics:

* prompts: a string, token ids, or (``chat=True``) a list of ``{"role", "content"}`` messages --
  one of them or a list of them.  ``chat=True`` renders the model's chat template (a string is
  the user message); ``shared_prompt`` is text before every prompt (with ``chat``: the system
  message) and is shared even when shorter than ``MIN_SHARED_TOKENS``.  A text prompt that is empty
  or only whitespace (without ``chat``: after ``shared_prompt``) is a ``ValueError`` naming
  ``prompts``, as ``jpa-sample`` refuses it.
* options: a :class:`~models.sampling_params.SamplingParams` (second argument or
  ``sampling=``) and / or its fields as keywords -- ``n``, ``max_new_tokens``, ``temperature``,
  ``top_k``, ``top_p``, ``min_p``, the repetition / presence / frequency penalties, ``seed``,
  ``stop``, ``stop_token_ids``, ``ignore_eos``, ``include_stop_str_in_output``, ``logprobs``,
  ``prompt_logprobs`` (their rules: :mod:`models.sampling_params`).  A keyword that differs from
  the given object's value is a ``ValueError``.
* sampling: ``temperature`` / ``top_k`` / ``top_p`` with the defaults of
  :data:`~models.sampling.DEFAULT_SAMPLING`; ``temperature=0`` is greedy.  ``seed=None`` draws a
  random seed, reported as ``Generation.seed``.  Sample ``i`` of
  prompt ``j`` draws with the key ``fold_in(fold_in(PRNGKey(seed), j), i)``
  (:func:`~models.sampling.sample_keys`) and every row draws independently, so it is the same
  with any ``n`` and any other prompts in the call -- up to floating-point differences of the
  batched forward pass (another batch size or sharing layout can change logits in the last bits,
  which flips a draw only when two candidates are that close).
* ends: a sample stops at an end-of-sequence id of the tokenizer or the config (unless
  ``ignore_eos``), at one of ``stop_token_ids``, at the first occurrence of a ``stop`` string in
  its text, or after ``max_new_tokens``.  ``finish_reason`` is ``"stop"`` for the first three,
  else ``"length"``; ``stop_reason`` is the matched stop string or stop token id (``None`` for an
  end-of-sequence id or the length).  ``text`` excludes the ending token and the stop string
  (and anything after it) unless ``include_stop_str_in_output``; ``token_ids`` are all
  generated tokens up to and including the one that ended the sample.  With several stop
  strings the one completed first wins (:mod:`models.sample_text`).
* ``logprobs=True`` (or 0): one float per token id, the model's raw log-probability
  ``log_softmax(logits)[token]`` (before penalties, temperature, min-p, top-k and top-p), as vLLM
  reports by default; ``logprobs=k >= 1`` adds ``top_logprobs``, the ``k`` most probable ids of
  that distribution at each step.  ``prompt_logprobs``: the same for the prompt tokens
  (:mod:`models.prompt_logprobs`).  :meth:`stream` yields them per token when asked.
* sharing: :func:`~models.prefix_sharing.plan_prompt_batch` finds the token prefix common to all
  prompts (a root stored once) and, with ``n > 1``, shares each prompt among its samples (a
  second level).  ``attention`` (``"auto"`` | ``"shared"`` | ``"flat"``) picks the cache layout as
  in :func:`models.generate.generate`; ``"flat"`` still prefills each shared node once.
* several devices: ``LLM.load(..., tensor_parallel=T, data_parallel=D)`` builds a ``(D, T)``
  ``("data", "model")`` mesh of the first ``T * D`` devices (:func:`models.sharding.make_mesh`),
  places every parameter block straight into its device (the model is never whole on one
  device) and decodes through :class:`~models.sharded_llama.ShardedLlama`: heads, FFN columns
  and vocabulary split over ``model``, sequences over ``data``.  Any head count works (heads
  are padded to a multiple of ``T``); the tokens are one device's up to floating-point
  summation order.
* speed: options left at their neutral values add no work to the decode step (each is a static
  choice of the compiled step); their values -- temperature, top-p, min-p, the penalties -- are
  traced, so another value reuses the compiled step.  Penalties keep a ``[rows, vocab]`` count
  array on the device.
  ``generate`` without ``stop`` strings runs the fused ``lax.while_loop`` decode
  (:func:`models.generate.generate`); with ``stop`` strings, :meth:`stream` and :meth:`events` it
  runs one jitted step at a time (:func:`models.generate.generate_stream`) and ends when every
  sample has ended.  Array shapes are bucketed: prompt lengths and the cache size
  (``shape_buckets``) and the number of rows, padded with copies of real rows to a power of two
  up to 8 and a multiple of 8 above, and to a multiple of ``data_parallel``
  (:mod:`models.batch_buckets`), so calls with other prompt lengths or prompt counts usually
  reuse the compiled functions.
"""
from __future__ import annotations

import os
import time
from typing import Iterator, Sequence

import jax

from models.checkpoint import DTYPES, load_checkpoint, missing_model_file, read_config
from models.compile_watch import CompileWatch
from models.completion import (Completion, DoneEvent, FinishEvent, Generation, PhaseEvent, StepEvent, Timings,
                               TokenEvent)
from models.config import LlamaConfig
from models.decoder import Decoder, require_family
from models.distributed import Distributed, initialize
from models.deepseek.config import DeepseekConfig
from models.families import decoder_for
from models.generate import ATTENTION, generate, generate_stream
from models.mesh_plan import DecodeWorkload, plan_mesh_for_devices
from models.prompt_logprobs import prompt_logprobs
from models.request import Request, check_prompt_text, is_messages, is_token_ids, plan_request, prompt_list
from models.sample_text import SampleText
from models.sampling_params import DEFAULT_MAX_NEW_TOKENS, SamplingParams, logprobs_count, resolve_params, resolve_seed
from models.sharded_llama import ShardedLlama
from models.sharding import make_mesh, mesh_sizes
from models.tokenizer import Tokenizer

__all__ = ["DEFAULT_MAX_NEW_TOKENS", "DTYPES", "Completion", "CompileWatch", "DoneEvent", "FinishEvent", "Generation",
           "LLM", "PhaseEvent", "SamplingParams", "StepEvent", "Timings", "TokenEvent", "load_checkpoint",
           "missing_model_file", "model_for", "resolve_mesh"]


def model_for(config: LlamaConfig | DeepseekConfig) -> Decoder:
    """The model of ``config`` (:func:`models.families.decoder_for`: a :class:`~models.llama.Llama`
    or a :class:`~models.deepseek.Deepseek`), shared by every :class:`LLM` of that config so that
    they reuse its compiled functions (a CLI run in the same process compiles nothing new)."""
    return decoder_for(config)


def resolve_mesh(tensor_parallel: int = 1, data_parallel: int = 1,
                 mesh: jax.sharding.Mesh | None = None) -> jax.sharding.Mesh | None:
    """The mesh :class:`LLM` runs on: ``mesh`` as given (checked to have the axes
    ``("data", "model")``), else :func:`models.sharding.make_mesh` of ``tensor_parallel`` x
    ``data_parallel`` devices, or ``None`` (one device) when both are 1.  ``ValueError`` naming the
    argument for non-positive sizes, too few devices, or ``mesh`` together with sizes."""
    if mesh is not None:
        if (tensor_parallel, data_parallel) != (1, 1):
            raise ValueError(f"pass mesh= or tensor_parallel= / data_parallel=, not both (got tensor_parallel="
                             f"{tensor_parallel!r}, data_parallel={data_parallel!r} and a mesh)")
        mesh_sizes(mesh)
        return mesh
    built = make_mesh(tensor_parallel, data_parallel)   # checks both sizes and the device count
    return None if built.size == 1 else built


class LLM:
    """A model (Llama or DeepSeek-V2/V3) with its tokenizer and compiled functions (see module docstring).

    ``LLM(config, params, tokenizer, attention=..., info=..., mesh=...)`` wraps parameters you
    already have (with ``mesh``: placed on it unless they already are); :meth:`load` reads them.
    Attributes: ``config``, ``params``, ``tokenizer``, ``model`` (the family's
    :class:`~models.decoder.Decoder`, :class:`~models.llama.Llama` or
    :class:`~models.deepseek.Deepseek`, holding the compiled functions), ``mesh`` (``None`` on one
    device), ``attention`` (default of
    :meth:`generate`), ``eos_token_ids`` (the config's and the tokenizer's), ``info``,
    ``mesh_plan`` (the :class:`~models.mesh_plan.MeshPlan` of ``LLM.load(devices=N)``, else ``None``).
    """

    def __init__(self, config: LlamaConfig | DeepseekConfig, params: dict, tokenizer: Tokenizer, *,
                 attention: str = "auto", info: dict | None = None, mesh: jax.sharding.Mesh | None = None):
        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
        self.config = config
        self.tokenizer = tokenizer
        self.model = model_for(config)
        if mesh is not None:
            require_family(self.model, "mesh / tensor_parallel / data_parallel")
        self.mesh = resolve_mesh(mesh=mesh) if mesh is not None else None
        # what generate / generate_stream run: the model itself, or the model on the mesh
        self._runner = self.model if self.mesh is None else ShardedLlama(self.model, self.mesh)
        self.params = params if self.mesh is None else self._runner.place_params(params)
        self.attention = attention
        self.eos_token_ids = tuple(sorted(set(config.eos_token_ids) | set(tokenizer.stop_token_ids)))
        self.info = dict(info or {})
        self.kv_bytes_per_token = self.model.facts.cache_bytes_per_token(self.params["embed"].dtype)
        self.mesh_plan = None   # LLM.load(devices=N): the models.mesh_plan.MeshPlan it chose

    @classmethod
    def load(cls, path: str | os.PathLike | None = None, *, dtype=None, attention: str = "auto",
             tensor_parallel: int = 1, data_parallel: int = 1, mesh: jax.sharding.Mesh | None = None,
             devices: int | None = None, workload: DecodeWorkload | None = None,
             distributed: Distributed | None = None) -> "LLM":
        """A GGUF file, a Hugging Face directory, or (``None``) the built-in SmolLM2-135M-Instruct.
        ``dtype``: ``"float32"``, ``"bfloat16"``, ``"float16"`` or None (bfloat16 on GPU, float32
        elsewhere).  ``tensor_parallel`` / ``data_parallel``: run on the first
        ``tensor_parallel * data_parallel`` devices (or on ``mesh``), checked before anything is
        read (:func:`resolve_mesh`: ``ValueError`` when the devices are not there).  ``devices``:
        run on the first ``devices`` devices with the tensor x data parallel split that
        :func:`models.mesh_plan.plan_mesh_for_devices` models fastest for ``workload`` (default
        :class:`~models.mesh_plan.DecodeWorkload`), read from the config before the weights; the
        choice and why are ``llm.mesh_plan``.  ``distributed``: first join a run of several
        processes (:func:`models.distributed.initialize`); every process then loads only the
        parameter blocks of its own devices.  Raises :class:`~models.gguf.CheckpointError` for
        unusable files, an unknown architecture among them
        (:func:`models.families.family_of_hf_config`), and ``NotImplementedError`` for several
        devices with a DeepSeek directory."""
        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
        if distributed is not None:
            initialize(distributed)
        plan = None
        if devices is not None:
            if mesh is not None or (tensor_parallel, data_parallel) != (1, 1):
                raise ValueError(f"pass devices= or tensor_parallel= / data_parallel= / mesh=, not "
                                 f"both (got devices={devices!r}, tensor_parallel={tensor_parallel!r}, "
                                 f"data_parallel={data_parallel!r}"
                                 f"{', and a mesh' if mesh is not None else ''})")
            config = read_config(path)
            if isinstance(config, DeepseekConfig):
                raise NotImplementedError("devices: implemented for the llama family only, not for the "
                                          "deepseek family")
            plan = plan_mesh_for_devices(config, devices, workload)
            tensor_parallel, data_parallel = plan.tensor_parallel, plan.data_parallel
        elif workload is not None:
            raise ValueError(f"workload= is what devices= plans for; got workload={workload!r} "
                             f"without devices")
        mesh = resolve_mesh(tensor_parallel, data_parallel, mesh)
        config, params, tokenizer, info = load_checkpoint(path, dtype, mesh=mesh)
        llm = cls(config, params, tokenizer, attention=attention, info=info, mesh=mesh)
        llm.mesh_plan = plan
        return llm

    @property
    def tensor_parallel(self) -> int:
        """Devices each model is split over (1 without a mesh)."""
        return 1 if self.mesh is None else mesh_sizes(self.mesh)[1]

    @property
    def data_parallel(self) -> int:
        """Groups of devices the sequences are split over (1 without a mesh)."""
        return 1 if self.mesh is None else mesh_sizes(self.mesh)[0]

    def __repr__(self) -> str:
        name = self.info.get("name", "llama")
        where = (f", tensor_parallel={self.tensor_parallel}, data_parallel={self.data_parallel}"
                 if self.mesh is not None else "")
        return f"LLM({name!r}, {self.config.num_hidden_layers} layers, attention={self.attention!r}{where})"

    # -- prompts ----------------------------------------------------------------------------
    def prompt_text(self, prompt, *, chat: bool = False, shared_prompt: str | None = None) -> str | None:
        """The text a prompt is tokenized from (chat template rendered); None for token ids."""
        if is_token_ids(prompt):
            if chat:
                raise TypeError("chat=True needs prompts as text or messages, got token ids")
            return None
        if not chat:
            if not isinstance(prompt, str):
                raise TypeError(f"a prompt must be a string or token ids (messages need chat=True), got "
                                f"{type(prompt).__name__}")
            return (shared_prompt or "") + prompt
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if not is_messages(messages):
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

    def _prepare(self, prompts, sampling, options, *, chat, shared_prompt, attention) -> Request:
        params = resolve_seed(resolve_params(sampling, options))
        if params.prompt_logprobs is not False and params.prompt_logprobs is not None and self.tensor_parallel > 1:
            raise ValueError(f"prompt_logprobs: received {params.prompt_logprobs!r}, expected False with "
                             f"tensor_parallel={self.tensor_parallel} (the prompt's forward pass runs on the "
                             f"unsplit model only)")
        if shared_prompt is not None and not isinstance(shared_prompt, str):
            raise TypeError(f"shared_prompt must be a string, got {type(shared_prompt).__name__}")
        attention = self.attention if attention is None else attention
        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
        prompts = prompt_list(prompts)
        for j, p in enumerate(prompts):
            if isinstance(p, str):
                check_prompt_text(j, p if chat else (shared_prompt or "") + p)
        ids = [self.prompt_ids(p, chat=chat, shared_prompt=shared_prompt) for p in prompts]
        return plan_request(ids, params=params, attention=attention, explicit_share=bool(shared_prompt),
                            vocab_size=self.model.facts.vocab_size,
                            context=self.model.facts.max_position_embeddings,
                            bytes_per_token=self.kv_bytes_per_token, data_parallel=self.data_parallel,
                            nested_prefixes=self.model.facts.nested_prefixes)

    # -- generation -------------------------------------------------------------------------
    def generate(self, prompts, sampling: SamplingParams | None = None, *, chat: bool = False,
                 shared_prompt: str | None = None, attention: str | None = None, **options) -> Generation:
        """``n`` completions of every prompt (see module docstring).  ``sampling``: a
        :class:`~models.sampling_params.SamplingParams`; ``options``: any of its fields as
        keywords (``n=2, temperature=0, stop="\\n"``), alone or agreeing with ``sampling``
        (a different value is a ``ValueError``).  ``attention`` overrides the default given to
        :meth:`load` for this call."""
        req = self._prepare(prompts, sampling, options, chat=chat, shared_prompt=shared_prompt, attention=attention)
        if req.stops:
            for ev in self._run(req, time.perf_counter()):
                if isinstance(ev, DoneEvent):
                    return ev.result
        p = req.params
        marks = []
        t0 = time.perf_counter()
        with CompileWatch() as watch:
            per_prompt = self._prompt_logprobs(req)   # part of the prefill phase, as in _run
            out = generate(self._runner, self.params, req.padded.batch, max_new_tokens=req.max_new_tokens,
                           attention=req.attention, sampling=req.sampling, keys=req.keys,
                           eos_token_ids=p.stop_ids(self.eos_token_ids), shape_buckets=True, mesh=self.mesh,
                           top_logprobs=p.top_logprobs,
                           on_prefill=lambda: marks.append((time.perf_counter(), watch.seconds)))
            t_end = time.perf_counter()
            compile_s = watch.seconds
        texts = [self._text(req) for _ in range(req.rows)]
        for b, t in enumerate(texts):
            m = int(out.lengths[b])
            for s in range(m):
                top = None if out.top_ids is None else tuple(zip(out.top_ids[b, s].tolist(),
                                                                 out.top_logprobs[b, s].tolist()))
                t.push(int(out.tokens[b, s]), float(out.logprobs[b, s]), last=s + 1 == req.max_new_tokens, top=top)
                if t.finish:
                    break
        new = int(out.lengths[:req.rows].sum())
        (t_prefill, compile_at_prefill), = marks
        timings = Timings(total_s=t_end - t0, compile_s=compile_s, new_tokens=new, decode_tokens=new - req.rows,
                          prefill_s=t_prefill - t0, first_token_s=t_prefill - t0, decode_s=t_end - t_prefill,
                          decode_compile_s=compile_s - compile_at_prefill)
        return self._result(req, texts, timings, per_prompt)

    def stream(self, prompts, sampling: SamplingParams | None = None, **kwargs) -> Iterator[tuple]:
        """Same arguments as :meth:`generate` (checked at the call, before the first ``next()``);
        yields ``(prompt_index, sample_index, text_delta)`` as tokens arrive (non-empty deltas;
        a sample's deltas join to its ``generate`` text).  With ``logprobs`` set it yields one
        item per generated token, ``(prompt_index, sample_index, text_delta, (token_id,
        logprob, top_logprobs))`` -- ``text_delta`` may then be empty and ``top_logprobs`` is
        ``((id, logprob), ...)`` with ``logprobs=k >= 1``, else ``None``."""
        req, events = self._start(prompts, sampling, kwargs)
        return _stream_items(events, with_logprobs=req.logprobs)

    def events(self, prompts, sampling: SamplingParams | None = None, *, chat: bool = False,
               shared_prompt: str | None = None, attention: str | None = None, **options) -> Iterator:
        """Same arguments as :meth:`generate`; yields the run's events (module docstring).
        Arguments are checked at the call, before the first ``next()``."""
        return self._start(prompts, sampling, dict(options, chat=chat, shared_prompt=shared_prompt,
                                                   attention=attention))[1]

    def _start(self, prompts, sampling, kwargs) -> tuple[Request, Iterator]:
        t0 = time.perf_counter()
        options = dict(kwargs)
        chat = options.pop("chat", False)
        shared_prompt, attention = options.pop("shared_prompt", None), options.pop("attention", None)
        req = self._prepare(prompts, sampling, options, chat=chat, shared_prompt=shared_prompt, attention=attention)
        return req, self._run(req, t0)

    def _text(self, req: Request) -> SampleText:
        p = req.params
        return SampleText(self.tokenizer, req.stops, frozenset(p.stop_ids(self.eos_token_ids)),
                          stop_token_ids=frozenset(p.stop_token_ids), include_stop=p.include_stop_str_in_output)

    def _prompt_logprobs(self, req: Request) -> list:
        """Per prompt, its ``prompt_logprobs`` entries (None when not asked)."""
        k = logprobs_count("prompt_logprobs", req.params.prompt_logprobs)
        if k is None:
            return [None] * len(req.prompt_ids)
        return prompt_logprobs(self.model, self.params, req.prompt_ids, k)

    def _result(self, req: Request, texts: list[SampleText], timings: Timings, per_prompt: list) -> Generation:
        comps = [t.completion(req.logprobs, per_prompt[r // req.n]) for r, t in enumerate(texts)]
        return Generation([comps[j * req.n:(j + 1) * req.n] for j in range(len(req.prompt_ids))],
                          sharing=req.sharing, timings=timings, seed=req.params.seed)

    def _run(self, req: Request, t0: float) -> Iterator:
        b, n, m = req.rows, req.n, req.max_new_tokens
        p = req.params
        texts = [self._text(req) for _ in range(b)]
        new_tokens = 0
        t_prefill = time.perf_counter()
        t_first = None
        with CompileWatch() as watch:
            yield PhaseEvent("prefill")
            # before decoding, so FinishEvent completions are whole; part of the prefill phase
            per_prompt = self._prompt_logprobs(req)
            steps = generate_stream(self._runner, self.params, req.padded.batch, max_new_tokens=m,
                                    attention=req.attention, sampling=req.sampling, keys=req.keys,
                                    eos_token_ids=p.stop_ids(self.eos_token_ids), shape_buckets=True, logprobs=True,
                                    mesh=self.mesh, top_logprobs=p.top_logprobs)
            try:
                for step, (tok, lp, *top) in enumerate(steps):
                    if step == 0:
                        t_first, compile_at_first = time.perf_counter(), watch.seconds
                        yield PhaseEvent("decode")
                    for r in range(b):
                        t = texts[r]
                        if t.finish:
                            continue
                        alts = tuple(zip(top[0][r].tolist(), top[1][r].tolist())) if top else None
                        delta = t.push(int(tok[r]), float(lp[r]), last=step + 1 == m, top=alts)
                        new_tokens += 1
                        yield TokenEvent(r // n, r % n, int(tok[r]), float(lp[r]), delta, alts)
                        if t.finish:
                            yield FinishEvent(r // n, r % n, t.completion(req.logprobs, per_prompt[r // n]))
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
        yield DoneEvent(self._result(req, texts, timings, per_prompt))


def _stream_items(events: Iterator, *, with_logprobs: bool) -> Iterator[tuple]:
    """The items :meth:`LLM.stream` yields from the events of a run."""
    for ev in events:
        if not isinstance(ev, TokenEvent):
            continue
        if with_logprobs:
            yield ev.prompt_index, ev.sample_index, ev.text, (ev.token_id, ev.logprob, ev.top_logprobs)
        elif ev.text:
            yield ev.prompt_index, ev.sample_index, ev.text
