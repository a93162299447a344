"""Multi-turn environments: the episode loop in token space, the loss mask,
killable environment processes (rldsl.runtime.environments)."""

import textwrap
from pathlib import Path

import pytest
import torch

from rldsl.environments import ArithRetry, episode_reward
from rldsl.models import load_model
from rldsl.runtime import protocols as p
from rldsl.runtime.engines.batching import ContinuousBatcher
from rldsl.runtime.engines.policy_loss import PolicyLossConfig, policy_loss
from rldsl.runtime.engines.torch.common import response_logprobs
from rldsl.runtime.engines.torch.generate import TorchGenerator
from rldsl.runtime.engines.torch.train import TorchTrainer
from rldsl.runtime.engines.torch.warmstart import load_warm_started
from rldsl.runtime.environments import DROP_REASONS, EpisodeStatus, episode_rewards
from rldsl.runtime.environments.conversation import ChatTemplateTurns, TranscriptTurns
from rldsl.runtime.environments.episodes import EpisodeRunner
from rldsl.runtime.environments.host import CallFailure, EnvironmentHost
from rldsl.runtime.environments.protocol import EnvironmentLoadError


@pytest.fixture(scope="module")
def model():
    return load_model("builtin:tiny-lm", seed=0)


@pytest.fixture
def arith_host():
    host = EnvironmentHost("rldsl.environments:ArithRetry", 10.0, 2)
    yield host
    host.close()


def _runner(model, host, turns=None, max_turns=3, max_tokens=40, max_new_tokens=4):
    return EpisodeRunner(ContinuousBatcher(TorchGenerator(model, max_new_tokens=max_new_tokens)), host,
                         turns or TranscriptTurns(model.tokenizer), model.tokenizer, max_turns, max_tokens)


def test_arith_retry_hints_and_halves_the_reward():
    env = ArithRetry()
    assert env.reset("12+19=", "31") == [{"role": "user", "content": "12+19="}]
    assert env.step([], "21") == (" up 12+19=", 0.0, False)
    assert env.step([], "x") == (" no 12+19=", 0.0, False)
    assert env.step([], "31") == ("", 0.25, True)
    with pytest.raises(TypeError, match="read from the episode"):
        episode_reward("31", "31")


def test_a_response_is_the_turns_with_the_environment_tokens_masked(arith_host):
    """The warm-started builtin model, which ends its answers with EOS."""
    model = load_warm_started("builtin:arith")
    batch, failures = _runner(model, arith_host, max_tokens=64).run([p.Prompt(0, "12+19=", "99999")], 6, seed=1)
    tokenizer = model.tokenizer
    assert not failures  # nothing is re-encoded, so no conversation can fail to round-trip
    ended_turns = 0
    for row in range(6):
        mask, trained = batch[p.FIELD_RESPONSE_MASK][row].bool(), batch[p.FIELD_LOSS_MASK][row].bool()
        ids = batch[p.FIELD_RESPONSE_IDS][row]
        # an answer that is never right: every turn is taken, and each hint is the environment's
        assert int(batch[p.FIELD_TURNS][row]) == 3 and float(batch[p.FIELD_EPISODE_REWARD][row]) == 0.0
        observed = tokenizer.decode(ids[mask & ~trained].tolist())
        assert observed.count("12+19=") == 2 and observed.startswith(" ")
        # the trainer reads the conversation the model read: prompt, then model and environment tokens in turn
        prompt = tokenizer.decode(batch[p.FIELD_PROMPT_IDS][row][batch[p.FIELD_PROMPT_MASK][row].bool()].tolist())
        assert prompt == "12+19="
        assert (batch[p.FIELD_BEHAVIOUR_LOGPROBS][row][mask & ~trained] == 0).all()
        # a turn's end-of-sequence token, which no text can carry, stays as sampled and is the model's to learn
        eos = mask & (ids == tokenizer.eos_id)
        assert trained[eos].all()
        ended_turns += int(eos.sum())
    assert ended_turns > 6  # turns before the last ended with EOS too: it stays between them
    # the behaviour logprobs of the model's tokens are the trainer's over the whole conversation
    with torch.no_grad():
        recomputed = response_logprobs(model, batch)
    on_model_tokens = p.trained_tokens(batch).bool()
    assert torch.allclose(recomputed[on_model_tokens], batch[p.FIELD_BEHAVIOUR_LOGPROBS][on_model_tokens], atol=1e-4)


