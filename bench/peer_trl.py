"""rldsl against Hugging Face TRL's GRPOTrainer on this CPU.

Both train the same local Hugging Face Llama (hidden 256, 4 layers, ~2.6M
parameters, character tokenizer) on the same jsonl additions with the same
exact-match reward, 16 prompts x 8 completions per step, 8 new tokens, KL
0.001, the same AdamW settings and learning rate. TRL runs in its own venv
(created on first use); rldsl runs through `rldsl run`, once on-policy
(max_lag 0) and once one-step off-policy (max_lag 1). Runs are interleaved,
TRL first in each repetition. Prints completions/s of the training loop
(each tool's own clock), seconds per step, whole-process wall time, and the
machine's busy CPU per completion over the whole process (on a CPU that
both tools keep saturated, that decides which can be faster).

    python bench/peer_trl.py [--reps 2] [--steps 20] [--quick]

Everything built lives in ~/.cache/rldsl/bench/peer_trl/ (or
$RLDSL_CACHE_DIR/bench/peer_trl/) and is reused; `last/` there keeps the
logs and run directories of the latest invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("RLDSL_CACHE_DIR", Path.home() / ".cache" / "rldsl")) / "bench" / "peer_trl"

PROMPTS_PER_STEP = 16
SAMPLES_PER_PROMPT = 8
MAX_NEW_TOKENS = 8
KL = 0.001
CLIP = 0.2
LR = 5e-4
ADAM_BETAS = (0.9, 0.99)  # rldsl's torch trainer; TRL is told the same
MAX_GRAD_NORM = 1.0
SEED = 0
MODEL_SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=4, max_position_embeddings=64)
TORCH_PIN = "torch==2.13.0"  # the CPU build; unpinned, pip pulls a CUDA torch of several GB
GOAL_SPEEDUP = 1.5
TAIL_LINES = 40


class BenchError(Exception):
    """A step of the benchmark failed; the message says which and why."""


# ---------------------------------------------------------------- model and data


def build_model(path: Path) -> Path:
    """A random-init LlamaForCausalLM with a character tokenizer, saved with
    save_pretrained; reused when present. The tokenizer's post-processor adds
    <bos> as rldsl's engines do, so both tools see the same prompt ids."""
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    import tokenizers
    import torch
    import transformers

    from rldsl.models.tokenizer import SPECIAL_TOKENS, CharTokenizer

    staging = path.with_name(path.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *CharTokenizer().characters])}
    chars = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    chars.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    chars.post_processor = tokenizers.processors.TemplateProcessing(single="<bos> $A",
                                                                    special_tokens=[("<bos>", vocab["<bos>"])])
    chars.decoder = tokenizers.decoders.Fuse()
    chars.save(str(staging / "tokenizer.json"))
    special = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}
    transformers.PreTrainedTokenizerFast(tokenizer_file=str(staging / "tokenizer.json"), **special
                                         ).save_pretrained(staging)
    config = transformers.LlamaConfig(vocab_size=len(vocab), bos_token_id=vocab["<bos>"],
                                      eos_token_id=vocab["<eos>"], pad_token_id=vocab["<pad>"], **MODEL_SHAPE)
    torch.manual_seed(SEED)
    transformers.LlamaForCausalLM(config).save_pretrained(staging)
    shutil.rmtree(path, ignore_errors=True)
    staging.rename(path)
    return path


def build_dataset(path: Path) -> Path:
    """The builtin arithmetic train split as jsonl rows {prompt, answer}:
    rldsl's `jsonl:` source and TRL's `datasets` json loader read this file."""
    if path.exists():
        return path
    from rldsl.tasks import arith_prompts

    rows = [json.dumps({"prompt": p.text, "answer": p.answer}) for p in arith_prompts("train", seed=SEED)]
    partial = path.with_name(path.name + ".partial")
    partial.write_text("\n".join(rows) + "\n", encoding="utf-8")
    partial.rename(path)
    return path


def parameter_count(model_dir: Path) -> int:
    import math

    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as weights:
        return sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())


# ---------------------------------------------------------------- TRL venv


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def ensure_venv(venv: Path) -> float | None:
    """TRL's own venv, created on first use; returns the setup seconds, or
    None when it was already there. A marker file is written last, so an
    interrupted install is redone rather than half-used."""
    marker = venv / ".peer_trl_ready"
    if marker.exists():
        return None
    shutil.rmtree(venv, ignore_errors=True)
    print(f"setting up TRL in {venv} (first use: {TORCH_PIN} + trl) ...", flush=True)
    started = time.monotonic()
    log = venv.with_name("venv-setup.log")
    _checked([sys.executable, "-m", "venv", str(venv)], log, "creating the TRL venv")
    _checked([str(venv_python(venv)), "-m", "pip", "install", "--quiet", TORCH_PIN, "trl"], log,
             "installing torch and trl into the TRL venv")
    _checked([str(venv_python(venv)), "-c", "import torch, trl; assert '+cpu' in torch.__version__ or "
              "not torch.cuda.is_available(), torch.__version__"], log, "importing trl in its venv")
    marker.write_text(_trl_versions(venv))
    return time.monotonic() - started


