"""verifiers environments, run unchanged as rldsl agent harnesses.

An ``environment`` block whose ``fn`` names a subclass of verifiers'
``Taskset`` (``verifiers`` 0.4, its v1 stack: a taskset package exporting
its ``Taskset`` in ``__all__``, whose ``Task`` scores with ``@vf.reward``
functions and ends with ``@vf.stop`` ones) runs each episode as verifiers
runs a rollout: its ``Env`` (the package's own, or ``SingleAgentEnv``),
one slot of the row's task, ``env.serving()`` and ``env.run_slot``; the
episode's reward is the env's own scoring of the trace (``trace.reward``:
the task's rewards and judges, weighted). Every model call goes through
verifiers' interception server to the replica's OpenAI-compatible endpoint
(harness.py), which records the episode in token space.

What differs from ``vf-eval``:

- verifiers' own harnesses run as ``uv`` programs or in sandboxes, which an
  offline machine cannot start; an agent seat that names no harness gets
  ``InProcessChatHarness`` (the ``null`` harness's chat loop: the task's
  system prompt and prompt, its MCP tools, until a reply without tool calls)
  on the ``subprocess`` runtime. A seat that names its own keeps it.
- The rows are the pipeline's dataset's: a row whose prompt is one of the
  taskset's tasks' plays that task as ``load()`` made it; another fills the
  task data's ``prompt`` and ``answer``.
- verifiers takes an endpoint, not a client: the episode's client's base URL,
  key (through an environment variable, as verifiers reads keys) and
  episode header become a ``vf.EvalClientConfig``.
- An episode that failed (``episode.ok`` false: a harness, task or tool
  error) raises, so its sample is dropped; one that stopped (a ``@vf.stop``,
  a limit) is scored. The endpoint refusing a turn because the episode's
  ``max_turns``, ``max_tokens`` or the model's context is spent ends the
  conversation, and the trace so far is scored.

One conversation per episode: environments with several agents, request
hooks that rewrite earlier turns, or rollout retries are refused by the
endpoint as ``environment_tokenization``.

Importing this module imports verifiers: protocol.py imports it only for a
class whose bases say it is a verifiers ``Taskset``.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import types

import httpx
import openai
import verifiers.v1 as vf
from verifiers.v1.configs.agent import agent_config_fields
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harnesses.utils.compaction import CONTEXT_OVERFLOW_MARKERS
from verifiers.v1.harnesses.utils.mcp import call_mcp, connect_mcp
from verifiers.v1.utils.loaders import taskset_class

HARNESS_ID = "rldsl_inprocess_chat"  # a top-level module name: verifiers finds harnesses by importing their id
API_KEY_VAR = "RLDSL_VERIFIERS_API_KEY"  # verifiers reads an endpoint's key from the environment, by name
MODEL = "policy"  # the name requests carry; the endpoint serves its replica's model whatever it is
_SDK_HEADERS = {"accept", "content-type", "user-agent", "authorization"}
# the endpoint's refusals of a turn whose budget is spent (harness.py): the conversation ends, the trace is scored
BUDGET_MARKERS = ("pass the model's context", "(`max_turns`)", "(`max_tokens`)") + CONTEXT_OVERFLOW_MARKERS


class VerifiersEpisodeError(RuntimeError):
    """The episode failed (not merely stopped): its sample is dropped."""


class InProcessChatConfig(vf.HarnessConfig):
    id: str = HARNESS_ID
    max_tool_rounds: int | None = None
    """Model turns that may call tools before the loop stops (None: until a reply without calls)."""


class InProcessChatHarness(vf.Harness[InProcessChatConfig]):
    """The ``null`` harness's chat loop in this process, through the
    interception ``endpoint`` (``Harness.launch``'s contract): no program, so
    no ``uv``. Each tool call runs on the task's MCP tool servers; a call
    that cannot run is answered ``error: ...``."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages: list[dict] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt is not None:
            messages += [message_to_wire(message) for message in prompt]
        servers_config = {"mcpServers": {name: {"url": url, "timeout": self.config.tool_timeout}
                                         for name, url in mcp_urls.items()}}
        async with contextlib.AsyncExitStack() as stack:
            http = await stack.enter_async_context(httpx.AsyncClient(trust_env=False, timeout=None))
            client = openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0, http_client=http)
            tools, dispatch, servers = await connect_mcp(servers_config, stack) if mcp_urls else ([], {}, {})
            rounds = 0
            while True:
                try:
                    completion = await client.chat.completions.create(
                        model=ctx.model, messages=messages, **({"tools": tools} if tools else {}))
                except openai.APIStatusError as error:
                    if error.status_code in (400, 413) and any(m in _error_text(error) for m in BUDGET_MARKERS):
                        break  # the episode's budget is spent: the trace so far is scored
                    return vf.ProgramResult(exit_code=1, stdout="", stderr=f"{type(error).__name__}: {error}")
                message = completion.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if not message.tool_calls:
                    break
                for call in message.tool_calls:
                    messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name,
                                     "content": await _run_tool(servers, dispatch, call)})
                rounds += 1
                if self.config.max_tool_rounds is not None and rounds >= self.config.max_tool_rounds:
                    break
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


