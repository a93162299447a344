"""Every rule: a stable code, a severity, a one-line summary, an
explanation with an example, and what the rule reads (it runs when exactly
that resolved). `rldsl explain CODE` prints an entry; docs/rules.md is
generated from this table (`python -m rldsl.compiler.rules.catalog`)."""

from __future__ import annotations

from dataclasses import dataclass

from rldsl.compiler.diagnostics import ERROR, WARNING


@dataclass(frozen=True)
class Rule:
    code: str
    severity: str
    summary: str
    explanation: str
    example: str  # a fragment that triggers the rule
    reads: str  # its inputs: when one did not resolve, the rule is skipped


def _r(code, severity, summary, explanation, example, reads):
    return Rule(code, severity, summary, explanation.strip(), example.strip("\n"), reads.strip())


_TEXT = "the text; it runs on every file."
_KEYS = "the block, key or name it is about, each on its own: every one is checked whatever else is wrong."
_GRAPH = ("every name in every `flow` of the pipeline resolved and every declaration kept (none dropped or "
          "declared twice): otherwise the graph is not the one written.")
_STEP = ("the train stage (exactly one) with its `prompts_per_step`, `global_batch` and `micro_batch`; the "
         "generate stage upstream of it, so the flows as for RLP203, with its `samples_per_prompt`")


