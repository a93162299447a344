"""OpenEnv environments, run unchanged as rldsl environments.

An ``environment`` block whose ``fn`` names a subclass of OpenEnv's
``openenv.core.env_server.interfaces.Environment`` (``openenv-core``) runs
it in the episode's own process, in place, with no HTTP server or
container: the class is wrapped into rldsl's protocol (protocol.py) here.

- ``reset``: the environment is built with no arguments and reset with the
  parameters its ``reset`` declares: ``seed`` (the same for every sample of
  a prompt, so a group plays one task: the prompt's number if it is one,
  else a stable hash of its text), ``episode_id``, and the dataset's
  ``prompt`` and ``answer`` if it names them. Its observation is the first
  user message.
- ``step``: the model's completion fills the action's one text field (the
  action class is read from ``step``'s annotation or the class's generic
  parameters); the observation's ``reward`` (None: 0) and ``done`` are the
  step's; its text is the next user message.
- An observation's text: its one string field besides OpenEnv's own
  (``done``, ``reward``, ``metadata``), or its fields as JSON when it has
  several or none.
- ``close``: the environment's ``close()``.

``reset_async`` / ``step_async`` are awaited when the class overrides them
(OpenEnv's defaults call ``step(action, timeout_s=...)``, which a ``step``
that takes only the action refuses). MCP tool environments (actions
``CallToolAction`` / ``ListToolsAction``) are not adapted: their action has
no text field, and the load says so.

Nothing here imports openenv: the class the user names does.
"""

from __future__ import annotations

import inspect
import json
import typing
import uuid
import zlib

OPENENV_BASE = ("openenv.core.env_server.interfaces", "Environment")
OBSERVATION_OWN_FIELDS = ("done", "reward", "metadata")  # OpenEnv's Observation base class's
ACTION_OWN_FIELDS = ("metadata",)  # ... and its Action's


class OpenEnvShapeError(ValueError):
    """An OpenEnv class the adapter cannot drive (protocol.py names the spec)."""


def is_openenv_environment(cls) -> bool:
    return isinstance(cls, type) and any((base.__module__, base.__qualname__) == OPENENV_BASE
                                         for base in cls.__mro__[1:])


def adapt_openenv(cls) -> type:
    """The rldsl environment class that runs OpenEnv's ``cls``."""
    action_cls = _action_class(cls)
    text_field = _text_field(action_cls)
    reset_parameters = _parameters(cls.reset)
    reset_async = _overrides(cls, "reset_async")
    step_async = _overrides(cls, "step_async")

    class OpenEnvEpisode:
        openenv_class = cls

        async def reset(self, prompt: str, answer: str) -> list[dict]:
            self.env = cls()
            candidates = {"seed": task_seed(prompt), "episode_id": uuid.uuid4().hex, "prompt": prompt,
                          "answer": answer}
            accepted = {k: v for k, v in candidates.items() if k in reset_parameters
                        or ("**" in reset_parameters and k in ("seed", "episode_id"))}
            observation = await _call(self.env.reset_async if reset_async else self.env.reset, **accepted)
            return [{"role": "user", "content": observation_text(observation)}]

        async def step(self, messages: list[dict], completion: str) -> tuple[str, float, bool]:
            action = action_cls(**{text_field: completion})
            observation = await _call(self.env.step_async if step_async else self.env.step, action)
            reward = getattr(observation, "reward", None)
            return observation_text(observation), float(reward or 0.0), bool(getattr(observation, "done", False))

        def close(self) -> None:
            close = getattr(getattr(self, "env", None), "close", None)
            if callable(close):
                close()

    OpenEnvEpisode.__name__ = OpenEnvEpisode.__qualname__ = f"OpenEnv[{cls.__name__}]"
    return OpenEnvEpisode


def task_seed(prompt: str) -> int:
    """One seed per prompt (a group's samples play the same task): the prompt's number, or its text's CRC."""
    text = prompt.strip()
    return int(text) if text.isdigit() and len(text) < 19 else zlib.crc32(prompt.encode())


def observation_text(observation) -> str:
    fields = _fields(type(observation), OBSERVATION_OWN_FIELDS)
    texts = [name for name in fields if isinstance(getattr(observation, name, None), str)]
    if len(texts) == 1:
        return getattr(observation, texts[0])
    return json.dumps({name: getattr(observation, name, None) for name in fields}, default=str)


async def _call(method, *args, **kwargs):
    value = method(*args, **kwargs)
    return await value if inspect.isawaitable(value) else value


def _action_class(cls) -> type:
    try:
        hinted = typing.get_type_hints(cls.step).get("action")
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: try the generic parameters
        hinted = None
    if isinstance(hinted, type) and hasattr(hinted, "model_fields"):
        return hinted
    for base in getattr(cls, "__orig_bases__", ()):
        arguments = typing.get_args(base)
        if arguments and isinstance(arguments[0], type) and hasattr(arguments[0], "model_fields"):
            return arguments[0]
    raise OpenEnvShapeError("cannot tell its action class; annotate `step(self, action: MyAction)` or subclass "
                            "`Environment[MyAction, MyObservation, State]`")


def _text_field(action_cls: type) -> str:
    fields = _fields(action_cls, ACTION_OWN_FIELDS)
    texts = [name for name, info in fields.items() if info.annotation is str]
    required = [name for name, info in fields.items() if info.is_required()]
    if len(texts) == 1 and set(required) <= set(texts):
        return texts[0]
    raise OpenEnvShapeError(
        f"its action {action_cls.__name__} has fields "
        f"{', '.join(fields) or 'none'}; the model's completion fills an action with one text (`str`) field, "
        f"every other field optional (MCP tool environments are not adapted)")


def _fields(model_cls: type, own: tuple[str, ...]) -> dict:
    return {name: info for name, info in getattr(model_cls, "model_fields", {}).items() if name not in own}


def _parameters(method) -> set[str]:
    parameters = inspect.signature(method).parameters.values()
    return {("**" if p.kind is p.VAR_KEYWORD else p.name) for p in parameters}


def _overrides(cls, name: str) -> bool:
    """Whether ``cls`` defines ``name`` itself, not only OpenEnv's base class."""
    return any(name in vars(base) for base in cls.__mro__
               if (base.__module__, base.__qualname__) != OPENENV_BASE and base is not object)
