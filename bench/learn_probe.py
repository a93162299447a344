"""Does the embedded default learn? A single-process GRPO loop on the torch engines.

    python bench/learn_probe.py [--task builtin:arith] [--steps 120] ...

Warm-starts builtin:tiny-lm (cached; --fresh-cache retrains it and times
it), measures held-out greedy accuracy, then runs GRPO exactly as the
runtime would, minus Ray: generate with TorchGenerator, reward, group
advantages, one split train step per RL step (one microbatch per prompt
group), weight sync through buckets, and measures accuracy again.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections import deque

import torch

from rldsl.models import load_model
from rldsl.rewards import load_reward, safe_reward
from rldsl.runtime.engines.torch_engine import TorchGenerator, TorchTrainer, group_advantages
from rldsl.tasks import load_dataset


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="builtin:arith")
    parser.add_argument("--reward", default="rldsl.rewards:exact_match")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--samples-per-prompt", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--beta2", type=float, default=0.99)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--clip", type=float, default=0.2)
    parser.add_argument("--kl", type=float, default=0.0)
    parser.add_argument("--level", default="token", choices=["token", "sequence"])
    parser.add_argument("--bucket-bytes", type=int, default=64 * 1024)
    parser.add_argument(
        "--warm", action="append", default=[], metavar="NAME=VALUE", help="override a WarmStartSettings field"
    )
    parser.add_argument("--d-model", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--lag", type=int, default=1, help="steps between generation and training (max_lag)")
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--fresh-cache", action="store_true", help="retrain the warm start in a temp cache")
    return parser.parse_args()


def accuracy(generator: TorchGenerator, prompts, reward) -> float:
    responses = generator.generate_greedy(prompts)
    return sum(reward(r, p.answer, p.text) for r, p in zip(responses, prompts)) / len(prompts)


def rollout(step, prompts, generator, reward, args) -> dict:
    """One step's samples with rewards and group-normalised advantages."""
    batch = generator.generate(prompts, args.samples_per_prompt, seed=args.seed * 100_003 + step)
    responses = generator.decode(batch)
    rewards = []
    for row, response in enumerate(responses):
        prompt = prompts[row // args.samples_per_prompt]
        value, _ = safe_reward(reward, response, prompt.answer, prompt.text)
        rewards.append(value or 0.0)
    batch["reward"] = torch.tensor(rewards)
    batch["advantage"] = group_advantages(batch["reward"], args.samples_per_prompt)
    return batch


def train_and_sync(step, batch, generator, trainer, args) -> dict:
    trainer.begin_train_step(step)
    for start in range(0, len(batch["reward"]), args.samples_per_prompt):  # one prompt group per microbatch
        trainer.train_microbatch(step, {k: v[start : start + args.samples_per_prompt] for k, v in batch.items()})
    result = trainer.finish_train_step(step)
    buckets = list(trainer.weight_buckets(args.bucket_bytes))
    for index, bucket in enumerate(buckets):
        generator.update_weights(bucket, result.version, last=index == len(buckets) - 1)
    return result.metrics


def main():
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.fresh_cache:
        os.environ["RLDSL_CACHE_DIR"] = tempfile.mkdtemp(prefix="rldsl-probe-")
    started = time.perf_counter()
    warm = {name: float(value) for name, value in (item.split("=", 1) for item in args.warm)}
    shape = {}
    if args.d_model:
        shape.update(d_model=args.d_model, d_ff=4 * args.d_model)
    if args.layers:
        shape.update(n_layers=args.layers)
    policy = load_model("builtin:tiny-lm", seed=args.seed, warm_start_task=args.task, warm_start_settings=warm, **shape)
    warm_s = time.perf_counter() - started
    print(f"warm start: {getattr(policy, 'warm_start_report', {})} in {warm_s:.1f}s")
    generator = TorchGenerator(
        load_model("builtin:tiny-lm", seed=args.seed, warm_start_task=args.task, warm_start_settings=warm, **shape),
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
    )
    loss = {"clip": args.clip, "kl": args.kl, "level": args.level}
    trainer = TorchTrainer(
        policy, loss=loss, lr=args.lr, betas=(0.9, args.beta2), max_grad_norm=args.max_grad_norm or None
    )
    reward = load_reward(args.reward)
    exact = load_reward("rldsl.rewards:exact_match")
    train = load_dataset(args.task, "train", seed=args.seed)
    held_out = load_dataset(args.task, "eval", seed=args.seed)
    start_accuracy = accuracy(generator, held_out, exact)
    print(f"held-out greedy accuracy before RL: {start_accuracy:.3f} ({len(held_out)} prompts)")
    rl_started = time.perf_counter()
    def prompts_for(step):
        first = (step * args.prompts_per_step) % len(train)
        return train[first : first + args.prompts_per_step]

    # Samples are trained `lag` steps after they were generated, as with an
    # asynchronous pipeline whose generator runs max_lag steps ahead.
    in_flight = deque(rollout(step, prompts_for(step), generator, reward, args) for step in range(args.lag))
    for step in range(args.steps):
        in_flight.append(rollout(step + args.lag, prompts_for(step + args.lag), generator, reward, args))
        batch = in_flight.popleft()
        mean_reward = float(batch["reward"].mean())
        metrics = train_and_sync(step, batch, generator, trainer, args)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            elapsed = time.perf_counter() - rl_started
            print(
                f"step {step + 1:4d}  {elapsed:6.1f}s  reward {mean_reward:.3f}  "
                f"loss {metrics.get('loss', 0):+.4f}  ratio {metrics.get('mean_ratio', 1):.4f}  grad_norm {metrics.get('grad_norm', 0):.3f}  "
                f"held-out acc {accuracy(generator, held_out, exact):.3f}",
                flush=True,
            )
    rl_s = time.perf_counter() - rl_started
    end_accuracy = accuracy(generator, held_out, exact)
    print(
        f"\nheld-out greedy accuracy {start_accuracy:.3f} -> {end_accuracy:.3f} "
        f"({end_accuracy - start_accuracy:+.3f}); warm start {warm_s:.1f}s, RL {rl_s:.1f}s, "
        f"total {time.perf_counter() - started:.1f}s"
    )


if __name__ == "__main__":
    main()
