"""`rldsl export`: a run's trained policy as a Hugging Face directory.

Each trainer engine takes a step and checkpoints into a run directory laid
out as `rldsl run` writes it (plan.json from `rldsl plan --out`); the export
loads with transformers' Auto classes and gives the trainer's logits (fp32,
atol 1e-5) and the run's tokenization:

- torch: builtin:tiny-lm (as GPT-2) and an hf: Llama;
- fsdp on two gloo ranks: both models, from the gathered full-state file;
- megatron on two gloo ranks, tp = 2 (untied Llama) and pp = 2 (tied):
  shards merged, q/k/v and gate/up un-fused, equal bit for bit to what the
  trainer's own gather (weight_buckets) sends to generators;
- bad input: one line, exit 2, no traceback;
- end to end: `rldsl run` with a checkpoint every step, then `rldsl export`.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rldsl.cli import main
from rldsl.models.tiny import build_tiny_lm
from rldsl.runtime.engines.torch.train import TorchTrainer
from tests.ports import spawn_ranks
from tests.test_split_step_gradient import make_batch
from tests.runs import rldsl_here
from tests.shared_runs import TORCH_STEPS

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore:FSDP2-wrapped module.*returned a view tensor")]
transformers = pytest.importorskip("transformers")
TEXTS = ["12+34=", "7*8=56", "hello world!", "a-b (c)/d_e"]
MEGATRON_PIPELINE = """
pipeline megatron_cpu
cluster {{ nodes = 1  gpus_per_node = 4 }}
model policy {{ source = "hf:{model}" }}
dataset prompts {{ source = "builtin:arith"  eval_size = 8 }}
stage generate rollout {{ model = policy  engine = torch  gpus = 1  samples_per_prompt = 4  max_new_tokens = 6 }}
stage reward score {{ fn = "rldsl.rewards:char_match" }}
stage train actor {{ model = policy  engine = megatron({parallel}, dtype = fp32, distributed_optimizer = false)
                     gpus = 2  prompts_per_step = 2  micro_batch = 4  loss = grpo(kl = 0)  lr = 1e-3 }}
stage sync weights {{ from = actor  to = rollout }}
flow prompts -> rollout -> score -> actor
staleness {{ max_lag = 1 }}
"""


# -- run directories as `rldsl run` leaves them ---------------------------------------------------


def pipeline_text(source: str = "builtin:tiny-lm", train_engine: str = "torch") -> str:
    text = (ROOT / "pipelines" / "grpo_async.rlp").read_text()
    text = text.replace('source = "builtin:tiny-lm"', f'source = "{source}"')
    return text.replace("  engine = torch\n  gpus = 1\n  prompts_per_step",
                        f"  engine = {train_engine}\n  gpus = 1\n  prompts_per_step")


def make_run_dir(run_dir: Path, pipeline: str) -> Path:
    """A run directory with the plan `rldsl plan --out` makes of ``pipeline``."""
    run_dir.mkdir(parents=True)
    (run_dir / "pipeline.rlp").write_text(pipeline)
    assert main(["plan", str(run_dir / "pipeline.rlp"), "--out", str(run_dir / "plan.json")]) == 0
    return run_dir


def trainer_dir(run_dir: Path, version: int) -> Path:
    return run_dir / "checkpoints" / f"v{version:06d}" / "trainer"


def mark_complete(run_dir: Path, version: int, engine: str, ranks: int = 1) -> None:
    """What the trainer's rank 0 and the controller write after the engine's files."""
    directory = run_dir / "checkpoints" / f"v{version:06d}"
    (directory / "trainer").mkdir(parents=True, exist_ok=True)
    (directory / "trainer.json").write_text(json.dumps({"version": version, "engine": engine, "ranks": ranks}))
    (directory / "progress.json").write_text(json.dumps({"steps_done": version}))


def with_trained_scale(model, seed: int = 5):
    """Weights of the size training leaves (logits of tens, not of a fresh
    init's ~1), so that a near miss in the mapping (tanh GELU for erf, a
    missing bias, a layer-norm epsilon) shows in the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.module.parameters():
            parameter.add_(0.3 * torch.randn(parameter.shape, generator=gen))
    return model


