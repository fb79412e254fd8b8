"""Training through shared prompts: log-probabilities of completions and of token trees with each
prompt (or tree node) computed once, GRPO on top of them, and the decoder as a Flax NNX module.

* `logprobs`: :func:`completion_logprobs`, log-probs (and entropies) of ``N`` completions of each
  of ``G`` prompts, chunked LM head, differentiable;
* `tree_logprobs`: :func:`tree_completion_logprobs`, log-probs of every token of a branching
  token forest (agent trajectories) through ``jax_prefix_attn.tree_attention``;
  :func:`tree_layout` builds its :class:`TreeLayout`;
* `rl`: GRPO, :func:`group_advantages`, :func:`grpo_loss`, :func:`grpo_objective`,
  :func:`make_train_step` (one jitted optax step);
* `nnx_llama`: :class:`NNXLlama` (``nnx.Param`` leaves over the functional decoder), its
  conversions to and from the plain parameter tree and :func:`grpo_train_step`.

The guide: ``docs/training.md``.
"""
from models.training.logprobs import completion_logprobs
from models.training.nnx_llama import NNXLlama, grpo_train_step, params_from_state
from models.training.rl import GRPOBatch, GRPOConfig, group_advantages, grpo_loss, grpo_objective, make_train_step
from models.training.tree_logprobs import TreeLayout, tree_completion_logprobs, tree_layout

__all__ = ["GRPOBatch", "GRPOConfig", "NNXLlama", "TreeLayout", "completion_logprobs", "group_advantages",
           "grpo_loss", "grpo_objective", "grpo_train_step", "make_train_step", "params_from_state",
           "tree_completion_logprobs", "tree_layout"]