RULES: dict[str, Rule] = {r.code: r for r in [
    _r("RLP001", ERROR, "syntax error",
       "The file does not follow the grammar: a missing `=`, an unclosed `{` or string, a stray character.",
       "stage train actor {\n  prompts_per_step 8\n}",
       _TEXT),
    _r("RLP002", ERROR, "nesting too deep",
       "Lists, calls and blocks nest at most 32 levels. No pipeline needs more; the bound keeps `check` from "
       "recursing without end on a damaged or generated file.",
       "stage train actor { model = policy  prompts_per_step = " + "[" * 33 + "1" + "]" * 33 + " }",
       _TEXT),
    _r("RLP003", ERROR, "line too long",
       "A line holds at most 20,000 characters. No pipeline needs more (a list of a thousand GPU ids fits); "
       "the bound keeps `check` fast on a damaged or generated file, whose megabyte-long line the lexer "
       "would walk for seconds.",
       "stage train actor { model = policy  gpus = [0, 1, 2, ...] }   # 20,001 characters on one line",
       _TEXT),
    _r("RLP101", ERROR, "unknown name",
       "A reference (a model, a stage, a dataset in a flow) names nothing declared in this pipeline. "
       "The help suggests the closest declared name.",
       "stage generate rollout { model = polcy  samples_per_prompt = 4 }",
       _KEYS),
    _r("RLP102", ERROR, "duplicate declaration or key",
       "Models, datasets and stages share one namespace per pipeline; a key may be set once per block.",
       "model policy { source = \"builtin:tiny-lm\" }\nmodel policy { source = \"builtin:tiny-lm\" }",
       _KEYS),
    _r("RLP103", ERROR, "unknown block, stage kind, key, engine or argument",
       "Something is spelt in a way the language does not know. The help suggests the closest known word.",
       "stage generate rollout { model = policy  samples_per_promt = 4 }",
       _KEYS),
    _r("RLP104", ERROR, "wrong type or malformed value",
       "A value has the wrong shape: a string where a number is expected, a name that should be quoted, "
       "a malformed block head.",
       "stage generate rollout { model = policy  samples_per_prompt = \"four\" }",
       _KEYS),
    _r("RLP105", ERROR, "missing or unknown unit",
       "Sizes, durations and counts carry units (`256MiB`, `30s`, `7B`); a bare number is ambiguous there.",
       "stage sync weights { from = actor  to = rollout  bucket = 256 }",
       _KEYS),
    _r("RLP106", ERROR, "value out of range",
       "A number outside what the key accepts (a negative count, a fraction above 100%, `top_p = 0`, which "
       "keeps no token and every engine refuses, a `temperature` above 2 on vLLM, which refuses it, a `min_new_tokens` above `max_new_tokens`). A number past ±1e18 is one such finding: its key holds no "
       "value and every other finding of the file is still reported.",
       "stage generate rollout { model = policy  samples_per_prompt = 0 }",
       _KEYS),
    _r("RLP107", ERROR, "missing required key or declaration",
       "A block lacks a key it cannot do without, or the file lacks a pipeline or a cluster.",
       "stage train actor { model = policy }",
       _KEYS),
    _r("RLP108", ERROR, "engine cannot run this stage",
       "Each engine serves some stage kinds (vLLM generates and scores, megatron trains and scores), "
       "GPU engines need GPUs, and `pp > 1` is refused for a stage kind its engine does not pipeline "
       "(megatron pipelines train and logprob stages, vLLM generate and logprob stages). A logprob stage's "
       "`micro_batch_tokens` is refused on vLLM and SGLang, which schedule their own forwards and would "
       "ignore it.",
       "stage train actor { model = policy  engine = vllm(tp = 1)  prompts_per_step = 2 }",
       "the stage's `engine`; for a GPU-only engine also the cluster's `gpus_per_node` (or, for a stage "
       "without GPUs, its placement); for a logprob stage its `micro_batch_tokens`."),
    _r("RLP109", WARNING, "renamed setting",
       "A setting written under a name the language has since renamed still works: it is read under its new "
       "name (its value translated where the values changed too) and every rule checks it as if it had been "
       "written so; the warning names the new spelling. `rldsl fmt --fix FILE` rewrites every renamed setting, "
       "comments kept. Renamed so far: the loss argument `level` (`token`, `sequence`) is `agg` (`token_mean`, "
       "`seq_mean_token_mean`).",
       "loss = grpo(clip = 0.2, level = sequence)   # now: agg = seq_mean_token_mean",
       _KEYS),
    _r("RLP110", ERROR, "`update = interrupt` the pipeline cannot honour",
       "`update = interrupt` applies a new weight version at the next decode step, with rows in flight: the "
       "engine must prefill them again under the new weights and record the version and log-probability of "
       "each token, which the `torch` and `vllm` engines do (SGLang's cannot). A policy logprob stage (`logprob` without `frozen`) "
       "that scores each sample at its generating version (`recompute = behaviour`) cannot be combined with it "
       "either: it recomputes behaviour_logprobs with one version for the whole sample, while the sample's "
       "tokens came from several. With `recompute = batch_start` it scores with the trainer's weights at the "
       "step's start, whatever generated the tokens, and is accepted.",
       "stage generate rollout { model = policy  engine = sglang  samples_per_prompt = 4  update = interrupt }",
       "the generate stage's `update` and `engine`; the logprob stages' `frozen` and `recompute`."),
    _r("RLP111", ERROR, "`recompute` on a frozen logprob stage",
       "`recompute` says which weights a policy logprob stage scores each row with: `behaviour` (the version "
       "that generated the row, kept by the stage) or `batch_start` (the trainer's weights at the start of the "
       "step that trains the row: verl's and ROLL's old-log-prob recompute). A `frozen` stage is a reference "
       "that never receives weights, so it has nothing to choose.",
       "stage logprob reference { model = policy  frozen  recompute = batch_start }",
       "each logprob stage's `frozen` and `recompute`."),
    _r("RLP112", ERROR, "a Hugging Face checkpoint expected where the model is none",
       "vLLM, SGLang and megatron load a local Hugging Face checkpoint (`hf:<path>`: config, weights, tokenizer); "
       "on the builtin model `rldsl run` stops when the engine starts. Use the `torch` (or `fsdp`) engine for "
       "`builtin:tiny-lm`. Likewise `chat_template = true` needs an `hf:` model whose tokenizer has a template "
       "(the launcher refuses it before anything starts). `check` and the launcher ask the same predicates "
       "(rldsl/launch_rules.py).",
       "model policy { source = \"builtin:tiny-lm\" }\nstage generate rollout { model = policy  engine = vllm ... }",
       "each stage's `engine` and its model's `source`; each model's `source` and `chat_template`."),
    _r("RLP113", ERROR, "reward-model setting without a reward model, or one the judge does not read",
       "A reward stage scores with `fn` on CPU workers, with a reward model (`model = NAME`), or both. `engine`, "
       "`gpus`, `colocate`, `judge`, `template`, `parse`, `weight`, `max_new_tokens` and `micro_batch` describe the "
       "reward model and mean nothing without one; `template`, `parse` and `max_new_tokens` are read only by a "
       "generating judge (`judge = generate`), not by a scoring one.",
       "stage reward score { fn = \"rldsl.rewards:exact_match\"  judge = generate }",
       "each reward stage's `fn`, `model`, `judge` and the keys it writes."),
    _r("RLP114", ERROR, "reward model unfit for its `judge`",
       "`judge = score` runs a Hugging Face sequence-classification model with one label (its logit is the "
       "reward) on the torch engine: a builtin model, a config.json whose `architectures` hold no "
       "`...ForSequenceClassification`, or one with several labels, is refused. `judge = generate` needs a model "
       "that generates: a classifier is refused. A config.json that cannot be read here is left to `rldsl run`.",
       "model rm { source = \"builtin:tiny-lm\" }\nstage reward judge { model = rm  judge = score }",
       "each reward stage's `model` (its `source`, and an `hf:` model's config.json), `judge` and `engine`."),
    _r("RLP115", ERROR, "held-out evaluation by a reward that includes a reward model",
       "Held-out evaluation scores responses on the CPU beside training, with reward functions only; with "
       "`eval_metric = reward` (the default) and a reward model in the pipeline it cannot compute the reward "
       "trained on. Name a function, or turn evaluation off.",
       "stage reward judge { model = rm }   # with the dataset's default `eval_metric = reward`",
       "the reward stages' `model`, each dataset's `eval_metric` and `eval_size`."),
    _r("RLP116", ERROR, "a sim generator asked for text",
       "The `sim` engine draws token ids at calibrated latencies: it has no model and no tokenizer, so it cannot "
       "run an environment's episodes (the episodes talk to the model in text) nor decode held-out evaluation "
       "(`eval_on = generators`, when the run evaluates: a trainer with weights, `eval_size` above 0, an "
       "evaluation asked for). `rldsl run` refuses the environment when the stage starts and the evaluation when "
       "it first comes.",
       "dataset prompts { source = \"builtin:arith\"  eval_on = generators }\n"
       "stage generate rollout { model = policy  engine = sim ... }",
       "each generate stage's `engine` and `environment`; the first dataset's `eval_on` and `eval_size`, the "
       "trainer's `engine` and the run's `eval_every`, `eval_at_start` and `eval_at_end`."),
    _r("RLP117", WARNING, "responses past the model's context, cut to fit",
       "The builtin model has 64 positions: the longest prompt (a builtin task's longest, or the datasets' "
       "`max_prompt_tokens`, or at least its BOS) and a response must fit them, or the forward of the long "
       "response fails in the generator, a logprob stage or the trainer and stops the run. So the plan holds "
       "`max_new_tokens` cut to what fits (57 on `builtin:arith`, 49 on `builtin:reverse`): silently for the "
       "default, with this warning where the file writes more (a run with only shorter responses is the same; "
       "one that reached the limit stopped before). The launcher refuses a hand-edited plan past it. Prompts "
       "that fill the whole context (`max_prompt_tokens` of 64 or more) leave no room: RLP106. An "
       "environment's episodes are RLP601's.",
       "stage generate rollout { model = policy  max_new_tokens = 60 ... }   # builtin:tiny-lm on builtin:arith",
       "each generate stage's `max_new_tokens`, `engine`, `environment` and its model's `source`; the datasets' "
       "`source`, `sources` and `max_prompt_tokens`."),
    _r("RLP118", ERROR, "LoRA adapters on an engine that cannot train or serve them",
       "A model with `lora_rank` trains only its low-rank adapters, and every stage that holds the policy holds "
       "them: the trainer trains them, generators and policy logprob stages receive them in each push (only "
       "they are pushed). The `torch` engines do all three (and `sim`, which has no model); `fsdp` trains "
       "them; a vLLM generator "
       "serves each pushed version as an adapter of its own, per request, and a request keeps its adapter to "
       "its end, so there `update = interrupt` cannot land a version mid-response; `sleep = 2` discards the "
       "base weights, which no adapter push restores; and vLLM implements LoRA for some architectures only, "
       "not GPT-2 (`builtin:tiny-gpt2`; an `hf:` model of another such architecture is refused when the engine "
       "starts, before vLLM does). SGLang, megatron, and fsdp "
       "or vLLM policy logprob stages do not hold adapters yet, and `rldsl run` would refuse the stage when it "
       "starts. A frozen reference (`frozen`) is the base model, the policy with its adapters off, and runs on "
       "any engine.",
       "model policy { source = \"hf:/models/llama-8b\"  lora_rank = 16 }\n"
       "stage train actor { model = policy  engine = megatron(tp = 2) ... }",
       "each stage's `engine` (its `sleep`), `model`, `frozen` and `update`; its model's `lora_rank`."),
    _r("RLP119", ERROR, "LoRA setting without `lora_rank`",
       "`lora_alpha` and `lora_targets` shape the adapters that `lora_rank` asks for; without a rank the model "
       "trains every weight and they would mean nothing, so a forgotten rank would silently train (and push) "
       "the whole model.",
       "model policy { source = \"builtin:tiny-lm\"  lora_targets = [\"qkv\"] }",
       "each model's `lora_rank`, `lora_alpha` and `lora_targets`."),
    _r("RLP201", ERROR, "dataflow cycle",
       "Data edges (`flow`) must form a DAG; the cycle is named. Weight edges (`sync`) close the RL loop and "
       "are not part of this check.",
       "flow prompts -> rollout -> score -> rollout",
       "the flow edges whose two names resolved: a cycle among them is a cycle whatever else is wrong."),
    _r("RLP202", WARNING, "orphan stage",
       "A stage that appears in no flow never receives data; it would start actors that do nothing.",
       "stage reward unused { fn = \"rldsl.rewards:exact_match\" }   # and no flow mentions it",
       _GRAPH),
    _r("RLP203", ERROR, "unreachable stage",
       "A stage in a flow that no dataset reaches: nothing would ever feed it.",
       "flow score -> actor   # score is fed by nothing",
       _GRAPH),
    _r("RLP204", ERROR, "consumed field without a producer",
       "Fields type the dataflow: generation writes responses (and behaviour logprobs unless `logprobs = false`), "
       "rewards write `reward`, a frozen logprob stage writes `ref_logprobs`, a policy logprob stage "
       "`behaviour_logprobs`. A KL term needs reference logprobs upstream of the trainer; max_lag > 0 needs "
       "behaviour logprobs for the importance ratio.",
       "stage train actor { ... loss = grpo(kl = 0.01) }   # with no frozen logprob stage upstream",
       _GRAPH + " Also the consumer's `loss` (for the KL term), the staleness `max_lag` (for behaviour "
       "logprobs) and each upstream producer's `logprobs` or `frozen`: a field whose producer is unknown is not "
       "checked."),
    _r("RLP205", ERROR, "trained model's generator receives no sync",
       "A generate stage, or a policy (not `frozen`) logprob stage, of a model that a train stage updates must "
       "receive the new weights through a `sync` stage; otherwise it samples (or scores) with the initial "
       "weights forever and the lag grows without bound. A policy logprob stage on the trainer's own GPUs is no "
       "exception: it holds its own copy of the weights (written without a sync, as files were before this rule "
       "covered it, it is read as a target of the trainer's sync: RLP210).",
       "stage train actor { model = policy ... }   # and no `stage sync ... { from = actor to = rollout }`",
       "every sync's `from` and `to`, the trainer's and the stage's `model`, a logprob stage's `frozen`; "
       "every declaration kept (a dropped block may be the sync)."),
    _r("RLP206", ERROR, "invalid sync",
       "A sync goes from a train stage to generate (or policy logprob) stages of the same model.",
       "stage sync weights { from = rollout  to = actor }",
       "the sync's `from` and `to`, and the `model` of both ends."),
    _r("RLP207", ERROR, "invalid flow edge",
       "Data flows dataset -> generate -> (reward | logprob)* -> train. A train stage produces weights, not data; "
       "a dataset feeds generation only.",
       "flow prompts -> actor",
       "the two names of the edge, resolved."),
    _r("RLP208", ERROR, "incomplete pipeline",
       "A pipeline needs a dataset, a generate stage, a reward stage and one train stage.",
       "pipeline p   # with stages but no train stage",
       "every declaration kept (a missing piece may be a block that was dropped); whether a generate stage "
       "feeds the trainer also " + _GRAPH),
    _r("RLP209", ERROR, "generation never runs the trained model",
       "A trainer updates one model; if every generate stage upstream of it runs another model, its updates never "
       "reach generation: every step trains on samples of a model nobody updates and the RL loop never closes. "
       "(A sync across models is RLP206.)",
       "stage generate rollout { model = base ... }   stage train actor { model = policy ... }   # no sync",
       "the trainer's `model`, the generate stages upstream of it and their `model`, every sync's `from` "
       "and `to`; " + _GRAPH),
    _r("RLP210", WARNING, "policy logprob stage on the trainer's GPUs without a sync (old meaning kept)",
       "A policy (not `frozen`) logprob stage that names the trainer in `colocate`, or shares a placement group "
       "with it, once needed no sync: it was documented to score with the trainer's weights (NeMo RL's "
       "`prev_logprobs` and AReaL's proximal pass were translated so). Since RLP205 covers it, such a file keeps "
       "that meaning: the stage is read as one more target of the trainer's sync, so the plan has the weight "
       "edge and every version is pushed to it, as if the file listed it in the sync's `to`. The warning's edit "
       "lists it there; `rldsl fmt --fix` writes it. A trainer with no sync at all gets none made up (its "
       "generators need one too: RLP205).",
       "stage logprob behaviour { model = policy  colocate = actor }   # and `stage sync weights { from = actor "
       "to = rollout }`",
       "every sync's `from` and `to`, the trainer's and the stage's `model`, the stage's `frozen` and `colocate`, "
       "the placement `groups`; every declaration kept (a dropped block may be the sync)."),
    _r("RLP301", ERROR, "global_batch is not a mini-batch of the rollout batch",
       "A step generates a rollout batch of prompts_per_step x samples_per_prompt samples and trains it in "
       "optimizer steps of global_batch samples each (verl's ppo_mini_batch_size x n, NeMo RL's "
       "train_global_batch_size, OpenRLHF's train_batch_size). global_batch must be whole prompt groups "
       "(a multiple of samples_per_prompt) and divide the rollout batch; left out, it is the rollout batch: "
       "one optimizer step.",
       "prompts_per_step = 8  global_batch = 60   # with samples_per_prompt = 8",
       _STEP + "."),
    _r("RLP302", ERROR, "global_batch not divisible by micro_batch x data-parallel size",
       "Every data-parallel rank runs whole microbatches; global_batch must split evenly into "
       "micro_batch x dp pieces.",
       "global_batch = 64  micro_batch = 6   # dp = 2",
       _STEP + ", and the trainer's data-parallel size: its GPU count (its `gpus`, its colocation "
       "target's, or its group's share) and its engine's tp and pp. Where its GPUs lie does not matter: it runs "
       "when another stage could not be placed, not when the trainer's own count is unknown or RLP502 fired."),
    _r("RLP303", ERROR, "a group estimator with fewer than 2 samples per prompt",
       "grpo, dr_grpo, rloo and reinforce_pp_baseline compare each sample with the rest of its prompt's group; "
       "with one sample every advantage is zero and nothing is learned. reinforce_pp needs no group.",
       "samples_per_prompt = 1",
       _STEP + ", and the trainer's `advantage`."),
    _r("RLP304", ERROR, "buffer too small: the rollout pump deadlocks",
       "The trainer needs prompts_per_step ready groups before it can finish a step, and consumed groups stay "
       "stored until the step's single clear. A buffer holding fewer groups fills up, the rollout pump waits "
       "for space and the trainer waits for groups: a deadlock. The diagnostic prints the numbers.",
       "buffer { capacity = 4 }   # with prompts_per_step = 8",
       "the train stage (exactly one) and its `prompts_per_step`, the staleness `max_lag`, the buffer's "
       "`capacity` and `max_inflight`: nothing of the dataflow or the placement."),
    _r("RLP305", WARNING, "in-flight limit below one step's prompts",
       "With max_inflight < prompts_per_step a step's groups are generated in several waves; generation "
       "cannot keep up with training. Not a deadlock, a slowdown; or max_inflight above the buffer capacity, "
       "which can never be reached.",
       "buffer { max_inflight = 2 }   # with prompts_per_step = 8",
       "the train stage (exactly one) and its `prompts_per_step`, the staleness `max_lag`, the buffer's "
       "`capacity` and `max_inflight`: nothing of the dataflow or the placement."),
    _r("RLP306", WARNING, "buffer smaller than the staleness window",
       "With max_lag = L generation may run L steps ahead of training, which needs room for "
       "prompts_per_step x (L + 1) groups. A smaller buffer is safe but caps the overlap.",
       "buffer { capacity = 8 }   # with prompts_per_step = 8 and max_lag = 1",
       "the train stage (exactly one) and its `prompts_per_step`, the staleness `max_lag`, the buffer's "
       "`capacity` and `max_inflight`: nothing of the dataflow or the placement."),
    _r("RLP308", ERROR, "dynamic sampling that cannot refill a step",
       "dynamic_sampling (DAPO) drops prompt groups whose rewards are all equal and samples more prompts in "
       "their place, so each step stays full. An in-order step trains exactly its own prompts and cannot take "
       "replacements; with one sample per prompt every group would be dropped.",
       "dynamic_sampling = true   # with staleness { order = in_order }",
       "the train stage's `dynamic_sampling`, the staleness `order` and the upstream generator's "
       "`samples_per_prompt`, each finding on its own."),
    _r("RLP309", ERROR, "run length in both epochs and samples",
       "A run lasts `steps` rollout batches, `epochs` passes over the training prompts, or `samples` trained "
       "samples. `steps` may stand beside `epochs` or `samples` as a cap: the run ends at whichever bound it "
       "reaches first (NeMo RL's `max_num_steps` with `max_num_epochs`). `epochs` and `samples` both count "
       "the data trained on, so together they say one length twice: keep one.",
       "run { epochs = 2  samples = 100000 }",
       "the run block's `epochs` and `samples` as written."),
    _r("RLP310", ERROR, "dataset without one source, or weights that do not match",
       "A dataset has `source` or, for a mixture, `sources` with optional `weights` (one non-negative weight "
       "per source, not all 0).",
       "sources = [\"builtin:arith\", \"builtin:reverse\"]  weights = [0.7, 0.2, 0.1]",
       "each dataset's `source`, `sources` and `weights`."),
    _r("RLP311", WARNING, "warmup longer than the run",
       "Warmup counts optimizer steps; when it is not shorter than the run's optimizer steps (rollout batches "
       "x optimizer steps per rollout batch) the learning rate never reaches `lr`.",
       "warmup = 50   # in a 20-step run with one optimizer step per rollout batch",
       _STEP + ", its `warmup` and `ppo_epochs`, and the run's length (a run in epochs is skipped: its steps "
       "are known only when the dataset is read)."),
    _r("RLP312", ERROR, "loss or schedule argument outside its working range",
       "`dual_clip` is 0 (off) or above 1: it caps a negative-advantage token's loss at dual_clip x |A|, "
       "which must lie above the clipped loss. `behaviour_cap` is 0 (off) or at least 1: a cap below 1 would "
       "drop the tokens the behaviour policy preferred. A `linear` or `cosine` schedule decays from `lr` to "
       "`min_lr`, so `min_lr` must not exceed `lr`; a warmup rises from `warmup_start_lr` to `lr`, so "
       "`warmup_start_lr` must not exceed it either. `adam_betas` are two values, each below 1, and "
       "`difficulty_mask` two bounds, `[low, high]`. `clip` stays below 1 (the ratio's lower bound, "
       "1 - clip, above 0; every trainer refuses 1). A "
       "`correction` keeps the on-policy weight 1 (`correction_low` <= 1 <= `correction_high`), `icepop` is "
       "token-level, `is` (the untruncated weight) takes no bounds, and `behaviour_cap` and a `correction` are "
       "not combined (both weight the tokens). `length_norm` divides `agg = seq_mean_token_sum` only, "
       "`count_masked` acts on a sequence mean only, and `kl_weighted` on `kl_in = loss` only.",
       "loss = grpo(dual_clip = 0.5)",
       "the train stage's `loss`; for `min_lr`, its `lr`, `min_lr` and `lr_schedule`; for `warmup_start_lr`, "
       "its `lr` and `warmup_start_lr`; its `adam_betas` and `difficulty_mask`; the loss's `correction` "
       "arguments."),
    _r("RLP313", WARNING, "evaluation on the training prompts",
       "Held-out evaluation reads the dataset's `eval_source`, or else the eval split of its first source (a "
       "`jsonl:` file without `{split}` in its path is split by a hash of each prompt: about 5% of its rows are "
       "held out and never trained on). An `eval_source` that names a training file is read whole for both, "
       "so the held-out accuracy `rldsl run` reports would be accuracy on training prompts.",
       'dataset prompts { source = "jsonl:data/math.jsonl"  eval_source = "jsonl:data/math.jsonl" }',
       "each dataset's `source`, `sources`, `eval_source` and `eval_size`."),
    _r("RLP314", ERROR, "the pipeline cannot learn",
       "The run would go to its end and train nothing. These cases are certain from the file: one sample per "
       "prompt with `advantage = reinforce_pp` and `normalize = group` (a one-sample group has no spread: "
       "every advantage is zero, so is every loss; the group-baseline estimators are RLP303's); exact "
       "match on a builtin task with responses shorter than every answer (the reward is a constant 0; with "
       "`truncated = mask` the answer's end token must fit too, since only responses that ended are trained, "
       "so a right answer cut at the limit rewards nothing); `reward_scale = 0` (every reward 0); and a "
       "`difficulty_mask` that masks every prompt group out of the loss: bounds with no value strictly "
       "between them, or, with exact match as the only reward, bounds that hold no mean of 0/1 rewards over "
       "up to `samples_per_prompt` samples.",
       "loss ...  advantage = reinforce_pp  normalize = group   # with samples_per_prompt = 1",
       "the train stage's `advantage` and `normalize` and its generator's `samples_per_prompt`; for the "
       "reward case the reward's `fn`, the dataset's builtin source, the policy's source, `max_new_tokens` and "
       "`truncated`; the train stage's `reward_scale`; its `difficulty_mask`, with the reward's `fn` and the "
       "generator's `samples_per_prompt`."),
    _r("RLP315", WARNING, "responses shorter than some answers",
       "With exact match as the only reward on a builtin task, a response must be as long as the answer. "
       "`max_new_tokens` below the task's longest answer leaves those prompts unrewardable: they train "
       "nothing and cap the reachable accuracy. With `truncated = mask` the end token must fit as well.",
       "stage generate rollout { model = policy  max_new_tokens = 2 }   # builtin:arith answers run to 3",
       "the reward's `fn`, the dataset's builtin source, the policy's source and the generator's "
       "`max_new_tokens` and `truncated`."),
    _r("RLP316", WARNING, "a forward token budget below the longest row",
       "`micro_batch_tokens` packs a train or logprob stage's rows into forwards of at most that many tokens, "
       "but a single longer row goes alone, in a forward past the budget, so the bound it sets on memory does "
       "not hold (NeMo RL and verl refuse such a row at run time). The longest row is the generators' "
       "`max_model_len`, or the datasets' `max_prompt_tokens` plus `max_new_tokens` (an environment's "
       "`max_tokens`), whichever is smaller; the rule is silent when neither is known.",
       "micro_batch_tokens = 1024   # rollout: vllm(max_model_len = 4096)",
       "the stage's `micro_batch_tokens`; the generate stages' engines (`max_model_len`), `max_new_tokens` "
       "and environments' `max_tokens`; the datasets' `max_prompt_tokens`."),
    _r("RLP317", ERROR, "max_ahead that contradicts max_lag",
       "`max_ahead` bounds the prompt groups generated ahead of the trainer, in steps of prompts_per_step "
       "(verl's `staleness_threshold`): at most max_ahead x prompts_per_step groups generated before a version "
       "train at or after it. A group generated more than max_lag steps ahead would train past max_lag, so "
       "max_ahead may not exceed max_lag (verl's threshold f needs max_lag = ceil(f)). And it counts whole "
       "groups: below one group nothing is generated ahead and nothing trains off-policy, which max_lag > 0 "
       "says it may (write max_lag = 0 for that). Either order works with it.",
       "staleness { max_lag = 1  max_ahead = 1.5 }",
       "the staleness `max_lag` and `max_ahead`, and the train stage's `prompts_per_step` (for the whole-group "
       "check)."),
    _r("RLP318", WARNING, "a run that cannot move the policy",
       "The run would go to its end with the weights as they started: `lr = 0` (every optimizer step changes "
       "nothing), or greedy sampling (`temperature = 0`) with an estimator that subtracts the group's mean "
       "reward (grpo, dr_grpo, rloo, reinforce_pp_baseline): the samples of a prompt are one response repeated, "
       "their rewards equal, every advantage 0. A warning, since the run does run (`check --strict` fails it).",
       "stage generate rollout { model = policy  samples_per_prompt = 4  temperature = 0 }",
       "the train stage's `lr` and `advantage`; its generator's `temperature`, `engine` and "
       "`samples_per_prompt` (the flows as for RLP203)."),
    _r("RLP319", WARNING, "a rollout correction that does nothing",
       "A `correction` weighs each token by p_prox / p_behaviour. A policy logprob stage with `recompute = "
       "batch_start` replaces the generator's behaviour logprobs with the trainer's at the step's start, which "
       "is the proximal policy itself: every weight is 1 and the correction changes nothing (a warning; "
       "`check --strict` fails it). Keep the generator's logprobs (no such stage, or `recompute = behaviour`) "
       "for the correction to act.",
       "loss = grpo(correction = tis)   # with stage logprob behaviour { model = policy  recompute = batch_start }",
       "the train stage's `loss` and each logprob stage's `frozen` and `recompute`."),
    _r("RLP401", WARNING, "on-policy with disjoint generate and train GPUs",
       "With max_lag = 0 generation of step t+1 must wait for the weights of step t, so on separate GPUs each "
       "side idles while the other works. Allow max_lag = 1 or colocate the stages.",
       "staleness { max_lag = 0 }   # rollout on GPUs 0-1, actor on GPUs 2-3",
       "the staleness `max_lag`, the generate stage upstream of the trainer (the flows as for RLP203) and the "
       "placement of both."),
    _r("RLP501", ERROR, "GPUs over-subscribed",
       "The stages ask for more GPUs than the cluster has, or name GPU ids beyond it. Colocate stages, shrink "
       "them or grow the cluster.",
       "cluster { gpus_per_node = 4 }   # rollout gpus = 4 and actor gpus = 2",
       "the cluster's size and the stage's `gpus`; for a stage placed by count also every stage placed "
       "before it: once one of those is unplaced, where later counts land is unknown and they are not placed."),
    _r("RLP502", ERROR, "tp x pp x dp does not match the stage's GPUs",
       "A stage's GPUs split into data-parallel replicas of tp x pp GPUs each; the count must divide evenly.",
       "engine = megatron(tp = 2, pp = 2)  gpus = 6",
       "the stage's GPUs (placed) and its engine's tp and pp."),
    _r("RLP503", ERROR, "tensor parallelism crosses a node",
       "Tensor-parallel ranks exchange activations every layer and must share a node's fast interconnect.",
       "engine = vllm(tp = 16)   # with gpus_per_node = 8",
       "the stage's GPUs (placed) and its engine's tp and pp."),
    _r("RLP504", ERROR, "colocated stage cannot sleep or offload",
       "Stages sharing GPUs take turns: each must release its memory (vLLM sleep, trainer offload) while the "
       "other runs. An engine with sleep/offload disabled cannot share, with one exception: a train stage that "
       "does not offload stays resident on its GPUs while the other stages of its pipeline take turns beside "
       "it (the runtime's offload call is then a no-op), allowed when the cluster declares `gpu_memory` and "
       "the memory estimate, which adds the trainer's peak to every other stage on those GPUs, fits each of "
       "them (docs/performance.md#memory-model). Nor can vLLM at sleep level 2 (weights discarded) share on a "
       "stage no sync refills, which would wake without weights.",
       "engine = vllm(sleep = false)  colocate = actor",
       "the placement of both stages and their engines; for a train stage that does not offload also the "
       "cluster's `gpu_memory` and the memory estimate of its GPUs; for sleep level 2 every sync of the "
       "pipeline."),
    _r("RLP505", ERROR, "invalid partial overlap",
       "A partial overlap (a train stage on some of a generate stage's GPUs) is valid when the train GPUs lie "
       "inside the generate GPUs, each generation replica lies wholly inside or wholly outside them, and at "
       "least one replica stays outside so generation continues during training.",
       "rollout gpus = 0..3 with vllm(tp = 2); actor gpus = 1..2",
       "the placement of both stages and the generate stage's replicas."),
    _r("RLP506", ERROR, "estimated memory above GPU memory",
       "With `gpu_memory` declared, the plan estimates each stage's peak on one of its GPUs, per engine and "
       "phase (docs/performance.md#memory-model): an `fsdp` trainer holds fp32 master, gradient and AdamW "
       "shards (16 bytes per parameter / its shard group), two gathered layers and the embedding and head in "
       "the compute dtype, and a microbatch's checkpointed activations and fp32 logits, or during a weight "
       "sync two of its buckets; `megatron` holds weights and fp32 gradients / (tp x pp) and AdamW state also "
       "/ dp with the distributed optimizer, activations / tp, or during a weight sync its largest weight "
       "gathered whole and two of its buckets; `torch` holds all of it unsharded with every "
       "layer's activations; vLLM and SGLang reserve their share; sim engines count nothing; a logprob "
       "stage's forward holds its logits in the compute dtype and one fp32 slice of them (`megatron`: all in "
       "fp32). A GPU counts the largest peak of its stages that sleep plus every stage that cannot, and every "
       "logprob stage, which scores as groups arrive, beside generation and training, however it rests. The "
       "notes split each stage's peak into params, gathered layers, grads, optimizer, activations and buckets.",
       "cluster { gpu_memory = 24GiB }   # training a 7B model on one GPU",
       "the cluster's `gpu_memory`, the placement of each GPU's stages, their engines and their models' "
       "`source`, `params` and `dtype` (an `hf:` model's config.json for its shape); a trainer's "
       "`micro_batch` and `micro_batch_tokens`, a logprob stage's `micro_batch` and `micro_batch_tokens`, the "
       "generators' `samples_per_prompt`, `max_new_tokens` and `max_model_len` and the bucket of a sync from "
       "the trainer for its activations and buckets; a stage left unplaced is left out, activations whose "
       "token count did not resolve are."),
    _r("RLP507", ERROR, "invalid placement groups",
       "`placement { groups, ratios }` splits the cluster's GPUs: one ratio per group, ratios summing to 100%, "
       "each share a whole, non-zero number of GPUs (every group's share is checked), each stage in at most one "
       "group, only GPU stages, none also setting `gpus` or `colocate`.",
       "placement { groups = [[actor, reference], rollout]  ratios = [50%, 40%] }",
       "the placement block's `groups` and `ratios` (every name in them resolved) and the cluster's size."),
    _r("RLP508", ERROR, "invalid colocation",
       "`colocate = X` shares X's GPUs: X must be a GPU stage other than this one, itself placed, and the "
       "stage must not also give `gpus`.",
       "stage logprob reference { model = policy  colocate = score }",
       "the stage's `colocate` and `gpus` and the target's placement: a target left unplaced by its own "
       "error leaves the stage unplaced without a second finding."),
    _r("RLP509", WARNING, "GPUs shared between pipelines without `share`",
       "Pipelines of one file share a GPU when one names the other in its `placement { share = [...] }`: "
       "then their stages take turns on it (RLP504 and RLP505 apply across pipelines). An undeclared overlap is "
       "often a slip in GPU ids, or placement groups of two pipelines both starting at GPU 0 (groups split the "
       "whole cluster, so such pipelines take turns with `share` or are placed by `gpus` ids instead). Files "
       "written before `share` existed shared GPUs without it, so an undeclared overlap keeps that meaning: the "
       "pipelines take turns as if `share` were written (the plan is the same), with this warning (an error "
       "under `check --strict`); its edit writes the `share`, and `rldsl fmt --fix` applies it. It comes "
       "first, with the findings it explains folded under it: RLP504 and RLP505 between stages of the two "
       "pipelines, and RLP506 of a shared GPU where each pipeline's own stages would fit.",
       "pipeline a { ... gpus = [0] ... }   pipeline b { ... gpus = [0] ... }   # and no `share`",
       "the placement of stages of two pipelines and both pipelines' `share`."),
    _r("RLP510", ERROR, "fsdp shard groups do not divide the data-parallel ranks",
       "`fsdp(shard = S)` shards each tensor within groups of S data-parallel ranks and replicates it across "
       "the groups (hybrid sharding), so S must divide the stage's data-parallel size; `shard = 0` shards "
       "over all of them. This holds for the trainer and for a logprob stage that shards (on a logprob stage "
       "`shard` left out is 1: each rank holds the whole model).",
       "engine = fsdp(shard = 3)   # on 2 GPUs",
       "the `engine` of the train stage and of each fsdp logprob stage, and its data-parallel size (as RLP302 "
       "reads it)."),
    _r("RLP511", ERROR, "`transport = collective` where a receiver cannot take part",
       "A collective sync streams each new version rank to rank to every receiver at once, in a process group "
       "of their own: the trainer's engine must stream buckets (torch, fsdp, megatron, sim), and every receiver "
       "must be a generate stage on the torch or vllm (or sim) engine that is awake whenever a version is ready, so not "
       "on the trainer's GPUs, nor asleep between the turns of GPUs another pipeline shares (the trainer or a "
       "generator on one). SGLang receivers take weights through the object store. "
       "`transport = auto` uses the collective only where it can. `check` and the launcher ask the same rule "
       "(rldsl/collective_rule.py).",
       "stage sync weights { from = actor  to = rollout  transport = collective }   # rollout: engine = sglang",
       "the sync's `transport`, `from` and `to`, the stages' engines and kinds, and the placement of this "
       "pipeline's trainer and generators and of every other pipeline's stages."),
    _r("RLP512", ERROR, "a placement Ray cannot lay out",
       "`check` lays the plan out exactly as `rldsl run` will (rldsl/layout.py): one placement-group bundle per "
       "set of GPUs driven together. Ray gives an actor either whole GPUs or a fraction of one GPU, so one actor "
       "driving several GPUs (an SGLang tp = 2 replica) cannot share them with another stage's actors; a vLLM "
       "replica can, leaving its GPUs to its engine's Ray workers, one per GPU, each with the replica's share of "
       "it (verl's tp = 2 rollout on its trainer's GPUs). A replica across nodes needs its GPUs to itself. A plan "
       "that checks is a plan that launches. (A generate stage that itself names another in `colocate` runs "
       "single-GPU replicas instead where one GPU holds its model: RLP521.)",
       "stage generate rollout { engine = vllm(tp = 2)  gpus = 2 }   stage train actor { colocate = rollout ... }",
       "the whole plan: it runs only on a file with no error (the plan must exist)."),
    _r("RLP513", ERROR, "a logprob stage on GPUs another pipeline shares",
       "Pipelines of one file take turns on a shared GPU through leases that generator replicas and train steps "
       "hold; a logprob stage has none, so it would score while another pipeline's stage holds the GPU, and "
       "`rldsl run` refuses the plan before anything starts. Give the logprob stage GPUs no other pipeline uses "
       "(colocated with its own trainer there, or its own `gpus`).",
       "pipeline b { ... stage logprob reference { model = policy  frozen  gpus = [1] } ... }   # pipeline a "
       "generates on GPU 1",
       "the placement of each logprob stage and of every other pipeline's stages."),
    _r("RLP514", ERROR, "a generate stage another pipeline's generator cannot serve",
       "`served_by = NAME` on a generate stage lets pipeline NAME's generator serve it: one engine holds the "
       "base model once and samples every pipeline's requests with that pipeline's own LoRA adapters, each "
       "pipeline pushing its own versions. So both models declare `lora_rank` and load the same base (the same "
       "`source`; for a builtin model also the same builtin task and `seed`, which its warm start depends on); "
       "the serving pipeline has one generate stage, on the `torch` or `vllm` engine, without a multi-turn "
       "environment, "
       "and on GPUs of its own; and the served stage leaves the engine, its GPUs and how it samples "
       "(`max_new_tokens`, `temperature`, `update`, ...) to the serving stage.",
       "pipeline b { model policy { source = \"builtin:tiny-lm\" }   # no lora_rank\n"
       "  stage generate rollout { model = policy  served_by = a  samples_per_prompt = 8 } ... }",
       "each generate stage's `served_by` and written keys; the two pipelines' models, builtin datasets and "
       "`seed`; the serving generator's engine, environment and placement."),
    _r("RLP515", ERROR, "a model or mixture of experts megatron cannot train here",
       "`megatron(ep = E, etp = T)` shards a mixture of experts' experts: each expert over T ranks (default `tp`), "
       "the experts over E groups of those, in every pipeline stage; the rest of the model is split by tp and pp "
       "as before. So etp x ep x pp must divide the stage's GPUs, and where the model's config.json is readable "
       "it must have experts and E must divide their number. The memory estimate (RLP506) counts the "
       "sharding (the experts' weights and gradients / (etp x ep x pp), their optimizer state also over the ranks "
       "holding the same experts). The megatron engine converts the model types llama, mistral, qwen2, qwen3 and "
       "qwen3_moe (another type's weights would not fit its layout). Of the mixtures, it converts Qwen3-MoE (router and "
       "experts, under expert parallelism each rank loading only its own experts and an export gathering "
       "them, an expert's shards over its `etp` ranks, which may differ from `tp`: `etp = 1` keeps each expert "
       "whole); another mixture (or `ep` on a model whose config is not readable) is refused (`rldsl run` would "
       "stop when megatron loads the stage). "
       "The fsdp engine trains any mixture as transformers builds it.",
       "stage train actor { model = policy  engine = megatron(tp = 2, ep = 4)  gpus = 6 ... }",
       "the `engine` of each megatron train or logprob stage, its GPU count and its model's config.json."),
    _r("RLP520", WARNING, "logprob forwards cut to fit the GPU (old meaning kept)",
       "How many rows a logprob stage scores per forward (`micro_batch`) and whether an `fsdp` logprob stage "
       "shards its model over its ranks (`shard = 0`) change its memory, not the logprobs it computes. Where "
       "the memory estimate puts a GPU above `gpu_memory` (RLP506) and sharding such stages on it, then halving "
       "their rows, makes every GPU fit, the file keeps its meaning with those settings: the plan carries them "
       "and this warning names them (an error under `check --strict`); `rldsl fmt --fix` writes them. Files "
       "written before the estimate counted a logprob forward beside every phase of the stages on its GPUs "
       "(OpenRLHF's translation scored 16 rows with a whole model per rank) check so. Only `torch`, `fsdp` and "
       "`megatron` stages without `micro_batch_tokens` are cut; where that is not enough, RLP506 reports the "
       "file as written.",
       "cluster { gpu_memory = 80GiB ... }   stage logprob behaviour { engine = fsdp  micro_batch = 16 ... }   "
       "# 16 rows of 2048 tokens beside vLLM's share",
       "what RLP506 reads, and each logprob stage's `engine`, `micro_batch` and `micro_batch_tokens` on a GPU "
       "above its memory."),
    _r("RLP521", WARNING, "a colocated multi-GPU generator replica split into single-GPU ones (old meaning kept)",
       "An SGLang replica is one actor driving tp GPUs, and Ray gives an actor whole GPUs or a fraction "
       "of one GPU, never a fraction of several: such a replica cannot share its GPUs with the stage it is "
       "colocated with (RLP512). Files written before `check` ran the launcher's layout checked, but never "
       "launched. (vLLM's replicas were read this way too, OpenRLHF's translation colocated four tp-2 vLLM "
       "engines with its trainer, until they left shared GPUs to their engine's Ray workers: they now run as "
       "written.) Where one GPU's share "
       "(`gpu_memory` of the engine times the cluster's `gpu_memory`) holds the model's weights in at most half "
       "of it, the rest left for the KV cache, such a generate stage is read as single-GPU replicas (`tp = 1`) "
       "on the same GPUs, which generate the same samples, with this warning (an error under `check --strict`); "
       "its edit writes `tp = 1`, and `rldsl fmt --fix` applies it. A model that needs tp > 1 to fit, or whose "
       "size or GPU is not declared, stays RLP512: give its replicas GPUs of their own.",
       "stage generate rollout { engine = sglang(tp = 2)  colocate = actor ... }",
       "the generate stage's `engine` (its `tp`, `pp`, `gpu_memory`, `dtype` and whether one actor drives a "
       "replica) and `colocate`, its model's `params` and `dtype`, and the cluster's `gpu_memory`."),
    _r("RLP601", ERROR, "an environment's episode outgrows the model's context",
       "Each turn of an episode re-reads the whole conversation: the prompt, then up to `max_tokens` of response "
       "(the model's turns and the environment's answers), and decodes up to the generate stage's "
       "`max_new_tokens` more. That must fit the engine's `max_model_len` (vLLM, SGLang) or the builtin tiny "
       "model's 64 positions. The prompt counts with the datasets' `max_prompt_tokens` when every one sets it.",
       "environment retry { fn = \"rldsl.environments:ArithRetry\"  max_turns = 3  max_tokens = 60 }\n"
       "stage generate rollout { model = policy  max_new_tokens = 8  environment = retry ... }",
       "each generate stage's `environment`, `max_new_tokens`, `engine` and model `source`; the environment's "
       "`max_turns` and `max_tokens`; the datasets' `max_prompt_tokens`."),
    _r("RLP602", WARNING, "an environment's turns do not fit its token budget",
       "`max_turns` turns of up to `max_new_tokens` each are more than an episode's `max_tokens`, which also holds "
       "the environment's answers: a long episode ends at the budget with its last turn cut short.",
       "environment retry { ... max_turns = 4  max_tokens = 24 }   # with max_new_tokens = 8",
       "as RLP601."),
    _r("RLP603", WARNING, "environment used by no generate stage",
       "An `environment` block that no generate stage names (`environment = NAME`) runs nothing. (The key "
       "belongs to generate stages; on another stage kind it is RLP103.)",
       "environment unused { fn = \"rldsl.environments:ArithRetry\"  max_turns = 2  max_tokens = 24 }",
       "every generate stage's `environment` (when one did not resolve, the rule is skipped)."),
    _r("RLP604", ERROR, "environment class that cannot be found",
       "`fn` names `module:Class`. A builtin (`rldsl.environments`) class is looked up; another module must be "
       "installed, on PYTHONPATH, or beside the pipeline file (its code is not run by `check`; a class missing "
       "from it fails the run at start, with the environment's own message).",
       "environment retry { fn = \"rldsl.environments:ArithRetri\"  max_turns = 3  max_tokens = 36 }",
       "the environment's `fn` and the pipeline file's directory."),
    _r("RLP605", ERROR, "environment samples scored by something other than their episode's reward",
       "A sample of a generate stage with an environment is an episode: its reward is the sum of the rewards "
       "its environment gave, read by a reward stage with `fn = \"rldsl.environments:episode_reward\"`, which "
       "also drops the samples whose episode failed (the environment raised, hung or died). Any other reward function "
       "would score a transcript.",
       "stage reward score { fn = \"rldsl.rewards:exact_match\" }   # after a generate stage with an environment",
       "the generate stages' `environment`, the flows (which reward stages follow them), each reward stage's "
       "`fn`."),
    _r("RLP606", ERROR, "`truncated = mask` on a generate stage with an environment",
       "`truncated = mask` leaves a single response cut at `max_new_tokens` out of the loss (overlong "
       "filtering). The samples of a stage with an environment are episodes: which tokens are trained is the "
       "environment's loss mask, and an episode ends by `max_turns` and `max_tokens`, so the setting has no "
       "meaning there and is refused rather than ignored.",
       "stage generate rollout { model = policy  environment = retry  truncated = mask ... }",
       "the generate stages' `environment` and `truncated`."),
    _r("RLP607", WARNING, "tools the model's calls never reach",
       "An environment with `tools` reads the model's tool calls in its native format, named by "
       "`tool_format` (`hermes`: `<tool_call>{json}</tool_call>` for Qwen and Hermes models, `pythonic`: "
       "`[name(arg=value)]` for Llama 3.2 and 4). With `tool_format = none` (the default) completions are never "
       "read as calls, so the tools would never run.",
       "environment calc { fn = \"...\"  tools = [\"rldsl.environments:calculate\"] }   # no tool_format",
       "each environment's `tools` and `tool_format`."),
    _r("RLP608", WARNING, "a straggler cut that drops healthy calls",
       "`straggler = F` on an environment or a reward stage takes a call for hung once it has run F times the "
       "usual time (a moving average) and drops its sample before `timeout`. Calls vary around their average, "
       "so a factor under 4 cuts calls of ordinary length, the longer ones first: samples lost, and a bias "
       "toward short episodes and quick rewards. 8 keeps a hang's cost near the usual time "
       "(bench/hang_cost.py) and drops no healthy call there.",
       "environment retry { fn = \"rldsl.environments:ArithRetry\"  max_turns = 3  max_tokens = 36  straggler = 2 }",
       "each environment's and reward stage's `straggler`."),
    _r("RLP609", ERROR, "episodes evaluated on the generators",
       "When the evaluation metric is the episode's reward (`eval_metric = \"rldsl.environments:episode_reward\"`, "
       "or the default `reward` when the reward stage reads the episode's), held-out evaluation plays each prompt "
       "as an episode in the environment, its tools and budgets included, on the evaluator's copy of the policy. "
       "The generators' evaluation (`eval_on = generators`) decodes one turn between two batches and cannot play "
       "episodes.",
       "dataset prompts { source = \"builtin:arith\"  eval_on = generators }   # samples are episodes",
       "the generate stages' `environment`, the reward stages' `fn`, and the datasets' `eval_metric`, `eval_size` "
       "and `eval_on`."),]}


