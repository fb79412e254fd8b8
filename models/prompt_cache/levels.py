"""Shared prefix levels for a batch of prompts that import modules of one schema.

The cached part of a prompt is a set of *segments*: the encoded rows (modules, or scaffolds
replacing their members) whose kept K/V it attends to. Attention over cached K/V is masked only
by valid length (RoPE positions are already inside the keys), so the order in which segments
are concatenated does not matter; each prompt's segments are listed in a canonical order (row
order of the `EncodedSchema`, i.e. schema order) and the prompts are sorted by these lists, so
prompts that share a leading run of segments are adjacent: the lists form a trie, and prompts
with equal lists form a group.

`models.kv_cache.PrefixCache` holds uniform levels: level `l` has `G_l` nodes, `G_{l-1}` divides
`G_l`, and sequence `b` of `B` uses node `b // (B // G_l)`. A plan maps the trie onto such
levels: a level of `G` nodes cuts the `U` sorted batch units into `G` equal consecutive chunks
(`G` divides `U`), and node `c` holds the segments common to the start of every list in chunk
`c` beyond those its parent node holds. The last level (`G = U`) holds each unit's remaining
segments. Levels whose nodes are all empty are dropped; a node may be empty (length 0:
nothing of it is visible).

Among the chains of divisors `G_0 | G_1 | ... | U`, the plan minimizes the tokens a decode step
reads, `sum_l G_l * P_l` (`P_l`: the level's longest node, the padded size), plus `level_cost`
tokens per level (each level adds an attention pass and an exact merge per layer and step). The
units are the prompts themselves, or, when groups differ in size, the groups padded to the
largest group's size with *padding units* (copies of a prompt of the group whose rows are
decoded and dropped; `level_cost` tokens per padded row and sample are added to the cost): then
every group is a whole number of equal chunks and its modules can sit in one node. The cheaper
of the two is taken. So segments common to every prompt land once in a root node and a group's
own segments once per group; a segment is stored more than once only where the trie's branches
do not line up with even splits and copying it reads fewer bytes than the padded alternatives.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from models.prefix_sharing import MIN_SHARED_TOKENS, common_prefix_len

__all__ = ["LevelPlan", "plan_levels"]


@dataclasses.dataclass(frozen=True)
class LevelPlan:
    """`order[u]`: the prompt of batch unit `u` (units sorted by segment list); `padding[u]`:
    True for a padding unit (a copy of prompt `order[u]` whose rows are dropped);
    `levels[l][g]`: the segments (row ids) of node `g` of level `l`; `node_tokens[l][g]`:
    their total kept tokens."""
    order: tuple
    padding: tuple
    levels: tuple
    node_tokens: tuple

    @property
    def level_sizes(self) -> tuple[int, ...]:
        return tuple(len(lv) for lv in self.levels)


def _best_levels(lists: list, tokens: Sequence[int], level_cost: int) -> tuple[int, list, list]:
    """`(cost, levels, node_tokens)` of the cheapest divisor chain over sorted `lists`."""
    p = len(lists)
    cum = [np.cumsum([0] + [int(tokens[r]) for r in u]) for u in lists]
    divisors = [d for d in range(1, p + 1) if p % d == 0]
    common = {d: [common_prefix_len(lists[c * (p // d):(c + 1) * (p // d)]) for c in range(d)] for d in divisors}

    def level(parent: int | None, g: int) -> tuple[list, list]:
        size = p // g
        nodes, toks = [], []
        for c in range(g):
            lo = 0 if parent is None else common[parent][c // (g // parent)]
            hi = common[g][c]
            nodes.append(lists[c * size][lo:hi])
            toks.append(int(cum[c * size][hi] - cum[c * size][lo]))
        return nodes, toks

    def cost(parent: int | None, g: int) -> int:
        longest = max(level(parent, g)[1])
        return g * longest + level_cost if longest else 0

    best: dict = {}
    for g in divisors:
        options = [(cost(None, g), None)] + [(best[d][0] + cost(d, g), d) for d in divisors if d < g and g % d == 0]
        best[g] = min(options, key=lambda o: o[0])
    chain, g = [], p
    while g is not None:
        chain.append(g)
        g = best[g][1]
    chain.reverse()
    levels, node_tokens = [], []
    for parent, g in zip([None] + chain[:-1], chain):
        nodes, toks = level(parent, g)
        if max(toks):
            levels.append(tuple(nodes))
            node_tokens.append(tuple(toks))
    return best[p][0], levels, node_tokens


def plan_levels(units: Sequence[Sequence[int]], tokens: Sequence[int], *, samples: int = 1,
                level_cost: int = MIN_SHARED_TOKENS) -> LevelPlan:
    """The level plan of prompts whose segment lists are `units` (row ids, each list ascending
    and without repeats), `samples` rows per prompt; `tokens[r]` is segment `r`'s kept token
    count (module docstring)."""
    lists = [tuple(int(r) for r in u) for u in units]
    if not lists:
        raise ValueError("units: received no prompt, expected at least one")
    for j, u in enumerate(lists):
        if list(u) != sorted(set(u)) or (u and not 0 <= u[0] <= u[-1] < len(tokens)):
            raise ValueError(f"units[{j}]: received {list(u)}, expected ascending distinct row ids in "
                             f"[0, {len(tokens)})")
    order = sorted(range(len(lists)), key=lambda j: (lists[j], j))
    cost, levels, node_tokens = _best_levels([lists[j] for j in order], tokens, level_cost)
    plan = LevelPlan(tuple(order), (False,) * len(order), tuple(levels), tuple(node_tokens))
    groups: dict = {}
    for j in order:
        groups.setdefault(lists[j], []).append(j)
    size = max(len(g) for g in groups.values())
    if all(len(g) == size for g in groups.values()):
        return plan
    padded = [(j, k >= len(g)) for g in groups.values() for k, j in enumerate(g + [g[0]] * (size - len(g)))]
    extra = (len(padded) - len(order)) * samples * level_cost
    cost2, levels2, node_tokens2 = _best_levels([lists[j] for j, _ in padded], tokens, level_cost)
    if cost2 + extra < cost:
        return LevelPlan(tuple(j for j, _ in padded), tuple(pad for _, pad in padded), tuple(levels2),
                         tuple(node_tokens2))
    return plan
