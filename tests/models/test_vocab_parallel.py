"""Vocabulary-parallel greedy choice (:func:`models.vocab_parallel.greedy_tokens`) on 2 and 4
CPU devices equals ``jnp.argmax`` of the whole rows: ties across shards, NaN in one or several
shards (the first NaN wins, as on one device), +inf beside NaN, rows of -inf, padded ids."""
import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from models.vocab_parallel import greedy_tokens

VOCAB = 13


def _rows(padded: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((9, padded)).astype(np.float32)
    x[:, VOCAB:] = 50.0                       # padded ids: never chosen
    x[1, [2, 9]] = 7.0                        # tie across shards: the lower id
    x[2, 11] = np.nan                         # NaN in a late shard
    x[3, [10, 1]] = np.nan                    # NaN in two shards: the first
    x[4, 0], x[4, 12] = np.inf, np.nan        # +inf beside a NaN
    x[5, :VOCAB] = -np.inf                    # nothing finite
    x[6, 5] = np.inf                          # +inf alone
    x[7, :VOCAB] = 3.0                        # all equal
    x[8, 3] = np.nan
    return x


@pytest.mark.parametrize("shards", [2, 4])
def test_greedy_tokens_equal_argmax_of_whole_rows(shards):
    padded = (VOCAB // shards + 1) * shards      # some padded ids on every mesh
    x = _rows(padded)
    mesh = Mesh(np.array(jax.devices()[:shards]), ("model",))
    fn = jax.jit(jax.shard_map(functools.partial(greedy_tokens, vocab_size=VOCAB, axis="model"), mesh=mesh,
                               in_specs=P(None, "model"), out_specs=P(), check_vma=False))
    got = np.asarray(fn(jnp.asarray(x)))
    want = np.asarray(jnp.argmax(jnp.asarray(x[:, :VOCAB]), axis=-1))
    np.testing.assert_array_equal(got, want)
    assert want[2] == 11 and want[3] == 1 and want[4] == 12 and want[1] == 2