def test_a_right_answer_ends_the_episode_with_its_reward(model):
    host = EnvironmentHost("always_right:Right@{}".format(_module_dir("always_right", """
        class Right:
            def reset(self, prompt, answer):
                return [{"role": "user", "content": prompt}]
            def step(self, messages, completion):
                return "", 0.75, True
    """)), 10.0, 1)
    try:
        batch, failures = _runner(model, host).run([p.Prompt(0, "1+1=", "2")], 3, seed=0)
    finally:
        host.close()
    assert not failures
    assert batch[p.FIELD_TURNS].tolist() == [1, 1, 1]
    assert batch[p.FIELD_EPISODE_REWARD].tolist() == [0.75] * 3
    assert batch[p.FIELD_CONTEXT_FULL].tolist() == [0, 0, 0]
    assert torch.equal(batch[p.FIELD_LOSS_MASK], batch[p.FIELD_RESPONSE_MASK])  # one turn: every token the model's


def test_environment_tokens_get_zero_gradient(model):
    """The loss's gradient is zero on every environment token and not on the
    model's; the trainer counts only the model's tokens."""
    response = torch.tensor([[10, 11, 12, 13, 14, 15, 0, 0], [16, 17, 18, 19, 20, 21, 22, 23]])
    loss_mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 0], [1, 0, 0, 0, 0, 1, 1, 1]])
    batch = {p.FIELD_PROMPT_IDS: torch.tensor([[1, 5, 6], [1, 7, 8]]), p.FIELD_PROMPT_MASK: torch.ones(2, 3).long(),
             p.FIELD_RESPONSE_IDS: response, p.FIELD_RESPONSE_MASK: (response > 0).long(),
             p.FIELD_LOSS_MASK: loss_mask}
    logprobs = response_logprobs(model, batch).detach().requires_grad_()
    behaviour = (logprobs.detach() - 0.1) * batch[p.FIELD_RESPONSE_MASK]
    result = policy_loss(logprobs, behaviour, torch.tensor([1.0, -1.0]), p.trained_tokens(batch), PolicyLossConfig())
    result.loss_sum.backward()
    environment = (batch[p.FIELD_RESPONSE_MASK] == 1) & (loss_mask == 0)
    assert (logprobs.grad[environment] == 0).all() and environment.any()
    assert (logprobs.grad[loss_mask.bool()] != 0).all()

    trainer = TorchTrainer(load_model("builtin:tiny-lm", seed=0), lr=1e-3)
    trainer.begin_train_step(0)
    full = {**batch, p.FIELD_BEHAVIOUR_LOGPROBS: behaviour, p.FIELD_ADVANTAGE: torch.tensor([1.0, -1.0])}
    counts = trainer.train_microbatch(0, full)
    assert counts["tokens"] == float(loss_mask.sum())  # not the 14 tokens of the response mask
    # the parameters' gradient is the one of the model's tokens alone: an advantage on environment tokens
    # (here: flipping which tokens are the environment's) changes it
    grads = [q.grad.clone() for q in trainer.model.module.parameters() if q.grad is not None]
    trainer.abort_train_step(0)
    trainer.begin_train_step(1)
    trainer.train_microbatch(1, {**full, p.FIELD_LOSS_MASK: batch[p.FIELD_RESPONSE_MASK]})
    other = [q.grad for q in trainer.model.module.parameters() if q.grad is not None]
    assert any(not torch.allclose(a, b) for a, b in zip(grads, other))


def _module_dir(name, source, _dirs={}):
    import tempfile
    from pathlib import Path

    directory = _dirs.setdefault("dir", tempfile.mkdtemp(prefix="rldsl-env-"))
    (Path(directory) / f"{name}.py").write_text(textwrap.dedent(source))
    return directory


FLAKY = """
    import os, time

    class Flaky:
        def reset(self, prompt, answer):
            self.answer = answer
            if answer == "boom":
                raise ValueError("no such task")
            return [{"role": "user", "content": prompt}]

        def step(self, messages, completion):
            if self.answer == "hang":
                time.sleep(60)
            if self.answer == "die":
                os._exit(3)
            if self.answer == "bad":
                return "obs", "not a number", True
            return "", 1.0, True
"""


