"""Datasets whose prompt is a list of chat messages (verl, OpenRLHF, ROLL,
AReaL): read from jsonl, rendered by the policy's chat template, refused
before anything starts when there is no template to render them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rldsl.compiler.driver import compile_source
from rldsl.runtime.control.prompts import load_source
from rldsl.tasks import DatasetError, holds_messages, load_dataset

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}" \
           "{% if add_generation_prompt %}[assistant]{% endif %}"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12+7="}]


def write_rows(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def plan(data: Path, model: str, chat_template: str = "false", extra: str = "eval_size = 0"):
    text = (ROOT / "pipelines" / "grpo_async.rlp").read_text()
    text = text.replace('model policy { source = "builtin:tiny-lm" }',
                        f'model policy {{ source = "{model}"  chat_template = {chat_template} }}')
    text = text.replace('dataset prompts { source = "builtin:arith"  eval_size = 128 }',
                        f'dataset prompts {{ source = "jsonl:{data}"  {extra} }}')
    result = compile_source(text, "p.rlp")
    assert result.ok, result.diagnostics
    return result.plan.pipeline()


# -- reading ------------------------------------------------------------------------


def test_a_messages_row_keeps_its_messages_and_reads_as_its_last_user_turn(tmp_path):
    path = write_rows(tmp_path / "chat.jsonl", [{"prompt": CHAT, "answer": "19"}, {"prompt": "3+4=", "answer": "7"}])
    chat, plain = load_dataset(f"jsonl:{path}", "train")
    assert (chat.text, chat.answer, chat.meta["messages"]) == ("12+7=", "19", CHAT)
    assert plain.text == "3+4=" and "messages" not in plain.meta


@pytest.mark.parametrize("prompt, message", [
    ([], r"chat\.jsonl:1: `prompt` is an empty list"),
    ([{"role": "user"}], r"chat\.jsonl:1: `prompt`: message 1 is \{\"role\": \"user\"\}"),
    ([{"role": "user", "content": "a"}, "b"], r"`prompt`: message 2 is \"b\"; each chat message is"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}]}], r"message 1 is .* with string values"),
])
def test_malformed_messages_name_the_row_and_the_shape(tmp_path, prompt, message):
    path = write_rows(tmp_path / "chat.jsonl", [{"prompt": prompt, "answer": "1"}])
    with pytest.raises(DatasetError, match=message):
        load_dataset(f"jsonl:{path}", "train")


def test_held_out_rows_of_messages_split_by_their_whole_conversation(tmp_path):
    rows = [{"q": [{"role": "system", "content": f"s{i}"}, {"role": "user", "content": "same"}], "a": str(i)}
            for i in range(400)]
    path = write_rows(tmp_path / "chat.jsonl", rows)
    train = load_dataset(f"jsonl:{path}", "train", prompt_field="q", answer_field="a", hold_out=True)
    held = load_dataset(f"jsonl:{path}", "eval", prompt_field="q", answer_field="a", hold_out=True)
    assert held and len(train) + len(held) == 400  # the same user turn, yet split apart by the system turns
    assert not {p.answer for p in train} & {p.answer for p in held}


def test_holds_messages_reads_only_the_first_row(tmp_path):
    path = write_rows(tmp_path / "train.jsonl", [{"prompt": CHAT, "answer": "19"}])
    assert holds_messages(f"jsonl:{path}") == f"{path}:1"
    assert holds_messages(f"jsonl:{tmp_path}/{{split}}.jsonl") == f"{path}:1"  # the train file of a {split} path
    assert holds_messages(f"jsonl:{path}", "question") is None
    plain = write_rows(tmp_path / "plain.jsonl", [{"prompt": "x", "answer": "1"}, {"prompt": CHAT, "answer": "2"}])
    assert holds_messages(f"jsonl:{plain}") is None
    assert holds_messages(f"jsonl:{tmp_path}/missing.jsonl") is None and holds_messages("builtin:arith") is None


# -- rendering through the policy's chat template -------------------------------------------


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    from tests.hf_tiny import save_char_llama

    path = save_char_llama(tmp_path_factory.mktemp("model"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return path


def test_messages_render_through_the_tokenizers_own_template(chat_model, tmp_path):
    from transformers import AutoTokenizer

    path = write_rows(tmp_path / "chat.jsonl", [{"prompt": CHAT, "answer": "19"}, {"prompt": "3+4=", "answer": "7"}])
    pipe = plan(path, f"hf:{chat_model}", "true")
    chat, plain = load_source(pipe, pipe.datasets[0].source, "train", 0)
    expected = AutoTokenizer.from_pretrained(chat_model).apply_chat_template(CHAT, tokenize=False,
                                                                             add_generation_prompt=True)
    assert chat.text == expected == "[system]Be brief.[user]12+7=[assistant]"
    assert chat.meta["raw_prompt"] == "12+7=" and chat.meta["messages"] == CHAT
    assert plain.text == "[user]3+4=[assistant]"  # a string row is one user turn, as before


def test_the_prompt_budget_counts_the_rendered_conversation(chat_model, tmp_path):
    path = write_rows(tmp_path / "chat.jsonl", [{"prompt": CHAT, "answer": "19"}, {"prompt": "3+4=", "answer": "7"}])
    budget = len("<bos>[user]3+4=[assistant]") - len("<bos>") + 1  # the string row fits, the chat row does not
    pipe = plan(path, f"hf:{chat_model}", "true", f"eval_size = 0  max_prompt_tokens = {budget}")
    assert [p.answer for p in load_source(pipe, pipe.datasets[0].source, "train", 0)] == ["7"]


# -- refused without a template --------------------------------------------------------------


def test_messages_without_a_chat_template_are_refused_when_read(tmp_path):
    path = write_rows(tmp_path / "chat.jsonl", [{"prompt": "3+4=", "answer": "7"}, {"prompt": CHAT, "answer": "19"}])
    pipe = plan(path, "builtin:tiny-lm")
    with pytest.raises(DatasetError, match=rf"dataset 'prompts': {path}:2 holds a list of chat messages in `prompt`"
                                           r".*set `chat_template = true` on model `policy`"):
        load_source(pipe, pipe.datasets[0].source, "train", 0)


def test_messages_without_a_chat_template_are_refused_before_anything_starts(tmp_path):
    from rldsl.runtime.ray_lowering.launch import PreflightError, preflight

    chat = write_rows(tmp_path / "chat.jsonl", [{"prompt": CHAT, "answer": "19"}])
    plain = write_rows(tmp_path / "plain.jsonl", [{"prompt": "3+4=", "answer": "7"}])
    with pytest.raises(PreflightError, match=rf"dataset `prompts`: {chat}:1 holds a list of chat messages.*"
                                             "chat_template = true"):
        preflight(plan(chat, "builtin:tiny-lm"))
    with pytest.raises(PreflightError, match=rf"{chat}:1 holds a list of chat messages"):  # the eval source too
        preflight(plan(plain, "builtin:tiny-lm", extra=f'eval_source = "jsonl:{chat}"  eval_size = 4'))
    preflight(plan(plain, "builtin:tiny-lm"))  # string prompts need no template


def test_rldsl_run_says_so_and_exits_2(tmp_path, capsys):
    from rldsl.cli import main

    chat = write_rows(tmp_path / "chat.jsonl", [{"prompt": CHAT, "answer": "19"}])
    text = (ROOT / "pipelines" / "grpo_async.rlp").read_text().replace(
        'dataset prompts { source = "builtin:arith"  eval_size = 128 }',
        'dataset prompts { source = "jsonl:chat.jsonl"  eval_size = 0 }')
    (tmp_path / "p.rlp").write_text(text)
    assert main(["run", str(tmp_path / "p.rlp"), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"error: dataset `prompts`: {chat}:1 holds a list of chat messages" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()  # stopped before anything started
