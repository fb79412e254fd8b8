"""The plan leaves of shared-prefix attention and the schedules of tree attention, one module
each.

A leaf module holds its frozen plan dataclass, ``unsupported`` (whether its kernels run given
shapes), ``why_not`` (whether the planner may choose it: its kernels run and the shapes lie in
its measured region), ``build`` (its tiling and splits for one chunk of query positions),
``seconds`` (its modelled cost, :mod:`jax_prefix_attn.cost_model`) and ``run`` (its kernels and
their XLA glue); :class:`jax_prefix_attn.leaves.base.Leaf` is the protocol they follow.  The
planner's ordered registry (:data:`jax_prefix_attn.planner.LEAVES`) lists them; shared helpers
of several leaves are in ``base``, ``triton_prefix`` and ``mgpu_prefix``.  The tree schedules
(``tree_*``) follow :class:`jax_prefix_attn.leaves.base.TreeLeaf`, the same protocol with the
tree metadata as an argument, in the ordered registry
:data:`jax_prefix_attn.tree_plan.TREE_LEAVES`.
"""