def test_a_hung_call_holds_only_its_own_episode():
    """A 2 s timeout: the hung step is killed at its deadline while the other
    episodes' steps, each in a process of its own, answer at once."""
    import time

    host = EnvironmentHost(f"flaky:Flaky@{_module_dir('flaky', FLAKY)}", 2.0, 1)
    try:
        answers = ["hang"] + ["ok"] * 6
        processes = host.open(len(answers))
        assert all(isinstance(r, tuple) for r in host.exchange([(pr, ("reset", "1+1=", a))
                                                               for pr, a in zip(processes, answers)]))
        started = time.monotonic()
        replies = host.exchange([(process, ("step", [], "2")) for process in processes])
        took = time.monotonic() - started
        again = host.exchange([(process, ("step", [], "2")) for process in processes[1:]])  # they live on
    finally:
        host.close()
    assert isinstance(replies[0], CallFailure) and replies[0].status == EpisodeStatus.TIMEOUT and took >= 2.0
    assert [r[0] for r in replies[1:] + again] == ["ok"] * 12
    assert host.episodes_started == 7



def test_a_call_far_slower_than_usual_is_cut_as_a_straggler_long_before_its_timeout():
    """`straggler = 8`: once 16 quick calls have set the usual call time, a
    hung step is killed at the floor (0.2 s), not at its 30 s timeout, and
    says why; reset calls count as calls, closes and harness episodes never."""
    import time

    from rldsl.runtime.environments.host import STRAGGLER_AFTER_CALLS, STRAGGLER_FLOOR_S

    host = EnvironmentHost(f"flaky:Flaky@{_module_dir('flaky', FLAKY)}", 30.0, 1, straggler=8.0)
    try:
        answers = ["hang"] + ["ok"] * (STRAGGLER_AFTER_CALLS - 1)
        processes = host.open(len(answers))
        assert host._straggler_limit() is None  # nothing timed yet: only the timeout
        host.exchange([(pr, ("reset", "1+1=", a)) for pr, a in zip(processes, answers)])
        assert host._straggler_limit() == STRAGGLER_FLOOR_S  # 16 resets of milliseconds: 8x that is under it
        started = time.monotonic()
        replies = host.exchange([(process, ("step", [], "2")) for process in processes])
        took = time.monotonic() - started
    finally:
        host.close()
    assert replies[0].status == EpisodeStatus.STRAGGLER, replies[0]
    assert "8 times the environment's usual call time" in replies[0].detail
    assert STRAGGLER_FLOOR_S <= took < 10.0
    assert [r[0] for r in replies[1:]] == ["ok"] * (STRAGGLER_AFTER_CALLS - 1)
    assert DROP_REASONS[EpisodeStatus.STRAGGLER] == "environment_straggler"


STATEFUL = """
    import asyncio, subprocess, sys, threading

    class Shell:
        \"\"\"Holds what never pickles across turns: a running subprocess, a lock, an event loop's task.\"\"\"

        def reset(self, prompt, answer):
            self.lock = threading.Lock()
            self.child = subprocess.Popen([sys.executable, "-c", "import sys\\nfor line in sys.stdin: print(len(line) - 1, flush=True)"],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            self.seen = []
            return [{"role": "user", "content": prompt}]

        async def step(self, messages, completion):
            with self.lock:
                self.child.stdin.write(completion + "\\n")
                self.child.stdin.flush()
                length = int(await asyncio.to_thread(self.child.stdout.readline))
            self.seen.append(length)
            return f" {len(self.seen)}:{length}", float(length), False

        def close(self):
            self.child.stdin.close()
            self.child.wait(timeout=5)
            with open(__file__ + ".closed", "a") as record:  # proof for the test, from the episode's process
                record.write("closed\\n")
"""


def test_an_environment_keeps_what_never_pickles_across_turns_and_is_closed():
    """Its instance lives in the episode's process from reset to close: an
    open subprocess, a lock and an async step carry over from turn to turn."""
    directory = _module_dir("stateful", STATEFUL)
    host = EnvironmentHost(f"stateful:Shell@{directory}", 10.0, 1)
    try:
        processes = host.open(2)
        host.exchange([(process, ("reset", "go", "")) for process in processes])
        first = host.exchange([(processes[0], ("step", [], "abc")), (processes[1], ("step", [], "a"))])
        second = host.exchange([(processes[0], ("step", [], "ab")), (processes[1], ("step", [], "abcd"))])
        host.finish(processes)
    finally:
        host.close()
    assert [r[1][0]["content"] for r in first] == [" 1:3", " 1:1"]
    assert [r[1][0]["content"] for r in second] == [" 2:2", " 2:4"]  # each episode's own state, turn after turn
    closed = Path(directory) / "stateful.py.closed"
    assert closed.read_text() == "closed\n" * 2 and all(process.ended for process in processes)
    closed.unlink()