def _trl_versions(venv: Path) -> str:
    code = "import torch, transformers, trl; print(f'trl {trl.__version__}, transformers " \
           "{transformers.__version__}, torch {torch.__version__}')"
    return subprocess.run([str(venv_python(venv)), "-c", code], capture_output=True, text=True).stdout.strip()


def _checked(command: list[str], log: Path, what: str) -> None:
    with log.open("a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        try:
            code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode
        except OSError as error:
            raise BenchError(f"{what}: {error}") from None
    if code != 0:
        raise BenchError(f"{what} failed (exit {code}); last lines of {log}:\n{tail(log)}")


def tail(log: Path, lines: int = TAIL_LINES) -> str:
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError:
        return "(no output)"
    return "\n".join(f"  | {line}" for line in text[-lines:])


# ---------------------------------------------------------------- the two sides

TRL_SCRIPT = '''\
"""GRPOTrainer on the benchmark's model and data; writes the training-loop clock as JSON."""
import json
import sys
import time

from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

settings = json.loads(sys.argv[1])


def exact_match(completions, answer, **kw):
    return [1.0 if c.strip() == a.strip() else 0.0 for c, a in zip(completions, answer)]


class Clock(TrainerCallback):
    """Wall clock of trainer.train()'s loop: its first generation to its last optimizer step."""

    def on_train_begin(self, args, state, control, **kw):
        self.begin = time.monotonic()

    def on_train_end(self, args, state, control, **kw):
        self.end, self.steps = time.monotonic(), state.global_step


config = GRPOConfig(
    output_dir=settings["output_dir"], use_cpu=True, report_to="none", use_vllm=False, bf16=False,
    num_generations=settings["samples_per_prompt"], per_device_train_batch_size=settings["samples_per_prompt"],
    gradient_accumulation_steps=settings["prompts_per_step"], max_completion_length=settings["max_new_tokens"],
    temperature=1.0, top_p=1.0, beta=settings["kl"], epsilon=settings["clip"], loss_type="dapo",
    learning_rate=settings["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
    adam_beta1=settings["betas"][0], adam_beta2=settings["betas"][1], max_grad_norm=settings["max_grad_norm"],
    max_steps=settings["steps"], seed=settings["seed"], save_strategy="no", logging_steps=1, disable_tqdm=True,
)
tokenizer = AutoTokenizer.from_pretrained(settings["model"], local_files_only=True)
model = AutoModelForCausalLM.from_pretrained(settings["model"], local_files_only=True)
dataset = load_dataset("json", data_files=settings["data"], split="train")
clock = Clock()
trainer = GRPOTrainer(model=model, reward_funcs=exact_match, args=config, train_dataset=dataset,
                      processing_class=tokenizer, callbacks=[clock])
trainer.train()
with open(settings["result"], "w") as out:
    json.dump({"loop_s": clock.end - clock.begin, "steps": clock.steps}, out)
'''


def machine_cpu_seconds() -> float:
    """CPU seconds every core of the machine has spent busy since boot
    (/proc/stat; 0 where there is none). Across a run it counts the run's
    processes and helpers (Ray's, TransferQueue's) alike, and anything else
    running: the load column says how much else there was."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


LAST_CPU_S: dict[str, float] = {}  # the CPU seconds of the latest timed() call


def timed(command: list[str], log: Path, what: str, env: dict | None = None) -> float:
    """Whole-process seconds, subprocess start to exit; output goes to ``log``."""
    started, cpu_started = time.monotonic(), machine_cpu_seconds()
    with log.open("w") as out:
        try:
            code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                  env={**os.environ, **(env or {})}).returncode
        except OSError as error:
            raise BenchError(f"{what}: {error}") from None
    if code != 0:
        raise BenchError(f"{what} failed (exit {code}); last lines of {log}:\n{tail(log)}")
    LAST_CPU_S["cpu_s"] = machine_cpu_seconds() - cpu_started
    return time.monotonic() - started


def run_trl(venv: Path, model: Path, data: Path, steps: int, work: Path) -> dict:
    script = work / "trl_grpo.py"
    script.write_text(TRL_SCRIPT)
    result = work / "trl-result.json"
    result.unlink(missing_ok=True)
    settings = {"model": str(model), "data": str(data), "steps": steps, "output_dir": str(work / "trl-out"),
                "result": str(result), "samples_per_prompt": SAMPLES_PER_PROMPT, "seed": SEED,
                "prompts_per_step": PROMPTS_PER_STEP, "max_new_tokens": MAX_NEW_TOKENS, "kl": KL, "clip": CLIP,
                "lr": LR, "betas": ADAM_BETAS, "max_grad_norm": MAX_GRAD_NORM}
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    process_s = timed([str(venv_python(venv)), str(script), json.dumps(settings)], work / "trl.log",
                      "TRL GRPOTrainer run", env=offline)
    try:
        clock = json.loads(result.read_text())
    except (OSError, ValueError) as error:
        raise BenchError(f"TRL GRPOTrainer run wrote no result ({error}); last lines of {work / 'trl.log'}:\n"
                         f"{tail(work / 'trl.log')}") from None
    return _figures(clock["steps"], clock["loop_s"], process_s, LAST_CPU_S["cpu_s"])


def rlp_text(model: Path, data: Path, steps: int, max_lag: int) -> str:
    """The pipeline: one torch generator and one torch trainer (reference
    colocated) on 2 logical GPUs, as pipelines/grpo_async.rlp. On-policy
    runs colocate the generator with the trainer too: with max_lag 0 the two
    alternate anyway, and on disjoint GPUs `check --strict` rejects it
    (RLP401)."""
    placement = "gpus = 1" if max_lag > 0 else "colocate = actor"
    return f"""\
# Generated by bench/peer_trl.py: the same run as its TRL GRPOTrainer peer.
pipeline peer_trl_lag{max_lag}

cluster {{ nodes = 1  gpus_per_node = 2 }}

model policy {{ source = "hf:{model}" }}
dataset prompts {{ source = "jsonl:{data}"  eval_size = 0 }}

stage generate rollout {{
  model = policy  engine = torch  {placement}
  samples_per_prompt = {SAMPLES_PER_PROMPT}  max_new_tokens = {MAX_NEW_TOKENS}  temperature = 1.0  top_p = 1.0
}}
stage reward score {{ fn = "rldsl.rewards:exact_match"  workers = 1  timeout = 5s }}
stage logprob reference {{ model = policy  frozen  colocate = actor }}
stage train actor {{
  model = policy  engine = torch  gpus = 1
  prompts_per_step = {PROMPTS_PER_STEP}  micro_batch = {SAMPLES_PER_PROMPT}
  loss = grpo(clip = {CLIP}, kl = {KL}, agg = token_mean)
  lr = {LR}  weight_decay = 0.0  max_grad_norm = {MAX_GRAD_NORM}
}}
stage sync weights {{ from = actor  to = rollout  bucket = 64MiB }}

flow prompts -> rollout -> score -> reference -> actor
staleness {{ max_lag = {max_lag} }}
run {{ steps = {steps}  seed = {SEED}  eval_every = 0  checkpoint_every = 0 }}
"""


def write_pipeline(path: Path, text: str) -> Path:
    path.write_text(text)
    log = path.with_suffix(".check.log")
    timed([sys.executable, "-m", "rldsl", "check", "--strict", "--color", "never", str(path)], log,
          f"rldsl check --strict {path}")
    return path


def run_rldsl(pipeline: Path, run_dir: Path, log: Path) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)
    process_s = timed([sys.executable, "-m", "rldsl", "run", str(pipeline), "--run-dir", str(run_dir)], log,
                      f"rldsl run {pipeline.name}")
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError) as error:
        raise BenchError(f"rldsl run {pipeline.name}: no readable summary.json in {run_dir} ({error}); "
                         f"last lines of {log}:\n{tail(log)}") from None
    return _figures(summary["steps"], summary["elapsed_s"], process_s, LAST_CPU_S["cpu_s"])


def _figures(steps: int, loop_s: float, process_s: float, cpu_s: float) -> dict:
    completions = steps * PROMPTS_PER_STEP * SAMPLES_PER_PROMPT
    return {"steps": steps, "loop_s": loop_s, "completions_per_s": completions / loop_s,
            "step_s": loop_s / max(steps, 1), "process_s": process_s,
            "cpu_ms_per_completion": 1000 * cpu_s / max(completions, 1),
            "cores_busy": cpu_s / max(process_s, 1e-9)}


# ---------------------------------------------------------------- report

TRL, LAG0, LAG1 = "TRL GRPOTrainer", "rldsl max_lag 0", "rldsl max_lag 1"


def print_run(rep: int, name: str, r: dict) -> None:
    print(f"{rep:>3}  {name:<16} {r['steps']:>5} {r['completions_per_s']:>14.1f} {r['step_s']:>8.3f} "
          f"{r['loop_s']:>7.1f} {r['process_s']:>10.1f} {r['cpu_ms_per_completion']:>9.1f} "
          f"{r['cores_busy']:>6.2f} {r['load']:>5.1f}", flush=True)


def measured(run, *args) -> dict:
    """``run(*args)`` with the 1-minute load average at its start: on a
    shared machine it says how much to trust the row."""
    load = os.getloadavg()[0]
    return {**run(*args), "load": load}


def print_summary(results: dict[str, list[dict]]) -> None:
    median = {name: {key: statistics.median(r[key] for r in runs)
                     for key in ("completions_per_s", "process_s", "cpu_ms_per_completion")}
              for name, runs in results.items()}
    print("\nmedians over repetitions:")
    for name in (LAG0, LAG1):
        print(f"{name} / TRL completions/s: "
              f"{median[name]['completions_per_s'] / median[TRL]['completions_per_s']:.2f}x")
    for name in (LAG0, LAG1):
        print(f"whole-process time {name} / TRL: {median[name]['process_s'] / median[TRL]['process_s']:.2f}x")
    for name in (LAG0, LAG1):
        print(f"CPU per completion, whole process, {name} / TRL: "
              f"{median[name]['cpu_ms_per_completion'] / median[TRL]['cpu_ms_per_completion']:.2f}x")
    speedup = median[LAG1]["completions_per_s"] / median[TRL]["completions_per_s"]
    process = median[LAG1]["process_s"] / median[TRL]["process_s"]
    print(f"goal: rldsl max_lag 1 completions/s >= {GOAL_SPEEDUP}x TRL's: "
          f"{'met' if speedup >= GOAL_SPEEDUP else 'not met'} ({speedup:.2f}x)")
    print(f"goal: rldsl max_lag 1 whole-process time <= TRL's: {'met' if process <= 1.0 else 'not met'} "
          f"({process:.2f}x)")


# ---------------------------------------------------------------- main


def prepare(steps: int) -> tuple[Path, Path, Path, dict[str, Path], Path]:
    CACHE.mkdir(parents=True, exist_ok=True)
    venv = CACHE / "venv"
    setup_s = ensure_venv(venv)
    if setup_s is not None:
        print(f"TRL venv ready in {setup_s:.0f} s", flush=True)
    model = build_model(CACHE / "model")
    data = build_dataset(CACHE / "arith-train.jsonl")
    work = CACHE / "last"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    pipelines = {name: write_pipeline(work / f"peer_trl_lag{lag}.rlp", rlp_text(model, data, steps, lag))
                 for name, lag in ((LAG0, 0), (LAG1, 1))}
    print(f"{(venv / '.peer_trl_ready').read_text().strip()}; model {model} "
          f"({parameter_count(model) / 1e6:.2f}M parameters); data {data}")
    return venv, model, data, pipelines, work


def run_all(reps: int, steps: int) -> dict[str, list[dict]]:
    venv, model, data, pipelines, work = prepare(steps)
    print(f"{steps} steps of {PROMPTS_PER_STEP} prompts x {SAMPLES_PER_PROMPT} completions, "
          f"{MAX_NEW_TOKENS} new tokens, KL {KL}, lr {LR}; {os.cpu_count()} CPU cores; "
          "load: 1-minute load average at each run's start; CPU ms/c: busy CPU of the whole machine over the "
          "whole process per completion; cores: its mean busy cores")
    print(f"{'rep':>3}  {'run':<16} {'steps':>5} {'completions/s':>14} {'s/step':>8} {'loop s':>7} {'process s':>10} "
          f"{'CPU ms/c':>9} {'cores':>6} {'load':>5}")
    results: dict[str, list[dict]] = {TRL: [], LAG0: [], LAG1: []}
    for rep in range(1, reps + 1):
        results[TRL].append(measured(run_trl, venv, model, data, steps, work))
        print_run(rep, TRL, results[TRL][-1])
        for name, pipeline in pipelines.items():
            tag = pipeline.stem + f"-rep{rep}"
            results[name].append(measured(run_rldsl, pipeline, work / tag, work / f"{tag}.log"))
            print_run(rep, name, results[name][-1])
    print(f"logs and run directories: {work}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=2, help="interleaved repetitions (default 2)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run (default 20)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 3 steps, 1 repetition")
    args = parser.parse_args()
    if args.reps < 1 or args.steps < 1:
        parser.error("--reps and --steps must be at least 1")
    reps, steps = (1, 3) if args.quick else (args.reps, args.steps)
    try:
        print_summary(run_all(reps, steps))
    except (BenchError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
