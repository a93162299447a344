"""The pipelines translated from other frameworks (pipelines/from_*.rlp,
described in docs/migrating.md) check clean with --strict and place as the
framework they come from does."""

import subprocess
import sys
from pathlib import Path

import pytest

from rldsl.compiler.driver import compile_file

ROOT = Path(__file__).resolve().parent.parent
MIGRATED = sorted((ROOT / "pipelines").glob("from_*.rlp"))
FRAMEWORKS = ("verl", "nemo_rl", "areal", "roll", "openrlhf")


def _compiled(name: str):
    result = compile_file(ROOT / "pipelines" / name)
    assert result.diagnostics == [], [f"{d.code}: {d.message}" for d in result.diagnostics]
    assert result.plan is not None
    return result


def _placed(result, stage: str):
    placed = result.placement.of(result.program.pipelines[0].name, stage)
    assert placed is not None, stage
    return placed


def _gpus(result, stage: str) -> list[int]:
    """The global GPU ids a stage is placed on."""
    return sorted(_placed(result, stage).gpus)


def _shape(result, stage: str) -> tuple[int, int, int]:
    placed = _placed(result, stage)
    return placed.tp, placed.pp, placed.dp


def _engine(result, stage: str) -> tuple[str, dict]:
    """The engine a stage runs on: its name and its arguments, defaults filled in."""
    engine = result.program.pipelines[0].stages[stage]["engine"]
    return engine.name, engine.args


def test_one_translation_per_framework():
    stems = [path.stem for path in MIGRATED]
    for framework in FRAMEWORKS:
        assert any(stem.startswith(f"from_{framework}_") for stem in stems), framework


@pytest.mark.parametrize("path", MIGRATED, ids=lambda p: p.stem)
def test_checks_clean_and_plans(path):
    result = compile_file(path)
    assert result.diagnostics == [], [f"{d.code}: {d.message}" for d in result.diagnostics]
    assert result.plan is not None


@pytest.mark.parametrize("path", MIGRATED, ids=lambda p: p.stem)
def test_strict_check_on_the_command_line(path):
    done = subprocess.run([sys.executable, "-m", "rldsl", "check", "--strict", str(path)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("path", MIGRATED, ids=lambda p: p.stem)
def test_header_names_the_source(path):
    header = path.read_text().split("\npipeline ")[0]
    assert "Source: github.com/" in header and "at commit" in header, path.name


def test_verl_one_step_off_places_2_rollout_and_6_trainer_gpus():
    result = _compiled("from_verl_grpo_gsm8k.rlp")
    assert _gpus(result, "rollout") == [0, 1]
    assert _gpus(result, "actor") == _gpus(result, "reference") == [2, 3, 4, 5, 6, 7]
    assert _shape(result, "rollout") == (2, 1, 1)        # one vLLM engine, tp 2
    assert _shape(result, "actor") == (1, 1, 6)
    # actor.strategy fsdp2: sharded over all 6 ranks, fp32 master weights, bf16 compute, resident
    # (param_offload = optimizer_offload = False)
    assert _engine(result, "actor") == ("fsdp", {"shard": 0, "offload": False, "dtype": "bf16"})
    # ref strategy fsdp2: sharded over the same 6 ranks, bf16 compute, ref.param_offload = True
    assert _engine(result, "reference") == ("fsdp", {"shard": 0, "offload": True, "dtype": "bf16"})
    assert _engine(result, "rollout")[0] == "vllm"


def test_nemo_rl_trains_on_node_0_and_generates_on_node_1():
    result = _compiled("from_nemo_rl_grpo_llama8b_async.rlp")
    assert _gpus(result, "actor") == _gpus(result, "reference") == list(range(8))
    assert _gpus(result, "rollout") == list(range(8, 16))
    assert _shape(result, "rollout") == (1, 1, 8)
    assert _shape(result, "actor") == (1, 1, 8)
    assert _engine(result, "actor")[0] == _engine(result, "reference")[0] == "megatron"
    assert _engine(result, "rollout")[0] == "vllm"


def test_areal_splits_the_node_in_half_without_a_reference():
    result = _compiled("from_areal_gsm8k_grpo_megatron.rlp")
    assert _gpus(result, "actor") == [0, 1, 2, 3]        # created first by the local scheduler
    assert _gpus(result, "rollout") == [4, 5, 6, 7]
    assert "reference" not in result.program.pipelines[0].stages
    assert _shape(result, "rollout") == _shape(result, "actor") == (1, 1, 4)   # d4p1t1 each
    name, args = _engine(result, "rollout")                # sglang:d4p1t1
    assert name == "sglang"
    assert (args["tp"], args["gpu_memory"], args["max_model_len"]) == (1, 0.8, 32768)
    assert args["sleep"] in (False, 0)                     # enable_offload = false
    assert _engine(result, "actor")[0] == "megatron"


def test_roll_device_mapping():
    result = _compiled("from_roll_rlvr_qwen7b_async.rlp")
    for stage in ("actor", "reference", "behaviour"):
        assert _gpus(result, stage) == list(range(16)), stage
    assert _gpus(result, "rollout") == list(range(16, 24))
    assert _shape(result, "actor") == (2, 1, 8)
    assert _shape(result, "reference") == (1, 1, 16)
    assert _shape(result, "rollout") == (1, 1, 8)          # one SGLang engine per GPU
    name, args = _engine(result, "rollout")                # actor_infer strategy_name sglang
    assert name == "sglang"
    assert (args["tp"], args["gpu_memory"], args["max_model_len"], args["dtype"]) == (1, 0.85, 10240, "fp16")
    assert args["sleep"] in (False, 0)                     # the async pipeline never offloads actor_infer


def test_openrlhf_colocates_everything_on_8_gpus():
    result = _compiled("from_openrlhf_grpo_dapo_hybrid.rlp")
    for stage in ("actor", "reference", "behaviour", "rollout"):
        assert _gpus(result, stage) == list(range(8)), stage
    assert _shape(result, "rollout") == (1, 1, 8)  # 4 tp-2 engines there; 8 tp-1 replicas here (RLP512)
    assert _shape(result, "actor") == (1, 1, 8)
    # --ds.zero_stage 3: parameters, gradients and Adam state sharded over all 8 ranks
    assert _engine(result, "actor") == ("fsdp", {"shard": 0, "offload": True, "dtype": "bf16"})
    for stage in ("reference", "behaviour"):  # ZeRO-3 forwards: sharded over the 8 ranks
        assert _engine(result, stage) == ("fsdp", {"shard": 0, "offload": True, "dtype": "bf16"}), stage
