"""One environment process: imports the environment class once, then runs calls.

``EnvironmentHost`` (host.py) starts it as ``python -m
rldsl.runtime.environments.process READ_FD WRITE_FD PARENT_PID`` and talks
over two pipes in the reward processes' length-prefixed pickles
(``rldsl.runtime.reward_process``). The first message in is ``(sys_path,
"module:Class")``, answered ``("ready",)`` or ``("load_error", text)``. Then
each message is one call:

- ``("reset", prompt, answer)`` -> ``("ok", state, messages)``
- ``("step", state, messages, completion)`` -> ``("ok", state, (observation, reward, done))``

where ``state`` is the pickled environment instance; a call that raises or
returns something malformed is answered ``("raised", text)``.
"""

from __future__ import annotations

import pickle
import sys

from rldsl.runtime.environments.protocol import checked_messages, checked_step, load_environment
from rldsl.runtime.reward_process import serve


def run_call(cls, call: tuple) -> tuple:
    try:
        if call[0] == "reset":
            env = cls()
            messages = checked_messages(env.reset(call[1], call[2]))
            return "ok", pickle.dumps(env), messages
        env = pickle.loads(call[1])
        result = checked_step(env.step([dict(m) for m in call[2]], call[3]))
        return "ok", pickle.dumps(env), result
    except BaseException as error:  # noqa: BLE001 - sys.exit() in an environment drops only its sample too
        return "raised", f"{call[0]}: {type(error).__name__}: {error}"


def main(argv: list[str]) -> None:
    serve(argv, load_environment, lambda cls, call: [run_call(cls, call)], lambda spec, error: str(error))


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (BrokenPipeError, KeyboardInterrupt):
        pass  # the host went away