def test_a_crashing_or_hanging_environment_drops_only_its_sample(model):
    host = EnvironmentHost(f"flaky:Flaky@{_module_dir('flaky', FLAKY)}", 1.0, 2)
    answers = ["ok", "boom", "hang", "die", "bad", "ok"]
    try:
        batch, failures = _runner(model, host).run([p.Prompt(i, "1+1=", a) for i, a in enumerate(answers)], 1, 0)
        after, _ = _runner(model, host).run([p.Prompt(9, "1+1=", "ok")], 2, 0)  # the killed processes replaced
    finally:
        host.close()
    statuses = [EpisodeStatus(int(s)) for s in batch[p.FIELD_EPISODE_STATUS]]
    assert statuses == [EpisodeStatus.OK, EpisodeStatus.RAISED, EpisodeStatus.TIMEOUT, EpisodeStatus.DIED,
                        EpisodeStatus.RAISED, EpisodeStatus.OK]
    assert len(failures) == 4 and "ValueError: no such task" in failures[0][1]
    assert batch[p.FIELD_PROMPT_MASK].sum(dim=1).min() > 0  # a row failed at reset still has its prompt
    rewards = episode_rewards({field: batch[field] for field in (p.FIELD_EPISODE_REWARD, p.FIELD_EPISODE_STATUS,
                                                                 p.FIELD_TURNS)})  # a pipeline without tools
    assert [float(r) for r in (rewards[0], rewards[5])] == [1.0, 1.0] and rewards[0].stats == {"turns": 1.0}
    assert rewards[0].parts == {}  # turns are no reward: their own channel
    assert [r.reason for r in rewards[1:5]] == [DROP_REASONS[s] for s in statuses[1:5]]
    assert after[p.FIELD_EPISODE_STATUS].tolist() == [0, 0]


def test_each_turns_reward_is_a_statistic_of_its_sample_and_they_sum_to_the_episodes(model, arith_host):
    """ArithRetry rewards a right answer at once and halves it per retry; a
    wrong turn gets 0: per sample the turn rewards (NaN past its last turn,
    a full `max_turns` wide so that groups stack) sum to its reward, and
    `reward_turnK` counts only the turns the sample took."""
    import math

    batch, failures = _runner(model, arith_host, max_turns=3).run([p.Prompt(0, "12+19=", "31")], 8, seed=3)
    assert not failures and batch[p.FIELD_TURN_REWARDS].shape == (8, 3)
    for turns, rewards, total in zip(batch[p.FIELD_TURNS].tolist(), batch[p.FIELD_TURN_REWARDS].tolist(),
                                     batch[p.FIELD_EPISODE_REWARD].tolist()):
        assert not any(math.isnan(r) for r in rewards[:turns]) and all(math.isnan(r) for r in rewards[turns:])
        assert sum(rewards[:turns]) == pytest.approx(total)
    stats = [r.stats for r in episode_rewards({field: batch[field] for field in (
        p.FIELD_EPISODE_REWARD, p.FIELD_EPISODE_STATUS, p.FIELD_TURNS, p.FIELD_TURN_REWARDS)})]
    assert [list(s) for s in stats] == [["turns", *(f"reward_turn{k}" for k in range(1, int(s["turns"]) + 1))]
                                        for s in stats]
    assert [s["reward_turn1"] for s in stats] == batch[p.FIELD_TURN_REWARDS][:, 0].tolist()

def test_an_environment_that_does_not_load_fails_at_start():
    with pytest.raises(EnvironmentLoadError, match="has no 'Nope'"):
        EnvironmentHost("rldsl.environments:Nope", 1.0, 1)
    with pytest.raises(EnvironmentLoadError, match="'episode_reward' is a function"):
        EnvironmentHost("rldsl.environments:episode_reward", 1.0, 1)
    with pytest.raises(EnvironmentLoadError, match="cannot import module"):
        EnvironmentHost("no_such_module_here:Env", 1.0, 1)


