"""The overlapped tensor-parallel decode step (``models.collective_matmul``) on 4 CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=4``): tp 2 and tp 4 with 2 and 4 row chunks
(and tp 2 x dp 2, and a batch the chunks do not divide) give the greedy tokens of the plain
sharded step and of one device, the same logits in a decode step, the chained all-reduces in
the lowered program; bad options raise errors that name the field."""
import dataclasses
import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from models import Llama, LlamaConfig, PromptBatch, generate, init_params, params_from_hf_state_dict
from models.collective_matmul import CollectiveMatmul, OverlappedLlama, row_chunks
from models.sharded_llama import ShardedLlama
from models.sharding import make_mesh
from helpers import tiny_config, tiny_state_dict

NEW = 4


@pytest.fixture(scope="module")
def case():
    """A 4-kv-head tiny model, 6 sequences over one shared prefix, and one device's greedy run."""
    cfg = tiny_config(num_attention_heads=8, num_key_value_heads=4, head_dim=8)
    rng = np.random.default_rng(3)
    tok = lambda n: rng.integers(3, cfg["vocab_size"], n).tolist()  # noqa: E731
    pb = PromptBatch.shared(tok(11), suffixes=[tok(2), tok(1), tok(3)], num_samples=2)
    sd = {k: v * 2.0 if k.endswith("_proj.weight") else v for k, v in tiny_state_dict(cfg, seed=4).items()}
    config = LlamaConfig(**cfg)
    model = Llama(config)
    params = params_from_hf_state_dict(config, sd, jnp.float32)
    base = generate(model, params, pb, max_new_tokens=NEW, eos_token_ids=())
    assert len({tuple(r) for r in base.tokens}) >= 2   # the rows differ: a meaningful reference
    return config, model, params, pb, base


@pytest.fixture(scope="module")
def plain_runs(case):
    """The plain sharded step's greedy run on a ``(tp, dp)`` mesh (stacked layers), once each."""
    _, model, params, pb, _ = case
    runs = {}

    def run(tp, dp):
        if (tp, dp) not in runs:
            mesh = make_mesh(tp, dp)
            runs[tp, dp] = generate(ShardedLlama(model, mesh), params, pb, max_new_tokens=NEW, eos_token_ids=(),
                                    mesh=mesh, layout="stacked")
        return runs[tp, dp]
    return run


@pytest.mark.parametrize("tp,dp,chunks,layout", [(2, 1, 2, "stacked"), (2, 1, 4, "list"), (4, 1, 2, "stacked"),
                                                 (4, 1, 4, "stacked"), (2, 2, 2, "stacked")])
def test_overlapped_greedy_tokens_equal_plain_and_one_device(case, plain_runs, tp, dp, chunks, layout):
    """Greedy tokens and their log-probabilities; the list layout (unrolled layers, the GPU's)
    and the stacked one (a scan); on tp 2 x dp 2 each data shard chunks its own 3 rows."""
    _, model, params, pb, base = case
    mesh = make_mesh(tp, dp)
    plain = plain_runs(tp, dp)
    sharded = ShardedLlama(model, mesh, collective_matmul=CollectiveMatmul(overlap_chunks=chunks))
    assert isinstance(sharded.local_decode, OverlappedLlama)
    out = generate(sharded, params, pb, max_new_tokens=NEW, eos_token_ids=(), mesh=mesh, layout=layout)
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    np.testing.assert_array_equal(out.tokens, base.tokens)
    np.testing.assert_allclose(out.logprobs, plain.logprobs, atol=1e-5)


def compiled_all_reduces(hlo: str) -> list[int]:
    """For each all-reduce (or asynchronous ``all-reduce-start``) of compiled HLO text, the
    non-scalar arrays among its operands (more than 1: all-reduces were combined).  Operands,
    not the result type: an asynchronous start's result may also hold buffers of its own.
    Operands print as ``%name`` (their types looked up from the defining lines) or with their
    types inline."""
    types = dict(re.findall(r"%?([\w.\-]+) = (.*?) [\w\-]+\(", hlo))
    counts = []
    for operands in re.findall(r" all-reduce(?:-start)?\(([^)]*)\)", hlo):
        n = 0
        for operand in operands.split("%")[1:]:
            name = re.match(r"[\w.\-]+", operand).group(0)
            n += bool(re.search(r"\[\d[\d,]*\]", types.get(name, "")))
        counts.append(n)
    return counts


