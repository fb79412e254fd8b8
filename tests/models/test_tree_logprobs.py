"""tree_completion_logprobs: log-probs and entropies of every node of a ragged token forest (depth 4,
nodes of length 1, a parent listed after its child) against a flat forward over every
root-to-leaf path (the model's plain causal forward, dense log-softmax); gradients of
sum(logprobs) against the flat computation that scores each node once; node masks; two
different forests of one bucket sharing one compilation; input validation; GPU kernels."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from helpers import rel_err, tiny_config, tiny_state_dict
from models import Llama, LlamaConfig, params_from_hf_state_dict
from models.training.tree_logprobs import length_bucket, tree_completion_logprobs, tree_layout

# forest A: 0 -> 1 -> {2 -> 6, 3}, 0 -> 4 -> 5; 8 -> 7 (parent listed after its child)
PARENTS_A = [-1, 0, 1, 1, 0, 4, 2, 8, -1]
LENGTHS_A = [5, 1, 3, 1, 4, 2, 2, 3, 1]
# forest B: other lengths, two more leaves; the same buckets (9-16 nodes, longest node 5-8) and the
# same inner nodes per depth (the attention metadata has one schedule per depth)
PARENTS_B = [-1, 0, 1, 1, 0, 4, 2, 8, -1, 4, 0]
LENGTHS_B = [4, 2, 2, 1, 5, 3, 1, 2, 2, 1, 3]
PATHS, PATH_LEN = 8, 32        # flat oracle: paths padded to one shape (one compilation)


def leaf_paths(parents):
    kids = {u: [c for c, p in enumerate(parents) if p == u] for u in range(len(parents))}
    out = []
    for leaf in (u for u in range(len(parents)) if not kids[u]):
        path, u = [], leaf
        while u != -1:
            path.append(u)
            u = parents[u]
        out.append(path[::-1])
    return out


def flat_inputs(parents, lengths, tokens, paths=PATHS, path_len=PATH_LEN):
    """Per path: concatenated tokens ``[paths, path_len]``, where each node's tokens sit, and a
    weight ``[paths, path_len]`` that counts each node's scored tokens once (first path through it)."""
    toks = np.zeros((paths, path_len), np.int32)
    weight = np.zeros((paths, path_len), np.float32)
    where, owned = {}, set()
    for i, path in enumerate(leaf_paths(parents)):
        s = 0
        for u in path:
            toks[i, s:s + lengths[u]] = tokens[u, :lengths[u]]
            where.setdefault(u, []).append((i, s))
            if u not in owned:
                owned.add(u)
                weight[i, max(s, 1):s + lengths[u]] = 1.0
            s += lengths[u]
    return toks, weight, where