def test_a_template_that_rewrites_earlier_turns_changes_nothing_the_model_said(tmp_path):
    """A template that rewrites earlier assistant turns (as Qwen3's drops their
    `<think>` blocks; here it upper-cases them) would have the engine read
    other tokens than were sampled if the conversation were re-rendered. The
    turns after the first read the tokens so far instead: no episode fails,
    and the model's tokens of every turn keep the logprobs they were drawn
    with under the conversation as the trainer reads it."""
    template = ("{% for m in messages %}<bos>{{ m['role'][0] }}:{% if m['role'] == 'assistant' and not loop.last %}"
                "{{ m['content'] | upper }}{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}<bos>a:{% endif %}")
    hf_model = _templated_char_llama(tmp_path, template)
    host = EnvironmentHost("rldsl.environments:ArithRetry", 10.0, 2)
    try:
        runner = _runner(hf_model, host, ChatTemplateTurns(hf_model.tokenizer), max_turns=3, max_tokens=40,
                         max_new_tokens=3)
        batch, failures = runner.run([p.Prompt(0, "1+1=", "99999")], 6, seed=0)
    finally:
        host.close()
    assert not failures and (batch[p.FIELD_TURNS] == 3).all()
    trained = batch[p.FIELD_LOSS_MASK].bool()
    said = hf_model.tokenizer.inner.decode(batch[p.FIELD_RESPONSE_IDS][trained].tolist())
    assert any(c.isalpha() and c.islower() for c in said)  # words the template would have rewritten
    with torch.no_grad():
        recomputed = response_logprobs(hf_model, batch)
    assert torch.allclose(recomputed[trained], batch[p.FIELD_BEHAVIOUR_LOGPROBS][trained], atol=1e-4)


def test_a_template_that_drops_earlier_assistant_turns_is_refused(tmp_path):
    template = ("{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}<bos>{{ m['content'] }}"
                "{% endif %}{% endfor %}{% if add_generation_prompt %}<bos>a:{% endif %}")
    hf_model = _templated_char_llama(tmp_path, template)
    with pytest.raises(ValueError, match="drops the content of earlier assistant turns"):
        ChatTemplateTurns(hf_model.tokenizer)


def _templated_char_llama(tmp_path, template: str):
    pytest.importorskip("transformers")
    import json

    from tests.hf_tiny import save_char_llama

    path = save_char_llama(tmp_path / "model")
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return load_model(f"hf:{path}")


def test_the_response_stops_at_the_episode_budget(model, arith_host):
    batch, _ = _runner(model, arith_host, max_tokens=10).run([p.Prompt(0, "12+19=", "99999")], 4, 0)
    assert int(batch[p.FIELD_RESPONSE_MASK].sum(dim=1).max()) <= 10


def test_chat_template_turns_keep_the_template_tokens_as_the_environments(tmp_path):
    """An `hf:` model with a chat template: the first turn is the template
    over the messages; each observation joins as the template's tokens
    between the model's turn and the next (the environment's), after the
    model's own end-of-turn token when it sampled one."""
    template = ("{% for m in messages %}<bos>{{ m['role'][0] }}:{{ m['content'] }}"
                "{% if m['role'] == 'assistant' %}<eos>{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}<bos>a:{% endif %}")
    hf_model = _templated_char_llama(tmp_path, template)
    tokenizer = hf_model.tokenizer
    turns = ChatTemplateTurns(tokenizer)
    assert turns.first_text([{"role": "user", "content": "1+1="}]) == "<bos>u:1+1=<bos>a:"
    observation = [{"role": "user", "content": " up"}]
    assert turns.observation_tokens(observation, ended=True) == tokenizer.encode("<bos>u: up<bos>a:")
    assert turns.observation_tokens(observation, ended=False) == tokenizer.encode("<eos><bos>u: up<bos>a:")
    host = EnvironmentHost("rldsl.environments:ArithRetry", 10.0, 2)
    try:
        batch, _ = _runner(hf_model, host, turns, max_turns=2, max_new_tokens=3).run(
            [p.Prompt(0, "1+1=", "99999")], 6, seed=0)
    finally:
        host.close()
    ok = [r for r in range(6) if batch[p.FIELD_EPISODE_STATUS][r] == EpisodeStatus.OK and batch[p.FIELD_TURNS][r] == 2]
    assert ok
    for row in ok:
        environment = batch[p.FIELD_RESPONSE_MASK][row].bool() & ~batch[p.FIELD_LOSS_MASK][row].bool()
        assert tokenizer.bos_id in batch[p.FIELD_RESPONSE_IDS][row][environment].tolist()  # "<bos>u: ...<bos>a:"
    with torch.no_grad():
        recomputed = response_logprobs(hf_model, batch)
    rows = torch.tensor(ok)
    on_model = p.trained_tokens(batch)[rows].bool()
    assert torch.allclose(recomputed[rows][on_model], batch[p.FIELD_BEHAVIOUR_LOGPROBS][rows][on_model], atol=1e-4)