def schedule_summary(hlo: str) -> dict:
    """Where a compiled (scheduled) module runs its all-reduces: synchronous ones, asynchronous
    start/done pairs, and per pair the compute instructions (fusions, custom calls, calls)
    scheduled between its start and its done, i.e. what may run beside the collective."""
    between = []
    for comp in hlo.split("\n\n"):
        lines, starts = comp.splitlines(), {}
        for i, line in enumerate(lines):
            start = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*? all-reduce-start\(", line)
            if start:
                starts[start.group(1)] = i
            done = re.search(r" all-reduce-done\(.*?%([\w.\-]+)\)", line)
            if done and done.group(1) in starts:
                seg = lines[starts[done.group(1)] + 1:i]
                between.append(sum(bool(re.search(r" (?:fusion|custom-call|call)\(", x)) for x in seg))
    return {"all_reduce_sync": len(re.findall(r" all-reduce\(", hlo)), "all_reduce_async": len(between),
            "async_with_compute_between": sum(n > 0 for n in between), "compute_between": between}


def test_decode_step_logits_and_chained_all_reduces(case):
    """One decode step: the overlapped logits equal the plain ones (6 rows in 4 chunks of 2, 2,
    1, 1 rows on tp 2), and the compiled program keeps 2 all-reduces per layer and chunk, none
    combined with another (each reduces one chunk, beside the chain's scalar token)."""
    _, model, params, pb, base = case
    mesh = make_mesh(2, 1)
    plain = ShardedLlama(model, mesh)
    over = ShardedLlama(model, mesh, collective_matmul=CollectiveMatmul(overlap_chunks=4))
    placed = plain.params_in_layout(plain.place_params(params), stacked=False)   # unrolled layers, the GPU's
    _, cache = plain.prefill_prompts(placed, pb, None, capacity=2, attention="shared", shape_buckets=False)
    tokens = jnp.asarray(base.tokens[:, 0], jnp.int32)
    compiled = {m: jax.jit(m.decode_step).lower(placed, cache, tokens).compile() for m in (plain, over)}
    want, got = (np.asarray(compiled[m](placed, cache, tokens)[0]) for m in (plain, over))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    layers, chunks = len(placed["layers"]), len(row_chunks(pb.batch, 4))
    assert chunks == 4
    assert compiled_all_reduces(compiled[plain].as_text()) == [1] * (2 * layers + 1)   # o, down; embedding
    assert compiled_all_reduces(compiled[over].as_text()) == [1] * (2 * chunks * layers + 1)
    summary = schedule_summary(compiled[over].as_text())
    assert summary["all_reduce_sync"] + summary["all_reduce_async"] == 2 * chunks * layers + 1


def test_schedule_summary_reads_async_pairs():
    hlo = """ENTRY %main (p: f32[8,64]) -> f32[8,64] {
  %p = f32[8,64]{1,0} parameter(0)
  %all-reduce-start = f32[8,64]{1,0} all-reduce-start(f32[8,64]{1,0} %p), channel_id=1, replica_groups={{0,1}}
  %fusion.1 = f32[8,64]{1,0} fusion(f32[8,64]{1,0} %p), kind=kLoop, calls=%fused
  %custom-call.2 = f32[8,64]{1,0} custom-call(f32[8,64]{1,0} %fusion.1), custom_call_target="__cublas$gemm"
  %all-reduce-done = f32[8,64]{1,0} all-reduce-done(f32[8,64]{1,0} %all-reduce-start)
  %all-reduce-start.1 = f32[8,64]{1,0} all-reduce-start(f32[8,64]{1,0} %all-reduce-done), channel_id=2, replica_groups={{0,1}}
  %all-reduce-done.1 = f32[8,64]{1,0} all-reduce-done(f32[8,64]{1,0} %all-reduce-start.1)
  ROOT %all-reduce.3 = f32[8,64]{1,0} all-reduce(f32[8,64]{1,0} %all-reduce-done.1), channel_id=3, replica_groups={{0,1}}
}
"""
    assert schedule_summary(hlo) == {"all_reduce_sync": 1, "all_reduce_async": 2, "async_with_compute_between": 1,
                                     "compute_between": [2, 0]}
    assert compiled_all_reduces(hlo) == [1, 1, 1]
    combined = ("%a = f32[8,64]{1,0} parameter(0)\n%t = f32[] parameter(1)\n%b = f32[2,1,64]{2,1,0} parameter(2)\n"
                "%c = f32[4]{0} parameter(3)\n"
                "%ar = (f32[8,64]{1,0}, f32[]) all-reduce(%a, %t)\n"
                "%ar2 = (f32[2,1,64]{2,1,0}, f32[4]{0}) all-reduce(f32[2,1,64]{2,1,0} %b, f32[4]{0} %c)\n"
                "%ars = (f32[8,64]{1,0}, f32[8,64]{1,0}) all-reduce-start(f32[8,64]{1,0} %a)")
    assert compiled_all_reduces(combined) == [1, 2, 1]


def test_one_chunk_and_one_shard_run_the_plain_layers(case):
    _, model, _, _, _ = case
    one = ShardedLlama(model, make_mesh(2), collective_matmul=CollectiveMatmul(overlap_chunks=1))
    assert one.local_decode is one.local and not isinstance(one.local, OverlappedLlama)
    dp_only = ShardedLlama(model, make_mesh(1, 2), collective_matmul=CollectiveMatmul(overlap_chunks=4))
    assert dp_only.local_decode is dp_only.local
    # the option is part of the static identity of the sharded model (jit caches)
    a = ShardedLlama(model, make_mesh(2), collective_matmul=CollectiveMatmul(overlap_chunks=2))
    b = ShardedLlama(model, make_mesh(2), collective_matmul=CollectiveMatmul(overlap_chunks=2))
    assert a == b and hash(a) == hash(b) and a != one


def test_row_chunks():
    assert row_chunks(8, 2) == ((0, 4), (4, 8))
    assert row_chunks(6, 4) == ((0, 2), (2, 4), (4, 5), (5, 6))
    assert row_chunks(3, 4) == ((0, 1), (1, 2), (2, 3))
    assert row_chunks(5, 1) == ((0, 5),)
    assert row_chunks(0, 3) == ((0, 0),)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2", None])
def test_bad_overlap_chunks_raise_naming_the_field(bad):
    with pytest.raises(ValueError, match=r"CollectiveMatmul\.overlap_chunks must be an int >= 1"):
        CollectiveMatmul(overlap_chunks=bad)


def test_bad_option_types_raise(case):
    _, model, _, _, _ = case
    with pytest.raises(TypeError, match="collective_matmul must be a models.collective_matmul.CollectiveMatmul"):
        ShardedLlama(model, make_mesh(2), collective_matmul=2)
    assert CollectiveMatmul(np.int64(3)).overlap_chunks == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        CollectiveMatmul(2).overlap_chunks = 3


@pytest.mark.gpu
@pytest.mark.two_gpus
def test_two_gpus_overlapped_step_at_llama8b_layer_shapes(results_log):
    """2 GPUs, Llama-3.1-8B layer shapes (2 layers, float32 random weights), B = 8 over a shared
    1K-token prefix: 2 and 4 row chunks give the plain tp 2 step's greedy tokens; the compiled
    decode step (list layout, the GPU's) keeps 2 x chunks separate all-reduces per layer, and
    where XLA scheduled them is logged (``--results-log``), not asserted."""
    config = LlamaConfig.preset("Llama-3.1-8B").replace(num_hidden_layers=2)
    params = init_params(config, jax.random.PRNGKey(0), jnp.float32, std=0.05)
    model, mesh = Llama(config), make_mesh(2, 1)
    rng = np.random.default_rng(0)
    tok = lambda n: rng.integers(0, config.vocab_size, n).tolist()  # noqa: E731
    pb = PromptBatch.shared(tok(1024), suffixes=[tok(5), tok(3), tok(9), tok(1)], num_samples=2)
    plain_model = ShardedLlama(model, mesh)
    plain = generate(plain_model, params, pb, max_new_tokens=8, eos_token_ids=(), mesh=mesh)
    assert len({tuple(r) for r in plain.tokens}) >= 2
    placed = plain_model.params_in_layout(plain_model.place_params(params), stacked=False)
    _, cache = plain_model.prefill_prompts(placed, pb, None, capacity=8, attention="shared", shape_buckets=False)
    tokens = jnp.asarray(plain.tokens[:, 0], jnp.int32)
    for chunks in (2, 4):
        sharded = ShardedLlama(model, mesh, collective_matmul=CollectiveMatmul(overlap_chunks=chunks))
        out = generate(sharded, params, pb, max_new_tokens=8, eos_token_ids=(), mesh=mesh)
        np.testing.assert_array_equal(out.tokens, plain.tokens, err_msg=f"chunks={chunks}")
        np.testing.assert_allclose(out.logprobs, plain.logprobs, atol=2e-3, err_msg=f"chunks={chunks}")
        hlo = jax.jit(sharded.decode_step).lower(placed, cache, tokens).compile().as_text()
        operands = compiled_all_reduces(hlo)
        assert max(operands) == 1, operands
        assert len(operands) >= 2 * chunks * config.num_hidden_layers, operands
        results_log(chunks=chunks, jax=jax.__version__, **schedule_summary(hlo))