def trained_run(run_dir: Path, pipeline: str, model) -> Path:
    """A torch-engine run of ``model`` checkpointed after one step."""
    trainer = TorchTrainer(model, lr=1e-2)
    one_step(trainer, make_batch(model))
    make_run_dir(run_dir, pipeline)
    trainer.save_checkpoint(trainer_dir(run_dir, 1))
    mark_complete(run_dir, 1, "torch")
    return run_dir


def one_step(trainer, batch, rows=None) -> None:
    trainer.begin_train_step(0)
    trainer.train_microbatch(0, batch if rows is None else {k: v[rows[0]:rows[1]] for k, v in batch.items()})
    assert trainer.finish_train_step(0).version == 1


def export(run_dir: Path, out: Path, *flags: str) -> int:
    return main(["export", str(run_dir), "--out", str(out), *flags])


# -- comparing -----------------------------------------------------------------------------------


def token_rows(tokenizer) -> torch.Tensor:
    """The run's encoding of TEXTS (BOS first, as prompts are), cut to one length."""
    rows = [tokenizer.encode(text, add_bos=True) for text in TEXTS]
    width = min(len(row) for row in rows)
    return torch.tensor([row[:width] for row in rows])


def rldsl_logits(model, ids: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        logits, _ = model.forward(ids, torch.ones_like(ids), positions, use_cache=False)
    return logits.float()


def assert_same_logits(out: Path, ids: torch.Tensor, expected: torch.Tensor) -> None:
    with torch.no_grad():
        actual = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)(ids).logits.float()
    assert actual.shape == expected.shape
    assert torch.allclose(actual, expected, atol=1e-5, rtol=0), float((actual - expected).abs().max())


def assert_tokenizes_like(out: Path, tokenizer) -> None:
    exported = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert exported(text, add_special_tokens=False)["input_ids"] == ids
        assert exported.decode(ids, skip_special_tokens=True) == tokenizer.decode(ids)


def hf_llama(path: Path, **config) -> Path:
    """A tiny local Llama (tests/hf_tiny.py) with weights of trained size."""
    from tests.hf_tiny import save_char_llama

    save_char_llama(path, seed=1, **config)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    with_trained_scale(SimpleNamespace(module=model))
    model.save_pretrained(path)
    return path


# -- torch ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A torch-engine run of builtin:tiny-lm checkpointed after one step; and its model."""
    model = with_trained_scale(build_tiny_lm(seed=0))
    return trained_run(tmp_path_factory.mktemp("tiny") / "run", pipeline_text(), model), model


def test_torch_builtin_tiny_exports_as_an_equivalent_gpt2(tiny_run, tmp_path, capsys):
    from rldsl.runtime.export import export_run

    run_dir, model = tiny_run
    assert export(run_dir, tmp_path / "hf") == 0
    assert "GPT2LMHeadModel" in capsys.readouterr().out
    files = {path.name for path in (tmp_path / "hf").iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= files
    ids = token_rows(model.tokenizer)
    assert_same_logits(tmp_path / "hf", ids, rldsl_logits(model, ids))
    fresh = with_trained_scale(build_tiny_lm(seed=0))
    assert not torch.allclose(rldsl_logits(fresh, ids), rldsl_logits(model, ids), atol=1e-3)  # it trained
    assert_tokenizes_like(tmp_path / "hf", model.tokenizer)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tokenizer("1+1=")["input_ids"] == model.tokenizer.encode("1+1=", add_bos=True)  # BOS, as prompts
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["activation_function"] == "gelu" and config["tie_word_embeddings"]
    export_run(run_dir, tmp_path / "sharded", max_shard_size="100KB")  # a large model: shards and an index
    assert len(list((tmp_path / "sharded").glob("model-*-of-*.safetensors"))) >= 2
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert_same_logits(tmp_path / "sharded", ids, rldsl_logits(model, ids))


def test_torch_builtin_agent_exports_with_its_vocabulary_and_context(tmp_path):
    """builtin:tiny-agent: the same mapping, with the characters of its tool calls and its 128 positions."""
    from rldsl.models import BUILTIN_AGENT, load_model

    model = with_trained_scale(load_model(BUILTIN_AGENT))
    run_dir = trained_run(tmp_path / "run", pipeline_text(BUILTIN_AGENT), model)
    assert export(run_dir, tmp_path / "hf") == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["vocab_size"], config["n_positions"]) == (model.config["vocab_size"], 128)
    ids = torch.tensor([model.tokenizer.encode("12+19=[calculate(expression='12+19')]", add_bos=True)])
    assert_same_logits(tmp_path / "hf", ids, rldsl_logits(model, ids))
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    call = "[calculate(expression='12+19')]{}<>\""
    assert exported(call, add_special_tokens=False)["input_ids"] == model.tokenizer.encode(call)


