"""jax-prefix-attn: exact, fast attention for batches of sequences that share prefixes.

Public API:

* :func:`attention` -- flash attention returning ``(out, lse)`` (Pallas on GPU).
* :func:`merge_attention_states`, :func:`merge_two` -- exact LSE merging of partial states.
* :mod:`jax_prefix_attn.reference` -- the pure-JAX oracle.
* :func:`shared_prefix_attention` -- decode/suffix attention over shared prefixes (Hydragen);
  :data:`CONCURRENT_COMPILER_OPTIONS` -- optional ``jax.jit`` options that let XLA run its
  independent launches concurrently.
* :class:`PrefixTree`, :func:`tree_attention` -- attention over a forest of shared prefixes (Hydragen 3.3, DeFT-Flatten).
"""
from jax_prefix_attn import reference
from jax_prefix_attn.attention import attention
from jax_prefix_attn.merge import merge_attention_states, merge_two
from jax_prefix_attn.shared_prefix import CONCURRENT_COMPILER_OPTIONS, shared_prefix_attention
from jax_prefix_attn.tree import PrefixTree
from jax_prefix_attn.tree_attention import tree_attention

__all__ = ["CONCURRENT_COMPILER_OPTIONS", "attention", "merge_attention_states", "merge_two",
           "reference", "shared_prefix_attention", "PrefixTree", "tree_attention"]
__version__ = "0.1.0"
