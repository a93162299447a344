"""Every rule: a stable code, a severity, a one-line summary and an
explanation with an example. `rldsl explain CODE` prints an entry;
docs/rules.md is generated from this table (`python -m rldsl.compiler.rules.catalog`)."""

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


def _r(code, severity, summary, explanation, example):
    return Rule(code, severity, summary, explanation.strip(), example.strip("\n"))


RULES: dict[str, Rule] = {r.code: r for r in [
    _r("RLP001", ERROR, "syntax error",
       "The file does not follow the grammar: a missing `=`, an unclosed `{` or string, a stray character.",
       "stage train actor {\n  prompts_per_step 8\n}"),
    _r("RLP002", ERROR, "nesting too deep",
       "Lists, calls and blocks nest at most 32 levels. No pipeline needs more; the bound keeps `check` from "
       "recursing without end on a damaged or generated file.",
       "stage train actor { model = policy  prompts_per_step = " + "[" * 33 + "1" + "]" * 33 + " }"),
    _r("RLP101", ERROR, "unknown name",
       "A reference (a model, a stage, a dataset in a flow) names nothing declared in this pipeline. "
       "The help suggests the closest declared name.",
       "stage generate rollout { model = polcy  samples_per_prompt = 4 }"),
    _r("RLP102", ERROR, "duplicate declaration or key",
       "Models, datasets and stages share one namespace per pipeline; a key may be set once per block.",
       "model policy { source = \"builtin:tiny-lm\" }\nmodel policy { source = \"builtin:tiny-lm\" }"),
    _r("RLP103", ERROR, "unknown block, stage kind, key, engine or argument",
       "Something is spelt in a way the language does not know. The help suggests the closest known word.",
       "stage generate rollout { model = policy  samples_per_promt = 4 }"),
    _r("RLP104", ERROR, "wrong type or malformed value",
       "A value has the wrong shape: a string where a number is expected, a name that should be quoted, "
       "a malformed block head.",
       "stage generate rollout { model = policy  samples_per_prompt = \"four\" }"),
    _r("RLP105", ERROR, "missing or unknown unit",
       "Sizes, durations and counts carry units (`256MiB`, `30s`, `7B`); a bare number is ambiguous there.",
       "stage sync weights { from = actor  to = rollout  bucket = 256 }"),
    _r("RLP106", ERROR, "value out of range",
       "A number outside what the key accepts (a negative count, a fraction above 100%).",
       "stage generate rollout { model = policy  samples_per_prompt = 0 }"),
    _r("RLP107", ERROR, "missing required key or declaration",
       "A block lacks a key it cannot do without, or the file lacks a pipeline or a cluster.",
       "stage train actor { model = policy }"),
    _r("RLP108", ERROR, "engine cannot run this stage",
       "Each engine serves some stage kinds (vLLM generates and scores, megatron trains and scores), "
       "GPU engines need GPUs, and megatron runs logprob stages without pipeline parallelism (pp = 1).",
       "stage train actor { model = policy  engine = vllm(tp = 1)  prompts_per_step = 2 }"),
    _r("RLP201", ERROR, "dataflow cycle",
       "Data edges (`flow`) must form a DAG; the cycle is named. Weight edges (`sync`) close the RL loop and "
       "are not part of this check.",
       "flow prompts -> rollout -> score -> rollout"),
    _r("RLP202", WARNING, "orphan stage",
       "A stage that appears in no flow never receives data; it would start actors that do nothing.",
       "stage reward unused { fn = \"rldsl.rewards:exact_match\" }   # and no flow mentions it"),
    _r("RLP203", ERROR, "unreachable stage",
       "A stage in a flow that no dataset reaches: nothing would ever feed it.",
       "flow score -> actor   # score is fed by nothing"),
    _r("RLP204", ERROR, "consumed field without a producer",
       "Fields type the dataflow: generation writes responses (and behaviour logprobs unless `logprobs = false`), "
       "rewards write `reward`, a frozen logprob stage writes `ref_logprobs`, a policy logprob stage "
       "`behaviour_logprobs`. A KL term needs reference logprobs upstream of the trainer; max_lag > 0 needs "
       "behaviour logprobs for the importance ratio.",
       "stage train actor { ... loss = grpo(kl = 0.01) }   # with no frozen logprob stage upstream"),
    _r("RLP205", ERROR, "trained model's generator receives no sync",
       "A generate stage of a model that a train stage updates must receive the new weights through a `sync` "
       "stage; otherwise it samples from the initial weights forever and the lag grows without bound.",
       "stage train actor { model = policy ... }   # and no `stage sync ... { from = actor to = rollout }`"),
    _r("RLP206", ERROR, "invalid sync",
       "A sync goes from a train stage to generate (or policy logprob) stages of the same model.",
       "stage sync weights { from = rollout  to = actor }"),
    _r("RLP207", ERROR, "invalid flow edge",
       "Data flows dataset -> generate -> (reward | logprob)* -> train. A train stage produces weights, not data; "
       "a dataset feeds generation only.",
       "flow prompts -> actor"),
    _r("RLP208", ERROR, "incomplete pipeline",
       "A pipeline needs a dataset, a generate stage, a reward stage and one train stage.",
       "pipeline p   # with stages but no train stage"),
    _r("RLP301", ERROR, "prompts_per_step x samples_per_prompt != global_batch",
       "One optimizer step trains prompts_per_step groups of samples_per_prompt samples; global_batch must "
       "equal that product (or be left out and derived).",
       "prompts_per_step = 8  global_batch = 60   # with samples_per_prompt = 8"),
    _r("RLP302", ERROR, "global_batch not divisible by micro_batch x data-parallel size",
       "Every data-parallel rank runs whole microbatches; global_batch must split evenly into "
       "micro_batch x dp pieces.",
       "global_batch = 64  micro_batch = 6   # dp = 2"),
    _r("RLP303", ERROR, "GRPO with fewer than 2 samples per prompt",
       "GRPO normalises rewards within a prompt group; with one sample every advantage is zero and nothing "
       "is learned.",
       "samples_per_prompt = 1"),
    _r("RLP304", ERROR, "buffer too small: the rollout pump deadlocks",
       "The trainer needs prompts_per_step ready groups before it can finish a step, and consumed groups stay "
       "stored until the step's single clear. A buffer holding fewer groups fills up, the rollout pump waits "
       "for space and the trainer waits for groups: a deadlock. The diagnostic prints the numbers.",
       "buffer { capacity = 4 }   # with prompts_per_step = 8"),
    _r("RLP305", WARNING, "in-flight limit below one step's prompts",
       "With max_inflight < prompts_per_step a step's groups are generated in several waves; generation "
       "cannot keep up with training. Not a deadlock, a slowdown; or max_inflight above the buffer capacity, "
       "which can never be reached.",
       "buffer { max_inflight = 2 }   # with prompts_per_step = 8"),
    _r("RLP306", WARNING, "buffer smaller than the staleness window",
       "With max_lag = L generation may run L steps ahead of training, which needs room for "
       "prompts_per_step x (L + 1) groups. A smaller buffer is safe but caps the overlap.",
       "buffer { capacity = 8 }   # with prompts_per_step = 8 and max_lag = 1"),
    _r("RLP401", WARNING, "on-policy with disjoint generate and train GPUs",
       "With max_lag = 0 generation of step t+1 must wait for the weights of step t, so on separate GPUs each "
       "side idles while the other works. Allow max_lag = 1 or colocate the stages.",
       "staleness { max_lag = 0 }   # rollout on GPUs 0-1, actor on GPUs 2-3"),
    _r("RLP501", ERROR, "GPUs over-subscribed",
       "The stages ask for more GPUs than the cluster has, or name GPU ids beyond it. Colocate stages, shrink "
       "them or grow the cluster.",
       "cluster { gpus_per_node = 4 }   # rollout gpus = 4 and actor gpus = 2"),
    _r("RLP502", ERROR, "tp x pp x dp does not match the stage's GPUs",
       "A stage's GPUs split into data-parallel replicas of tp x pp GPUs each; the count must divide evenly.",
       "engine = megatron(tp = 2, pp = 2)  gpus = 6"),
    _r("RLP503", ERROR, "tensor parallelism crosses a node",
       "Tensor-parallel ranks exchange activations every layer and must share a node's fast interconnect.",
       "engine = vllm(tp = 16)   # with gpus_per_node = 8"),
    _r("RLP504", ERROR, "colocated stage cannot sleep or offload",
       "Stages sharing GPUs take turns: each must release its memory (vLLM sleep, trainer offload) while the "
       "other runs. An engine with sleep/offload disabled cannot share.",
       "engine = vllm(sleep = false)  colocate = actor"),
    _r("RLP505", ERROR, "invalid partial overlap",
       "A partial overlap (a train stage on some of a generate stage's GPUs) is valid when the train GPUs lie "
       "inside the generate GPUs, each generation replica lies wholly inside or wholly outside them, and at "
       "least one replica stays outside so generation continues during training.",
       "rollout gpus = 0..3 with vllm(tp = 2); actor gpus = 1..2"),
    _r("RLP506", ERROR, "estimated memory above GPU memory",
       "With `gpu_memory` declared, the plan estimates each GPU's memory: training weights + gradients + "
       "AdamW state (18 bytes per parameter in bf16, 16 in fp32, / (tp x pp)), other weights (their dtype's "
       "bytes per parameter), vLLM's reserved share; sim engines count nothing. Colocated stages that sleep count as their maximum, others as their sum.",
       "cluster { gpu_memory = 24GiB }   # training a 7B model on one GPU"),
    _r("RLP507", ERROR, "invalid placement groups",
       "`placement { groups, ratios }` splits the cluster's GPUs: one ratio per group, ratios summing to 100%, "
       "each share a whole number of GPUs, each stage in at most one group.",
       "placement { groups = [[actor, reference], rollout]  ratios = [50%, 40%] }"),
    _r("RLP508", ERROR, "invalid colocation",
       "`colocate = X` shares X's GPUs: X must be a GPU stage other than this one, itself placed, and the "
       "stage must not also give `gpus`.",
       "stage logprob reference { model = policy  colocate = score }"),
]}


def render_markdown() -> str:
    lines = ["# Rules", "",
             "Every finding of `rldsl check` has a code. `rldsl explain CODE` prints the entry.",
             "This page is generated from `rldsl/compiler/rules/catalog.py`.", ""]
    for rule in RULES.values():
        lines += [f"## {rule.code}: {rule.summary}", "", f"Severity: {rule.severity}.", "", rule.explanation, "",
                  "Example that triggers it:", "", "```", rule.example, "```", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    print(render_markdown(), end="")