def test_torch_hf_llama_keeps_its_config_and_tokenizer(tmp_path):
    from rldsl.models import load_model

    source = hf_llama(tmp_path / "source", tie_word_embeddings=True)
    model = load_model(f"hf:{source}")
    run_dir = trained_run(tmp_path / "run", pipeline_text(f"hf:{source}"), model)
    assert export(run_dir, tmp_path / "hf", "--version", "1") == 0
    ids = token_rows(model.tokenizer)
    assert_same_logits(tmp_path / "hf", ids, rldsl_logits(model, ids))
    assert_tokenizes_like(tmp_path / "hf", model.tokenizer)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "hf" / name).read_bytes() == (source / name).read_bytes(), name
    mine, theirs = (json.loads((d / "config.json").read_text()) for d in (tmp_path / "hf", source))
    assert {k: v for k, v in mine.items() if k != "dtype"} == {k: v for k, v in theirs.items() if k != "dtype"}


# -- fsdp: two ranks over gloo ---------------------------------------------------------------------


def on_two_ranks(worker, runs: dict) -> dict:
    """``worker(rank, port, runs, results)`` in two processes; the results they share."""
    return spawn_ranks(worker, runs)


def _fsdp_worker(rank: int, port: int, runs: dict, results: dict):
    import torch.distributed as dist

    from rldsl.models import load_model
    from rldsl.runtime.engines.fsdp import FsdpTrainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        for kind, (source, run_dir) in runs.items():
            model = with_trained_scale(build_tiny_lm(seed=0)) if source == "builtin:tiny-lm" else load_model(source)
            batch = make_batch(model)
            trainer = FsdpTrainer(model, lr=1e-2)
            one_step(trainer, batch, rows=(0, 6) if rank == 0 else (6, 10))
            trainer.save_checkpoint(trainer_dir(Path(run_dir), 1))
            logits = rldsl_logits(trainer.model, token_rows(model.tokenizer))  # a collective: every rank
            if rank == 0:
                results[kind] = logits
    finally:
        dist.destroy_process_group()


def test_fsdp_two_ranks_export_from_their_shards(tmp_path):
    from rldsl.models import CharTokenizer, load_tokenizer

    source = hf_llama(tmp_path / "source")
    runs = {"tiny": ("builtin:tiny-lm", tmp_path / "tiny"), "llama": (f"hf:{source}", tmp_path / "llama")}
    for source_name, run_dir in runs.values():
        make_run_dir(run_dir, pipeline_text(source_name, "fsdp"))
    results = on_two_ranks(_fsdp_worker, {kind: (name, str(path)) for kind, (name, path) in runs.items()})
    for kind, (source_name, run_dir) in runs.items():
        mark_complete(run_dir, 1, "fsdp", ranks=2)
        assert export(run_dir, tmp_path / f"{kind}-hf") == 0
        tokenizer = CharTokenizer() if kind == "tiny" else load_tokenizer(source_name)
        assert_same_logits(tmp_path / f"{kind}-hf", token_rows(tokenizer), results[kind])
        assert_tokenizes_like(tmp_path / f"{kind}-hf", tokenizer)
    # the same checkpoint of a bf16 trainer (`fsdp(dtype = bf16)`): exported in bf16, the dtype its forwards used
    plan = json.loads((runs["tiny"][1] / "plan.json").read_text())
    next(s for s in plan["pipelines"][0]["stages"] if s["kind"] == "train")["engine"]["args"]["dtype"] = "bf16"
    (runs["tiny"][1] / "plan.json").write_text(json.dumps(plan))
    assert export(runs["tiny"][1], tmp_path / "bf16-hf") == 0
    assert json.loads((tmp_path / "bf16-hf" / "config.json").read_text())["dtype"] == "bfloat16"
    fp32, bf16 = (sum(f.stat().st_size for f in (tmp_path / d).glob("*.safetensors")) for d in ("tiny-hf", "bf16-hf"))
    assert bf16 < 0.55 * fp32


