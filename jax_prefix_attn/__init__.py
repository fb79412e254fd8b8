"""jax-prefix-attn: exact, fast attention for batches of sequences that share prefixes.

Public API:

* :func:`attention` -- flash attention returning ``(out, lse)`` (Pallas on GPU);
  :func:`plan_flash` / :class:`FlashPlan` -- the kernels its ``impl="auto"`` runs.
* :func:`merge_attention_states`, :func:`merge_two` -- exact LSE merging of partial states.
* :mod:`jax_prefix_attn.reference` -- the pure-JAX oracle.
* :func:`shared_prefix_attention` -- decode/suffix attention over shared prefixes (Hydragen);
  :func:`shared_prefix_supported` -- whether its kernels take given shapes;
  :func:`plan_shared_prefix` / :class:`SharedPrefixPlan` -- the planner's static choice of
  kernels, tilings and splits (pass ``plan=`` to force one);
  :class:`DeviceInfo`, :func:`device_info` -- the device facts the planner reads;
  :func:`concurrent_compiler_options` -- optional ``jax.jit`` options that let XLA run its
  independent launches concurrently.
* :class:`PrefixTree`, :func:`tree_attention` -- attention over a forest of shared prefixes (Hydragen 3.3, DeFT-Flatten);
  :func:`plan_tree_attention` / :class:`TreePlan` -- the planner's choice of its schedule.
* :func:`mla_attention` -- absorbed multi-head latent attention (DeepSeek-V2/V3) over shared
  latent prefixes.
"""
from jax_prefix_attn import reference
from jax_prefix_attn.attention import attention
from jax_prefix_attn.flash_plan import FlashPlan, plan_flash
from jax_prefix_attn.merge import merge_attention_states, merge_two
from jax_prefix_attn.device import DeviceInfo, device_info
from jax_prefix_attn.planner import (SharedPrefixPlan, TreePlan, plan_shared_prefix,
                                     plan_tree_attention)
from jax_prefix_attn.shared_prefix import (concurrent_compiler_options, shared_prefix_attention,
                                           shared_prefix_supported)
from jax_prefix_attn.prefix_tree import PrefixTree
from jax_prefix_attn.tree_attention import auto_path, tree_attention
from jax_prefix_attn.tree_metadata import TreeMetadata, build_tree_metadata

__all__ = ["concurrent_compiler_options", "shared_prefix_supported", "plan_shared_prefix",
           "SharedPrefixPlan", "DeviceInfo", "device_info", "attention", "merge_attention_states", "merge_two",
           "reference", "shared_prefix_attention", "PrefixTree", "tree_attention", "TreeMetadata",
           "build_tree_metadata", "auto_path", "plan_tree_attention", "TreePlan", "FlashPlan",
           "plan_flash"]
from jax_prefix_attn.mla import mla_attention

__all__ += ["mla_attention"]
__version__ = "0.1.0"