DEPENDENCIES = """\
## Dependencies

Every rule runs whenever its own inputs resolved, whatever else in the file
is wrong, so a file with several independent mistakes reports each of them
in one run. An input that did not resolve is never replaced by a default or
a guess; the rules that read it are skipped:

- a key written wrongly, set twice, required but missing, or naming nothing
  (RLP101-RLP107) is *invalid*: it holds no value, and a rule reading it is
  skipped;
- a name declared twice (RLP102) is left out with both its declarations;
  a block dropped for an unknown kind or a malformed head (RLP103, RLP104)
  leaves its pipeline incomplete: rules over the whole pipeline (RLP202,
  RLP203, RLP204, RLP205, RLP208, RLP209) are skipped for it;
- a `cluster` that is missing or written twice leaves the cluster unknown:
  nothing is placed;
- a stage that cannot be placed (RLP501, RLP502, RLP507, RLP508, or an
  invalid `gpus`, `colocate` or `engine`) is left unplaced; a stage
  colocated with it, and every stage placed by count after it, are left
  unplaced too, without a finding of their own. The rules over placed stages
  (RLP401, RLP503-RLP506, RLP509, RLP513) skip unplaced ones; RLP302 needs only the
  trainer's GPU count.

So the rule families depend on each other only through these inputs:

| family | rules | reads |
|---|---|---|
| syntax | RLP001, RLP002, RLP003 | the text |
| declarations | RLP101-RLP107, RLP109 | the syntax tree |
| engines | RLP108, RLP110-RLP112, RLP116-RLP119 | each stage's engine; `update`; logprob stages' `frozen` and `recompute`; the model's `source`, `chat_template` and LoRA keys; evaluation and environments of sim generators; `max_new_tokens` and the prompts |
| reward models | RLP113-RLP115 | each reward stage's `fn`, `model` and judge keys, its config.json, the datasets |
| dataflow | RLP201-RLP204, RLP207, RLP208 | the flows and the declarations |
| weights | RLP205, RLP206, RLP209, RLP210, RLP511 | syncs, models, and the flows for RLP209; RLP210 `colocate` and placement groups; RLP511 the placement |
| batch sizes | RLP301-RLP303, RLP510 | trainer and generator sizes; RLP302 and RLP510 GPU counts |
| learning | RLP314-RLP316, RLP318, RLP319 | the estimator, samples per prompt, the reward, the builtin task, response and row limits; `lr`, `temperature`, the correction and `recompute` |
| training | RLP308-RLP313 | the trainer's loss, sampling and schedule keys, the run length, the datasets |
| buffer | RLP304-RLP306, RLP317 | the trainer's prompts_per_step, staleness and buffer |
| placement | RLP501-RLP503, RLP507, RLP508, RLP512, RLP515, RLP521 | cluster, `gpus`, `colocate`, placement groups, engines; RLP515 the model's config.json |
| sharing | RLP401, RLP504, RLP505, RLP509, RLP513, RLP514 | placed stages (RLP504 for a resident trainer also the memory estimate) |
| memory | RLP506, RLP520 | placed stages and their models; RLP520 the logprob stages' forwards |
| environments | RLP601-RLP609 | generate stages' environments, their budgets, tools and straggler cuts, reward stages, `eval_metric` |

Each rule's entry below says what it reads.
"""


# Codes no longer given, kept so `rldsl explain` can say why a code from an older output is gone.
RETIRED: dict[str, str] = {
    "RLP307": "a proximal policy the engine cannot recompute: retired once every training engine (torch, fsdp, "
              "megatron) recomputed it at the batch start, so `behaviour_cap` and `correction` work with any number "
              "of optimizer steps per rollout batch.",
}


def render_markdown() -> str:
    lines = ["# Rules", "",
             "Every finding of `rldsl check` has a code. `rldsl explain CODE` prints the entry.",
             "This page is generated from `rldsl/compiler/rules/catalog.py`.", "", DEPENDENCIES]
    for rule in RULES.values():
        lines += [f"## {rule.code}: {rule.summary}", "", f"Severity: {rule.severity}.", "", rule.explanation, "",
                  f"Reads: {rule.reads}", "",
                  "Example that triggers it:", "", "```", rule.example, "```", ""]
    lines += ["## Retired codes", ""] + [f"- {code}: {why}" for code, why in RETIRED.items()] + [""]
    return "\n".join(lines)


if __name__ == "__main__":
    print(render_markdown(), end="")