# -- megatron: tp = 2 and pp = 2 on two ranks over gloo -------------------------------------------------

MEGATRON_LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2)}


def megatron_logits(trainer, ids: torch.Tensor) -> torch.Tensor | None:
    """Full-vocabulary logits of the trainer's model on the last pipeline stage
    (activations passed stage to stage, vocabulary shards gathered); None elsewhere."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from rldsl.runtime.engines.megatron.rows import causal_mask

    module = trainer.model.module
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        if not ps.is_pipeline_first_stage():
            hidden = torch.empty(ids.shape[1], ids.shape[0], trainer.shape.hidden_size)
            dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
            module.set_input_tensor(hidden)
        out = module(ids, positions, attention_mask=causal_mask(ids.shape[1], ids.device))
        if not ps.is_pipeline_last_stage():
            dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            return None
        shards = [torch.empty_like(out) for _ in range(ps.get_tensor_model_parallel_world_size())]
        dist.all_gather(shards, out.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(shards, dim=-1)


def _megatron_worker(rank: int, port: int, runs: dict, results: dict):
    import torch.distributed as dist
    from megatron.core import parallel_state

    from rldsl.models import load_tokenizer
    from rldsl.runtime.engines.megatron import model as mm
    from rldsl.runtime.engines.megatron.cpu_compat import megatron_on_cpu
    from rldsl.runtime.engines.megatron.trainer import MegatronTrainer
    from tests.test_megatron_engine import make_batch as megatron_batch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        with megatron_on_cpu():
            for kind, (source, run_dir) in runs.items():
                tp, pp = MEGATRON_LAYOUTS[kind]
                mm.ensure_model_parallel(tp, pp, seed=0)
                trainer = MegatronTrainer.from_pretrained(source, tp=tp, pp=pp, dtype="fp32", lr=1e-2,
                                                          distributed_optimizer=False)
                one_step(trainer, megatron_batch(trainer.shape))
                trainer.save_checkpoint(trainer_dir(Path(run_dir), 1))
                gathered = {n: t for bucket in trainer.weight_buckets(1 << 20) for n, t in bucket.items()}
                logits = megatron_logits(trainer, token_rows(load_tokenizer(f"hf:{source}")))
                results[(kind, rank)] = (gathered, logits)
                parallel_state.destroy_model_parallel()
    finally:
        dist.destroy_process_group()


@pytest.mark.megatron
def test_megatron_tp2_and_pp2_shards_merge_back_to_hf(tmp_path):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from safetensors.torch import load_file

    from rldsl.models import load_tokenizer

    sources = {"tp2": hf_llama(tmp_path / "untied", vocab_multiple=2),
               "pp2": hf_llama(tmp_path / "tied", vocab_multiple=2, tie_word_embeddings=True)}
    runs = {kind: (str(source), str(make_run_dir(tmp_path / f"run-{kind}", MEGATRON_PIPELINE.format(
        model=source, parallel=f"{kind[:2]} = 2")))) for kind, source in sources.items()}
    results = on_two_ranks(_megatron_worker, runs)
    for kind, (source, run_dir) in runs.items():
        mark_complete(Path(run_dir), 1, "megatron", ranks=2)
        out = tmp_path / f"{kind}-hf"
        assert export(Path(run_dir), out) == 0
        gathered, _ = results[(kind, 0)]  # rank 0 yields the trainer's own gather
        written = load_file(str(out / "model.safetensors"))
        assert written.keys() == gathered.keys(), kind
        assert all(torch.equal(written[n], gathered[n]) for n in gathered), kind
        _, logits = results[(kind, 1)] if kind == "pp2" else results[(kind, 0)]  # the last stage has them
        tokenizer = load_tokenizer(f"hf:{source}")
        assert_same_logits(out, token_rows(tokenizer), logits)
        assert_tokenizes_like(out, tokenizer)


# -- bad input -----------------------------------------------------------------------------------------


def export_error(capsys, run_dir: Path, out: Path, *flags: str) -> str:
    assert export(run_dir, out, *flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err, err
    return err


def test_not_a_run_directory_no_complete_checkpoint_an_unknown_version(tiny_run, tmp_path, capsys):
    assert "is not a run directory" in export_error(capsys, tmp_path, tmp_path / "hf")
    assert "is not a run directory" in export_error(capsys, tmp_path / "nope", tmp_path / "hf")
    bare = make_run_dir(tmp_path / "bare", pipeline_text())
    assert "no complete checkpoint" in export_error(capsys, bare, tmp_path / "hf")
    half = trainer_dir(bare, 3).parent
    half.mkdir(parents=True)
    (half / "trainer.json").write_text("{}")  # the controller never recorded the step
    assert "no complete checkpoint" in export_error(capsys, bare, tmp_path / "hf")
    run_dir, _ = tiny_run
    err = export_error(capsys, run_dir, tmp_path / "hf", "--version", "7")
    assert "no complete checkpoint at version 7" in err and "complete checkpoints: 1" in err


def test_an_existing_output_is_kept_unless_forced(tiny_run, tmp_path, capsys):
    run_dir, _ = tiny_run
    out = tmp_path / "hf"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    assert "exists and is not empty" in export_error(capsys, run_dir, out)
    assert (out / "precious.txt").exists()
    assert export(run_dir, out, "--force") == 0
    assert not (out / "precious.txt").exists() and (out / "model.safetensors").exists()
    assert "the run directory" in export_error(capsys, run_dir, run_dir, "--force")
    (tmp_path / "file").write_text("")
    assert "not a directory" in export_error(capsys, run_dir, tmp_path / "file")


def test_a_damaged_checkpoint_a_sim_trainer_and_a_missing_model_directory(tiny_run, tmp_path, capsys):
    damaged = make_run_dir(tmp_path / "damaged", pipeline_text())
    mark_complete(damaged, 1, "torch")
    (trainer_dir(damaged, 1) / "torch.pt").write_bytes(b"not a checkpoint")
    assert "cannot read" in export_error(capsys, damaged, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    sim = make_run_dir(tmp_path / "sim", (ROOT / "pipelines" / "sim_async.rlp").read_text())
    mark_complete(sim, 1, "sim")
    assert "keeps no model weights" in export_error(capsys, sim, tmp_path / "hf")
    source = hf_llama(tmp_path / "gone")
    run_dir = make_run_dir(tmp_path / "hf-run", pipeline_text(f"hf:{source}"))
    mark_complete(run_dir, 1, "torch")
    (source / "config.json").unlink()
    assert "is gone" in export_error(capsys, run_dir, tmp_path / "hf")


# -- end to end ----------------------------------------------------------------------------------------


@pytest.mark.ray
def test_a_real_run_exports_its_last_checkpoint(torch_run, tmp_path):
    from rldsl.runtime.engines.torch.train import CHECKPOINT_FILE

    run_dir, out = torch_run.run_dir, tmp_path / "hf"
    exported = rldsl_here("export", str(run_dir), "--out", str(out))
    assert exported.returncode == 0, exported.stderr[-4000:]
    assert TORCH_STEPS == 2 and "exported v000002" in exported.stdout
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in out.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"], modes  # shareable like the rest
    model = build_tiny_lm(seed=0)
    saved = torch.load(trainer_dir(run_dir, 2) / CHECKPOINT_FILE, map_location="cpu", weights_only=True)
    model.module.load_state_dict(saved["model"])
    ids = token_rows(model.tokenizer)
    assert_same_logits(out, ids, rldsl_logits(model, ids))
    assert_tokenizes_like(out, model.tokenizer)