def test_the_episode_reward_is_recognised_however_the_plan_anchored_it():
    from rldsl.runtime.environments import reads_episode_reward

    assert reads_episode_reward("rldsl.environments:episode_reward")
    assert reads_episode_reward("rldsl.environments:episode_reward@/work/pipelines")
    assert not reads_episode_reward("rldsl.rewards:exact_match")
    assert not reads_episode_reward([{"name": "a", "fn": "rldsl.environments:episode_reward", "weight": 1.0}])


def test_an_episode_that_would_pass_the_models_context_ends_there_alone(model, arith_host):
    """The builtin model reads 64 positions: 30 turns of a wrong answer cannot
    fit, and each episode ends, trained, before a turn would pass them (a
    turn past them would fail the whole group's request)."""
    batch, failures = _runner(model, arith_host, max_turns=30, max_tokens=200).run(
        [p.Prompt(0, "12+19=", "99999")], 4, seed=0)
    assert not failures and (batch[p.FIELD_EPISODE_STATUS] == EpisodeStatus.OK).all()
    lengths = batch[p.FIELD_PROMPT_MASK].sum(dim=1) + batch[p.FIELD_RESPONSE_MASK].sum(dim=1)
    assert int(lengths.max()) <= 64 and (batch[p.FIELD_TURNS] < 30).all() and (batch[p.FIELD_TURNS] > 2).all()
    assert batch[p.FIELD_CONTEXT_FULL].tolist() == [1] * 4  # each sample says so (`context_ended` in the step)
    rewards = episode_rewards({field: batch[field] for field in (p.FIELD_EPISODE_REWARD, p.FIELD_EPISODE_STATUS,
                                                                 p.FIELD_TURNS, p.FIELD_CONTEXT_FULL)})
    assert [r.stats["context_ended"] for r in rewards] == [1.0] * 4


def test_a_long_observation_is_cut_to_max_observation_tokens(model):
    """`max_observation_tokens`: each environment message's content joins the
    conversation cut to its first N tokens (a tool's long output cannot fill
    the episode)."""
    host = EnvironmentHost("verbose:Verbose@{}".format(_module_dir("verbose", """
        class Verbose:
            def reset(self, prompt, answer):
                return [{"role": "user", "content": prompt}]
            def step(self, messages, completion):
                return " " + "abc" * 20, 0.0, False
    """)), 10.0, 1)
    try:
        runner = _runner(model, host, TranscriptTurns(model.tokenizer, max_observation_tokens=5), max_turns=2,
                         max_tokens=60)
        batch, failures = runner.run([p.Prompt(0, "1+1=", "2")], 2, seed=0)
    finally:
        host.close()
    assert not failures
    for row in range(2):
        environment = batch[p.FIELD_RESPONSE_MASK][row].bool() & ~batch[p.FIELD_LOSS_MASK][row].bool()
        assert model.tokenizer.decode(batch[p.FIELD_RESPONSE_IDS][row][environment].tolist()) == " abca"


PACED = """
    import time

    LOG = {log!r}

    class Paced:
        def reset(self, prompt, answer):
            self.answer = answer
            return [{{"role": "user", "content": prompt}}]

        def step(self, messages, completion):
            if self.answer == "slow":
                time.sleep(0.8)
            with open(LOG, "a") as log:
                log.write(f"{{self.answer}} {{time.monotonic()}}\\n")
            return "again", 0.0, False
"""


def test_each_episode_runs_its_turns_without_waiting_for_the_groups_slowest(model, tmp_path):
    """One sample's environment takes 0.8 s a step, the others' none: they play all
    their turns while it is still on its second (no lockstep per group)."""
    log = tmp_path / "steps.log"
    host = EnvironmentHost(f"paced:Paced@{_module_dir('paced', PACED.format(log=str(log)))}", 10.0, 1)
    try:
        batch, failures = _runner(model, host, max_turns=4, max_tokens=60).run(
            [p.Prompt(0, "1+1=", "slow"), p.Prompt(1, "2+2=", "fast")], 3, seed=0)
    finally:
        host.close()
    assert failures == [] and batch[p.FIELD_TURNS].tolist() == [4] * 6
    steps = [line.split() for line in log.read_text().splitlines()]
    slow = sorted(float(t) for who, t in steps if who == "slow")
    fast = sorted(float(t) for who, t in steps if who == "fast")
    assert len(slow) == len(fast) == 12
    assert fast[-1] < slow[3 * 2 - 1], (fast[-1], slow)  # every fast turn done before the slow ones' second
