"""Does the embedded default learn? A single-process GRPO loop on the torch engines.

    python bench/learn_probe.py [--task builtin:arith] [--steps 100] [--fresh-cache] ...

Warm-starts builtin:tiny-lm (cached; --fresh-cache retrains it in a temp
cache and times it), measures held-out greedy accuracy, then runs GRPO the
way the runtime does, minus Ray: generate with TorchGenerator, reward, group
advantages, one split train step per RL step (one microbatch per prompt
group), weight sync through buckets; samples are trained ``--lag`` steps
after they were generated (max_lag). Then it measures accuracy again.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections import deque

import torch

from rldsl.rewards import exact_match, load_reward, safe_reward
from rldsl.runtime.control.advantages import batch_advantages
from rldsl.runtime.engines.torch import TorchGenerator, TorchLogprob, TorchTrainer
from rldsl.runtime.engines.torch.warmstart import WarmStartSettings, load_warm_started
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
    parser.add_argument("--kl", type=float, default=0.0, help="k3 KL coefficient to the frozen warm start")
    parser.add_argument("--agg", default="token_mean",
                        choices=["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"])
    parser.add_argument("--lag", type=int, default=1, help="steps between generation and training (max_lag)")
    parser.add_argument("--bucket-bytes", type=int, default=64 * 1024)
    parser.add_argument("--d-model", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--warm", action="append", default=[], metavar="NAME=VALUE", help="a WarmStartSettings field")
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--fresh-cache", action="store_true", help="retrain the warm start in a temp cache")
    return parser.parse_args()


def number(text: str):
    return int(text) if text.lstrip("-").isdigit() else float(text)


class Probe:
    def __init__(self, args):
        self.args = args
        shape = {}
        if args.d_model:
            shape.update(d_model=args.d_model, d_ff=4 * args.d_model)
        if args.layers:
            shape.update(n_layers=args.layers)
        warm = {name: number(value) for name, value in (item.split("=", 1) for item in args.warm)}

        def model():
            settings = WarmStartSettings(**warm)
            return load_warm_started(args.task, seed=args.seed, model_overrides=shape, settings=settings)

        started = time.perf_counter()
        policy = model()  # trains the warm start unless cached
        self.warm_start_s = time.perf_counter() - started
        self.warm_start_report = policy.warm_start_report
        self.generator = TorchGenerator(model(), args.max_new_tokens, args.temperature)
        self.reference = TorchLogprob(model()) if args.kl > 0 else None
        self.trainer = TorchTrainer(
            policy,
            loss={"clip": args.clip, "kl": args.kl, "agg": args.agg},
            lr=args.lr,
            betas=(0.9, args.beta2),
            max_grad_norm=args.max_grad_norm or None,
        )
        self.reward = load_reward(args.reward)
        self.train_prompts = load_dataset(args.task, "train", seed=args.seed)
        self.held_out = load_dataset(args.task, "eval", seed=args.seed)

    def accuracy(self) -> float:
        responses = self.generator.generate_greedy(self.held_out)
        return sum(exact_match(r, p.answer) for r, p in zip(responses, self.held_out)) / len(self.held_out)

    def prompts_for(self, step: int):
        first = (step * self.args.prompts_per_step) % len(self.train_prompts)
        return self.train_prompts[first : first + self.args.prompts_per_step]

    def rollout(self, step: int) -> dict:
        """One step's samples with rewards, advantages and (with KL) reference logprobs."""
        prompts, group = self.prompts_for(step), self.args.samples_per_prompt
        batch = self.generator.generate(prompts, group, seed=self.args.seed * 100_003 + step)
        rewards = []
        for row, response in enumerate(self.generator.decode(batch)):
            prompt = prompts[row // group]
            value, _ = safe_reward(self.reward, response, prompt.answer, prompt.text)
            rewards.append(value or 0.0)
        batch["reward"] = torch.tensor(rewards)
        batch["advantage"] = batch_advantages(batch["reward"], group)
        if self.reference is not None:
            batch["ref_logprobs"] = self.reference.logprobs(batch)
        return batch

    def train_and_sync(self, step: int, batch: dict) -> dict:
        group = self.args.samples_per_prompt
        self.trainer.begin_train_step(step)
        for start in range(0, len(batch["reward"]), group):  # one prompt group per microbatch
            self.trainer.train_microbatch(step, {name: value[start : start + group] for name, value in batch.items()})
        result = self.trainer.finish_train_step(step)
        buckets = list(self.trainer.weight_buckets(self.args.bucket_bytes))
        for index, bucket in enumerate(buckets):
            self.generator.update_weights(bucket, result.version, last=index == len(buckets) - 1)
        return result.metrics

    def run(self):
        args = self.args
        print(f"warm start {self.warm_start_report} in {self.warm_start_s:.1f}s")
        start_accuracy = self.accuracy()
        print(f"held-out greedy accuracy before RL: {start_accuracy:.3f} ({len(self.held_out)} prompts)")
        started = time.perf_counter()
        in_flight = deque(self.rollout(step) for step in range(args.lag))  # the generator runs `lag` ahead
        for step in range(args.steps):
            in_flight.append(self.rollout(step + args.lag))
            batch = in_flight.popleft()
            metrics = self.train_and_sync(step, batch)
            if (step + 1) % args.eval_every == 0:
                print(
                    f"step {step + 1:4d} {time.perf_counter() - started:6.1f}s  "
                    f"reward {float(batch['reward'].mean()):.3f}  ratio {metrics.get('mean_ratio', 1):.4f}  "
                    f"kl {metrics.get('kl', 0):.4f}  grad_norm {metrics.get('grad_norm', 0):.2f}  "
                    f"held-out acc {self.accuracy():.3f}",
                    flush=True,
                )
        rl_s = time.perf_counter() - started
        end_accuracy = self.accuracy()
        print(
            f"\nheld-out greedy accuracy {start_accuracy:.3f} -> {end_accuracy:.3f} "
            f"({end_accuracy - start_accuracy:+.3f}); warm start {self.warm_start_s:.1f}s, RL {rl_s:.1f}s "
            f"({rl_s / args.steps:.3f}s/step)"
        )


def main():
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.fresh_cache:
        os.environ["RLDSL_CACHE_DIR"] = tempfile.mkdtemp(prefix="rldsl-probe-")
    started = time.perf_counter()
    Probe(args).run()
    print(f"total wall-clock {time.perf_counter() - started:.1f}s")


if __name__ == "__main__":
    main()
