"""`model { chat_template = true }`: every prompt goes through the hf:
tokenizer's chat template before any engine encodes it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from rldsl.compiler.driver import compile_source
from rldsl.runtime.control.prompts import load_source

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = "{% for m in messages %}<bos>[{{ m['role'] }}]{{ m['content'] }}{% endfor %}" \
           "{% if add_generation_prompt %}[assistant]{% endif %}"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    from tests.hf_tiny import save_char_llama

    path = save_char_llama(tmp_path_factory.mktemp("model"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return path


def plan(model: Path, chat_template: str):
    text = (ROOT / "pipelines" / "grpo_async.rlp").read_text().replace(
        'model policy { source = "builtin:tiny-lm" }',
        f'model policy {{ source = "hf:{model}"  chat_template = {chat_template} }}')
    result = compile_source(text, "p.rlp")
    assert result.ok, result.diagnostics
    return result.plan.pipeline()


def test_prompts_are_templated_and_encoded_with_one_bos(chat_model):
    from rldsl.models import load_tokenizer
    from rldsl.runtime.engines.torch.common import encode_prompts

    pipe = plan(chat_model, "true")
    prompt = load_source(pipe, pipe.datasets[0].source, "eval", 0)[0]
    assert prompt.text == f"<bos>[user]{prompt.meta['raw_prompt']}[assistant]"
    tokenizer = load_tokenizer(f"hf:{chat_model}")
    ids, mask = encode_prompts(tokenizer, [prompt])
    tokens = ids[0][mask[0].bool()].tolist()
    assert tokens[0] == tokenizer.bos_id and tokens.count(tokenizer.bos_id) == 1


def test_off_by_default_prompts_stay_as_written(chat_model):
    pipe = plan(chat_model, "false")
    prompt = load_source(pipe, pipe.datasets[0].source, "eval", 0)[0]
    assert "[user]" not in prompt.text and "raw_prompt" not in prompt.meta


def test_a_model_without_a_template_is_refused_before_anything_starts(tmp_path):
    from rldsl.runtime.ray_lowering.launch import PreflightError, preflight
    from tests.hf_tiny import save_char_llama

    pipe = plan(save_char_llama(tmp_path / "plain"), "true")
    with pytest.raises(PreflightError, match="has no chat template"):
        preflight(pipe)
    text = (ROOT / "pipelines" / "grpo_async.rlp").read_text().replace(
        'source = "builtin:tiny-lm" }', 'source = "builtin:tiny-lm"  chat_template = true }')
    assert [d.code for d in compile_source(text, "p.rlp").diagnostics] == ["RLP112"]  # `check` refuses it first
    plain = compile_source((ROOT / "pipelines" / "grpo_async.rlp").read_text(), "p.rlp").plan.pipeline()
    edited = dataclasses.replace(plain, models=[dataclasses.replace(m, chat_template=True) for m in plain.models])
    with pytest.raises(PreflightError, match="needs an `hf:` model"):  # a hand-edited plan, by the same predicate
        preflight(edited)