def flat_loss(model):
    """``params, tokens [P, L], weight [P, L] -> (sum of weighted log-probs, (logprobs [P, L-1],
    entropy [P, L]))`` from the model's plain causal forward over each path."""
    def loss(params, tokens, weight):
        ls = jax.nn.log_softmax(model.forward(params, tokens), axis=-1)      # [P, L, V]
        lp = jnp.take_along_axis(ls[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
        return (lp * weight[:, 1:]).sum(), (lp, -(jnp.exp(ls) * ls).sum(-1))
    return loss


def random_tokens(layout, lengths, v, rng):
    toks = rng.integers(0, v, layout.shape).astype(np.int32)
    for u, n in enumerate(lengths):
        toks[u, n:] = v - 1        # padding ids that would change the result if they were seen
    return toks


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_config()
    config = LlamaConfig.from_hf_config(dict(cfg, model_type="llama"))
    params = params_from_hf_state_dict(config, tiny_state_dict(cfg, seed=11), jnp.float32)
    model = Llama(config)

    @jax.jit
    def flat_fn(params, tokens, weight):
        (_, (lp, ent)), grads = jax.value_and_grad(flat_loss(model), has_aux=True)(params, tokens, weight)
        return lp, ent, grads

    return dict(model=model, params=params, tree_fn=make_tree_fn(model), flat_fn=flat_fn, v=cfg["vocab_size"])


def make_tree_fn(model, **kw):
    """Jitted ``(params, layout, tokens, mask) -> (logprobs, entropy, grad of sum(logprobs))``."""
    @jax.jit
    def tree_fn(params, layout, tokens, mask):
        def loss(params):
            lp, ent = tree_completion_logprobs(model, params, layout, tokens, score_mask=mask, return_entropy=True,
                                               **kw)
            return lp.sum(), (lp, ent)
        (_, (lp, ent)), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return lp, ent, grads
    return tree_fn


def check_forest(setup, parents, lengths, seed, tree_fn=None):
    model, params = setup["model"], setup["params"]
    layout = tree_layout(model, parents, lengths)
    tokens = random_tokens(layout, lengths, setup["v"], np.random.default_rng(seed))
    mask = jnp.ones(layout.shape[:1], bool)
    lp, ent, grads = (tree_fn or setup["tree_fn"])(params, layout, jnp.asarray(tokens), mask)
    lp, ent = np.asarray(lp), np.asarray(ent)
    ftoks, weight, where = flat_inputs(parents, lengths, tokens)
    flp, fent, fgrads = setup["flat_fn"](params, jnp.asarray(ftoks), jnp.asarray(weight))
    flp, fent = np.asarray(flp), np.asarray(fent)
    for u, n in enumerate(lengths):
        for i, s in where[u]:
            j0 = 1 if s == 0 else 0                       # a root's first token is not predicted
            np.testing.assert_allclose(lp[u, j0:n], flp[i, s + j0 - 1:s + n - 1], atol=1e-5, rtol=0)
            np.testing.assert_allclose(ent[u, j0:n], fent[i, s + j0 - 1:s + n - 1], atol=1e-5, rtol=0)
        assert (lp[u, n:] == 0).all() and (ent[u, n:] == 0).all()
        if parents[u] < 0:
            assert lp[u, 0] == 0
        assert (lp[u, (1 if parents[u] < 0 else 0):n] < 0).all()
    assert (lp[len(lengths):] == 0).all()                   # padding rows
    err = rel_err(np.concatenate([np.ravel(x) for x in jax.tree.leaves(grads)]),
                  np.concatenate([np.ravel(x) for x in jax.tree.leaves(fgrads)]))
    assert err < 1e-4, err
    return layout, tokens, lp


def test_logprobs_and_grads_match_flat_paths(setup):
    layout, tokens, lp = check_forest(setup, PARENTS_A, LENGTHS_A, seed=0)
    assert layout.shape == (16, 8)
    # a per-node mask: only nodes 2, 5 and 7 scored, the same numbers there, 0 elsewhere
    mask = np.zeros(16, bool)
    mask[[2, 5, 7]] = True
    lp_m, _, grads = setup["tree_fn"](setup["params"], layout, jnp.asarray(tokens), jnp.asarray(mask))
    np.testing.assert_array_equal(np.asarray(lp_m), np.where(mask[:, None], lp, 0.0))
    assert setup["tree_fn"]._cache_size() == 1


def test_second_forest_of_the_bucket_reuses_the_compilation(setup):
    check_forest(setup, PARENTS_A, LENGTHS_A, seed=0)        # (cached: compiled by the test above or now)
    layout_b, _, _ = check_forest(setup, PARENTS_B, LENGTHS_B, seed=1)
    assert layout_b.shape == (16, 8)
    assert setup["tree_fn"]._cache_size() == 1
    assert setup["flat_fn"]._cache_size() == 1


def test_interpreted_kernels_match_flat_paths(setup):
    """The tree kernels, forward and backward, in Pallas interpret mode."""
    model = Llama(setup["model"].config, interpret=True)
    check_forest(setup, PARENTS_B, LENGTHS_B, seed=3, tree_fn=make_tree_fn(model, attention_impl="flatten"))


def test_length_bucket():
    assert [length_bucket(n) for n in (1, 3, 5, 64, 65, 130)] == [1, 4, 8, 64, 128, 192]


@pytest.mark.parametrize("parents, lengths, kw, match", [
    ([-1, 0, 5], [2, 2, 2], {}, r"parents\[2\] = 5"),
    ([-1, 2, 1], [2, 2, 2], {}, r"parents has a cycle"),
    ([-1, 1], [2, 2], {}, r"parents\[1\] = 1"),
    ([-1, 0], [2, 0], {}, r"node_lengths must be >= 1"),
    ([-1, 0], [2, 2, 2], {}, r"node_lengths must have one entry per node"),
    ([-1, 0], [100, 40], {}, r"node_lengths: the path to node 1 holds 140 tokens"),
    ([-1, 0], [2, 3], dict(pad_nodes_to=1), r"pad_nodes_to must be an int >= 2"),
    ([-1, 0], [2, 3], dict(pad_length_to=2), r"pad_length_to must be an int >= 3"),
])
def test_bad_structure_raises(setup, parents, lengths, kw, match):
    with pytest.raises(ValueError, match=match):
        tree_layout(setup["model"], parents, lengths, **kw)


def test_bad_call_arguments_raise(setup):
    model, params = setup["model"], setup["params"]
    layout = tree_layout(model, [-1, 0, 0], [3, 1, 2])           # shape (4, 4)
    tokens = random_tokens(layout, [3, 1, 2], setup["v"], np.random.default_rng(2))
    with pytest.raises(ValueError, match=r"node_tokens must be an int array of the layout's shape"):
        tree_completion_logprobs(model, params, layout, tokens[:3])
    bad = tokens.copy()
    bad[2, 1] = setup["v"]
    with pytest.raises(ValueError, match=r"node_tokens: token ids"):
        tree_completion_logprobs(model, params, layout, bad)
    with pytest.raises(ValueError, match=r"score_mask must be a bool array"):
        tree_completion_logprobs(model, params, layout, tokens, score_mask=np.ones(3, bool))
    with pytest.raises(ValueError, match=r"attention_impl must be one of"):
        tree_completion_logprobs(model, params, layout, tokens, attention_impl="dense")
    with pytest.raises(ValueError, match=r"vocab_chunk must divide"):
        tree_completion_logprobs(model, params, layout, tokens, vocab_chunk=7)
    with pytest.raises(TypeError, match=r"layout must be a TreeLayout"):
        tree_completion_logprobs(model, params, layout.shape, tokens)
    with pytest.raises(ValueError, match=r"tokens\[1\] must have node_lengths\[1\] = 1 tokens"):
        layout.pad_tokens([[1, 2, 3], [4, 5], [6, 7]])
    np.testing.assert_array_equal(layout.pad_tokens([[1, 2, 3], [4], [6, 7]], pad_id=9),
                                  [[1, 2, 3, 9], [4, 9, 9, 9], [6, 7, 9, 9], [9, 9, 9, 9]])


@pytest.mark.gpu
@pytest.mark.parametrize("parents, lengths", [
    ([-1, 0, 0, 1, 1, 2, 3, 3, 4, 5], [600, 150, 1, 90, 257, 33, 1, 120, 64, 200]),
    ([-1, 0, 0, 0, -1, 4], [700, 120, 1, 300, 50, 64]),     # depth 2: the single-level path
])
def test_gpu_kernels_match_flat_paths(parents, lengths):
    """Node lengths of hundreds of tokens on the GPU: the tree kernels forward and backward (fp32)
    against the model's flat forward over every path."""
    cfg = tiny_config(max_position_embeddings=2048, hidden_size=256, num_attention_heads=8, num_key_value_heads=2,
                      head_dim=64, intermediate_size=512, vocab_size=512)
    config = LlamaConfig.from_hf_config(dict(cfg, model_type="llama"))
    params = params_from_hf_state_dict(config, tiny_state_dict(cfg, seed=3), jnp.float32)
    model = Llama(config)
    layout = tree_layout(model, parents, lengths)
    tokens = random_tokens(layout, lengths, cfg["vocab_size"], np.random.default_rng(4))
    lp, _, grads = make_tree_fn(model)(params, layout, jnp.asarray(tokens), jnp.ones(layout.shape[:1], bool))
    lp = np.asarray(lp)
    ftoks, weight, where = flat_inputs(parents, lengths, tokens, paths=len(leaf_paths(parents)), path_len=1152)
    (_, (flp, _)), fgrads = jax.jit(jax.value_and_grad(flat_loss(model), has_aux=True))(
        params, jnp.asarray(ftoks), jnp.asarray(weight))
    flp = np.asarray(flp)
    for u, n in enumerate(lengths):
        for i, s in where[u]:
            j0 = 1 if s == 0 else 0
            np.testing.assert_allclose(lp[u, j0:n], flp[i, s + j0 - 1:s + n - 1], atol=1e-2, rtol=0)
    err = rel_err(np.concatenate([np.ravel(x) for x in jax.tree.leaves(grads)]),
                  np.concatenate([np.ravel(x) for x in jax.tree.leaves(fgrads)]))
    assert err < 1e-2, err
