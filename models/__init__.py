"""Flax/JAX decoders (Llama, DeepSeek-V2/V3) using jax_prefix_attn (functional params, functional KV cache).

* :mod:`models.config` -- :class:`LlamaConfig` (presets, ``from_hf_config``);
* :mod:`models.layers` -- embedding, RMSNorm, RoPE at explicit positions, SwiGLU, LM head;
* :mod:`models.kv_cache` -- :class:`PrefixCache` (shared levels stored once) and :class:`KVCache`;
* :mod:`models.attention` -- attention over the cache through ``jax_prefix_attn``;
* :mod:`models.llama` -- :class:`Llama`: forward, prefill of prefixes and continuations, decode step;
* :mod:`models.sampling` -- greedy / temperature / min-p / top-k / top-p, per-sample keys;
  :mod:`models.penalties` -- repetition / presence / frequency penalties;
  :mod:`models.sampling_params` -- :class:`SamplingParams`, the options of an :class:`LLM` call;
* :mod:`models.prefix_sharing` -- :class:`PromptBatch` (prompts as a prefix tree), automatic
  detection of shared token prefixes, :class:`SharingReport`;
* :mod:`models.generate` -- validation and the jit-compiled decode loop over a ``PromptBatch``;
* :mod:`models.llm` -- :class:`LLM`: load a checkpoint, text in, :class:`Completion` out;
* :mod:`models.decoder` -- :class:`~models.decoder.Decoder`, the interface the engine runs a
  model family through; :mod:`models.families` -- the families (Llama, DeepSeek-V2/V3 in
  :mod:`models.deepseek`) and the pick of one from a ``config.json``;
* :mod:`models.weights` -- HF safetensors loader, ``params_from_hf_state_dict``, random init.
* :mod:`models.training` -- training through shared prompts:
  :mod:`~models.training.logprobs` (:func:`completion_logprobs`: log-probs and entropies of given
  completions, each prompt computed once, chunked LM head, differentiable);
  :mod:`~models.training.tree_logprobs` (:func:`tree_completion_logprobs`: log-probs of every
  token of a branching token forest, each node computed once through
  ``jax_prefix_attn.tree_attention``; :func:`tree_layout` builds its :class:`TreeLayout`);
  :mod:`~models.training.rl` (GRPO: :func:`group_advantages`, :func:`grpo_loss`,
  :func:`grpo_objective`, :func:`make_train_step`, one jitted optax step);
  :mod:`~models.training.nnx_llama` (:class:`NNXLlama`: the decoder as a Flax NNX module,
  ``nnx.Param`` leaves, and its conversions to and from the plain parameter tree).

Example (text in, text out)::

    llm = LLM.load()                                   # or LLM.load("model.gguf" / "hf_dir")
    out = llm.generate(["Q: Capital of France? A:", "Q: Capital of Italy? A:"], n=4, stop="\n")
    out[0][2].text, out.sharing                        # prompt 0, sample 2; what was stored once

Example (token ids, the decode loop)::

    config, params = load_hf_checkpoint("path/to/llama", jnp.bfloat16)
    model = Llama(config)
    prompts = PromptBatch.shared(doc_tokens, suffixes=question_tokens, num_samples=8)
    out = generate(model, params, prompts, max_new_tokens=128, attention="shared",
                   sampling=SamplingConfig(temperature=0.7, top_p=0.9), key=jax.random.PRNGKey(0))
    out.tokens, out.lengths                # [B, 128] and [B]

Names of the attention choices (one place for the mapping):

* ``attention`` (:func:`generate`, :class:`LLM`, the CLI's ``--attention``) names the *cache
  layout*: ``"shared"`` stores each prefix node once (prefix and suffix attended separately,
  merged exactly), ``"flat"`` gives every sequence its own copy of its prompt (the FlashAttention
  baseline), ``"auto"`` is ``"shared"`` when sequences share a prefix, else ``"flat"``;
  ``"none"`` skips attention (benchmarks only).  :meth:`Llama.prefill` and :class:`KVCache` call
  the same value ``backend``.
* ``impl`` (:class:`Llama`, and every ``jax_prefix_attn`` entry point) names the *algorithm*:
  the model's ``"auto"`` passes ``impl="auto"`` to each library call, whose planner then picks the
  kernels (``jax_prefix_attn.attention``: ``"flash"``; ``shared_prefix_attention``: ``"shared"``
  or ``"flat"``); the model's ``"reference"`` passes ``impl="reference"`` (pure JAX).
* ``interpret`` (:class:`Llama` and the library) runs the Pallas kernels that are chosen in
  interpret mode.

Layer layout: the loaders return layer-stacked parameters (``lax.scan`` layer loop, fastest to
compile); :func:`unstack_layers` gives the unrolled layout, which measured about 3x faster per
layer on an H200 (XLA copies the per-layer slices of stacked arrays inside the scan; see
``bench/results/decode_step_h200.json``).  :func:`generate`, :func:`generate_stream` and
:func:`prefill_prefix_cache` take ``layout="auto"`` (default): stacked parameters are converted
to the list layout on GPU (once per parameter tree, cached on the model) and kept as they are
elsewhere; ``layout="stacked"`` / ``"list"`` force one.  Why not always: on CPU (2 busy cores,
SmolLM2-135M, B=6, 16 new tokens) the list layout ran faster (warm call bf16 9.1 s vs 15.4 s,
fp32 8.6 s vs 11.3 s) but its first call, dominated by compiling 30 unrolled layers, took much
longer (bf16 64 s vs 39 s, fp32 86 s vs 32 s); with the tiny 2-layer test config both layouts
are equal within noise.  ``Llama.decode_step`` and the other
methods use the parameters' own layout (they are plain functions for user code under jit).
"""
from models.config import Llama3RopeScaling, LlamaConfig, PRESETS
from models.generate import GenerateOutput, generate, generate_stream, prefill_prefix_cache
from models.kv_cache import KVCache, PrefixCache
from models.llama import Llama
from models.llm import LLM, Completion, Generation, Timings
from models.prefix_sharing import PromptBatch, SharingReport, plan_prompt_batch
from models.sampling import DEFAULT_SAMPLING, GREEDY, SamplingConfig
from models.sampling_params import SamplingParams
from models.training import (GRPOBatch, GRPOConfig, NNXLlama, TreeLayout, completion_logprobs, group_advantages,
                             grpo_loss, grpo_objective, make_train_step, tree_completion_logprobs, tree_layout)
from models.weights import (init_params, load_hf_checkpoint, params_from_hf_state_dict, stack_layers,
                            unstack_layers)

__all__ = ["DEFAULT_SAMPLING", "GREEDY", "Completion", "GenerateOutput", "Generation", "KVCache", "LLM", "Llama",
           "Llama3RopeScaling", "LlamaConfig", "PRESETS", "PrefixCache", "PromptBatch", "SamplingConfig",
           "SharingReport", "Timings", "generate", "generate_stream", "init_params", "load_hf_checkpoint",
           "params_from_hf_state_dict", "plan_prompt_batch", "prefill_prefix_cache", "stack_layers",
           "unstack_layers"]
__all__ += ["GRPOBatch", "GRPOConfig", "NNXLlama", "completion_logprobs", "group_advantages", "grpo_loss",
            "grpo_objective", "make_train_step"]
__all__ += ["TreeLayout", "tree_completion_logprobs", "tree_layout"]
__all__ += ["SamplingParams"]
