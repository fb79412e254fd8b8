"""The routed experts of the DeepSeek MoE MLP: the bucketed products (``[E, C, H]`` batched
matmuls) in as many rounds as the routing needs, against float64 NumPy and the grouped products
(``ragged_dot``), gradients included, and the bucket size."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.deepseek.moe import bucketed_experts, expert_capacity, grouped_experts, routed_experts


def _case(seed, n, k, e, h=16, i=12):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, h))
    experts = np.stack([rng.choice(e, k, replace=False) for _ in range(n)])
    weights = rng.random((n, k))
    wg, wu = (rng.standard_normal((e, h, i)) * 0.3 for _ in range(2))
    wd = rng.standard_normal((e, i, h)) * 0.3
    return x, experts, weights, wg, wu, wd


def _numpy(x, experts, weights, wg, wu, wd):
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j, ex in enumerate(experts[t]):
            g, u = x[t] @ wg[ex], x[t] @ wu[ex]
            out[t] += weights[t, j] * ((g / (1 + np.exp(-g)) * u) @ wd[ex])
    return out


@pytest.mark.parametrize("capacity,skewed", [(None, False), (2, False), (10 ** 6, False),
                                             (None, True), (3, True)])
def test_routed_experts_match_numpy_whatever_the_rounds(capacity, skewed):
    """Default buckets (every expert fits: one round), buckets of 2 rows (some experts take
    several rounds), buckets that hold every pair, and a routing where every token picks the
    same experts (``ceil(N / C)`` rounds)."""
    case = _case(0, n=24, k=3, e=8)
    if skewed:
        case = (case[0], np.tile(np.array([[5, 0, 2]]), (24, 1)), *case[2:])
    got = jax.jit(lambda *a: routed_experts(*a, capacity=capacity))(
        *(jnp.asarray(a, jnp.int32 if a.dtype.kind == "i" else jnp.float32) for a in case))
    np.testing.assert_allclose(np.asarray(got), _numpy(*case), rtol=2e-5, atol=2e-5)


def test_buckets_equal_the_grouped_products_and_zero_past_capacity():
    x, experts, _, wg, wu, wd = (jnp.asarray(a, jnp.float32) for a in _case(1, n=10, k=2, e=4))
    flat = experts.astype(jnp.int32).reshape(-1)
    xs = jnp.repeat(x, 2, axis=0)[jnp.argsort(flat, stable=True)]
    sizes = jnp.bincount(flat, length=4).astype(jnp.int32)
    want = np.asarray(grouped_experts(xs, sizes, wg, wu, wd))
    cap = int(sizes.max())
    np.testing.assert_allclose(np.asarray(bucketed_experts(xs, sizes, wg, wu, wd, cap)), want,
                               rtol=2e-5, atol=2e-5)
    small = np.asarray(bucketed_experts(xs, sizes, wg, wu, wd, cap - 1))
    starts = np.cumsum(sizes) - sizes
    rank = np.arange(len(flat)) - np.repeat(starts, sizes)
    np.testing.assert_allclose(small[rank < cap - 1], want[rank < cap - 1], rtol=2e-5, atol=2e-5)
    assert not small[rank >= cap - 1].any()
    later = np.asarray(bucketed_experts(xs, sizes, wg, wu, wd, 1, offset=jnp.int32(cap - 1)))
    np.testing.assert_allclose(later[rank == cap - 1], want[rank == cap - 1], rtol=2e-5, atol=2e-5)
    assert not later[rank != cap - 1].any()


def test_routed_experts_gradients_over_several_rounds():
    """Reverse-mode gradients through the rounds (buckets of 2 rows, skewed routing) equal the
    grouped products' (``ragged_dot``)."""
    x, experts, weights, wg, wu, wd = (jnp.asarray(a, jnp.int32 if a.dtype.kind == "i" else jnp.float32)
                                       for a in _case(3, n=12, k=2, e=4))
    experts = experts.at[:8].set(jnp.array([1, 3]))

    def grouped(x, wg, wu, wd):
        flat = experts.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        sizes = jnp.bincount(flat, length=4).astype(jnp.int32)
        y = grouped_experts(x[order // 2], sizes, wg, wu, wd) * weights.reshape(-1)[order][:, None]
        return jnp.zeros_like(x).at[order // 2].add(y)

    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))  # noqa: E731
    got = jax.grad(loss(lambda x, *w: routed_experts(x, experts, weights, *w, capacity=2)),
                   argnums=(0, 1, 2, 3))(x, wg, wu, wd)
    want = jax.grad(loss(grouped), argnums=(0, 1, 2, 3))(x, wg, wu, wd)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


def test_expert_capacity():
    assert expert_capacity(1024 * 6, 64) == 192           # twice the mean of 96
    assert expert_capacity(6, 64) == 6                    # never more than the pairs
    assert expert_capacity(100, 8) == 32                  # 2 x 13 = 26, up to a multiple of 8