def _error_text(error: openai.APIStatusError) -> str:
    """The refusal's message as sent (the interception relays the endpoint's body inside its own)."""
    body = error.body
    message = body.get("message") if isinstance(body, dict) else body
    return f"{message or ''} {error.message}".casefold()


async def _run_tool(servers, dispatch, call) -> str:
    """A tool call's result as the model reads it."""
    try:
        arguments = json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError as error:
        return f"error: the tool call's arguments are not valid JSON ({error})"
    if not isinstance(arguments, dict):
        return f"error: the tool call's arguments must be an object, not {type(arguments).__name__}"
    if call.function.name not in dispatch:
        return f"error: there is no tool `{call.function.name}`; the tools are {', '.join(sorted(dispatch)) or 'none'}"
    try:
        content = await call_mcp(servers, dispatch, call.function.name, arguments)
    except Exception as error:  # noqa: BLE001 - the model reads what went wrong
        return f"error: {type(error).__name__}: {error}"
    return content if isinstance(content, str) else json.dumps(content)


# verifiers imports a harness by its id, a top-level module exporting the Harness in `__all__`
_plugin = types.ModuleType(HARNESS_ID)
_plugin.InProcessChatHarness, _plugin.InProcessChatConfig = InProcessChatHarness, InProcessChatConfig
_plugin.__all__ = ["InProcessChatHarness"]
sys.modules.setdefault(HARNESS_ID, _plugin)


def load_env(taskset: type) -> vf.Env:
    """The env of the taskset class ``taskset``, whose module is its id; agent
    seats that name no harness get the in-process one, on the subprocess runtime."""
    taskset_id = taskset.__module__
    if "." in taskset_id or taskset_class(taskset_id) is not taskset:
        raise ValueError(f"verifiers finds a taskset by its package's name: `{taskset.__name__}` must be what the "
                         f"top-level module `{taskset_id}` exports in `__all__`")
    config = vf.resolve_env_config({"taskset": {"id": taskset_id}})
    seats = {name: seat if seat.harness is not None else
             seat.model_copy(update={"harness": InProcessChatConfig(), "runtime": vf.SubprocessConfig()})
             for name, seat in agent_config_fields(config).items()}
    return vf.load_environment(config.model_copy(update=seats))


def task_for(env: vf.Env, loaded: dict, prompt: str, answer: str) -> vf.Task:
    """The row's task: the taskset's own with this prompt, else one whose data is the row's."""
    if prompt in loaded:
        return loaded[prompt]
    task_cls = type(env.taskset).task_type()
    data_cls = task_cls.data_type()
    fields = {"prompt": prompt, **({"answer": answer} if "answer" in data_cls.model_fields else {})}
    return task_cls(data_cls.model_validate(fields), env.config.taskset.task)


def client_config(client) -> vf.EvalClientConfig:
    """The endpoint ``client`` talks to, as verifiers takes one: its URL, its
    key (in ``API_KEY_VAR``) and its own headers (the episode's)."""
    os.environ[API_KEY_VAR] = client.api_key
    headers = {key: value for key, value in client.default_headers.items() if isinstance(value, str)
               and key.lower() not in _SDK_HEADERS and not key.lower().startswith("x-stainless")}
    return vf.EvalClientConfig(base_url=str(client.base_url).rstrip("/"), api_key_var=API_KEY_VAR, headers=headers)


def _loopback_without_proxy() -> None:
    """verifiers' HTTP client honours proxy variables: the endpoint is on loopback."""
    for var in ("NO_PROXY", "no_proxy"):
        entries = [entry for entry in os.environ.get(var, "").split(",") if entry]
        os.environ[var] = ",".join(entries + [h for h in ("127.0.0.1", "localhost") if h not in entries])


def episode_reward(episode: vf.Episode) -> float:
    """Its trainable traces' reward; raises when the episode failed."""
    if not episode.ok:
        errors = [e for trace in episode.traces for e in trace.errors] + list(episode.errors)
        detail = "; ".join(f"{e.type}: {e.message}" for e in errors) or "no error recorded"
        raise VerifiersEpisodeError(f"the verifiers episode failed: {detail}")
    return float(sum(t.reward for t in episode.traces if t.agent is None or t.agent.trainable))


def adapt_verifiers(taskset: type):
    """``async def harness(client, prompt, answer) -> reward`` playing the
    taskset's env; the env and its tasks are built here, once per process
    (the environment server's, before it forks each episode's process: one
    episode a process, so no two share the env's servers)."""
    env = load_env(taskset)
    loaded = {task.data.prompt_text: task for task in env.taskset}
    importlib.import_module("verifiers.v1.utils.version")  # a rollout's first use; the server imports the
    # clients' modules too (process.import_client_modules): no episode's process (a fork) imports them again

    async def harness(client, prompt, answer):
        _loopback_without_proxy()
        context = vf.ModelContext(model=MODEL, client=client_config(client), sampling=vf.SamplingConfig())
        (slot,) = env.slots(task_for(env, loaded, prompt, answer))
        async with env.serving():
            return episode_reward(await env.run_slot(slot, context))

    harness.__qualname__ = harness.__name__ = f"verifiers[{env.config.env_id}]"
    return harness
