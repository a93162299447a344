"""An OpenAI-compatible chat-completions endpoint for agent harnesses.

One per generator replica that runs harness episodes, on 127.0.0.1 only,
with a bearer token the run makes up: ``POST /v1/chat/completions`` (and
``GET /v1/models``). Each request names its episode in the
``X-Rldsl-Episode`` header (the harness's client sends it); ``complete``
(the harness runner's) answers it with the replica's generator and records
the exact tokens; ``stream: true`` gets the answer as server-sent chunks.
The server runs aiohttp (Ray's own HTTP server, so no new
dependency) on a thread of its own; a completion waits for the generator in
a thread pool sized for every episode in flight.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from rldsl.runtime.environments.protocol import EPISODE_HEADER

MAX_WAITING = 512  # completions waiting for the generator at once (threads, mostly blocked)


class EndpointError(Exception):
    """A request the endpoint refuses: its HTTP status and OpenAI-style error type."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.kind = status, kind


class ChatEndpoint:
    def __init__(self, complete: Callable[[str, dict], dict], token: str, model_name: str = "policy"):
        try:
            from aiohttp import web
        except ImportError as error:
            raise ImportError("an agent harness's endpoint needs aiohttp: pip install 'rldsl[agents]'") from error
        self._web = web  # imported here, not with the module: only a harness's replica needs it

        self._complete, self._token, self.model_name = complete, token, model_name
        self._pool = ThreadPoolExecutor(MAX_WAITING, thread_name_prefix="chat-completion")
        self._loop = asyncio.new_event_loop()
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        started = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(started,), daemon=True, name="chat-endpoint")
        self._thread.start()
        started.wait()
        self.url = f"http://127.0.0.1:{self._port}/v1"

    def _serve(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        listening = socket.socket()
        listening.bind(("127.0.0.1", 0))  # loopback only: the harnesses run on this machine
        self._port = listening.getsockname()[1]
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(self._web.SockSite(self._runner, listening).start())
        started.set()
        self._loop.run_forever()

    async def _chat(self, request):
        try:
            self._authorize(request)
            episode = request.headers.get(EPISODE_HEADER)
            if not episode:
                raise EndpointError(f"no `{EPISODE_HEADER}` header: call through the client the harness was given")
            try:
                body = await request.json()
            except ValueError as error:
                raise EndpointError(f"the body is not JSON: {error}") from None
            if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
                raise EndpointError("the request needs `messages`, a list")
            answer = await self._loop.run_in_executor(self._pool, self._complete, episode, body)
            if body.get("stream"):
                return await self._stream(request, answer, bool((body.get("stream_options") or {})
                                                                .get("include_usage")))
            return self._web.json_response(answer)
        except EndpointError as error:
            return self._error(str(error), error.status, error.kind)
        except Exception as error:  # noqa: BLE001 - the generator failed: the harness hears it as OpenAI says so
            return self._error(f"the generator failed: {type(error).__name__}: {error}", 500, "server_error")

    async def _stream(self, request, answer: dict, include_usage: bool):
        """``stream: true``: the answer as OpenAI's server-sent chunks (many agent
        harnesses always stream). The completion is whole before the first
        chunk: the tokens are sampled as a batch, so streaming saves nothing."""
        response = self._web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                     "Cache-Control": "no-cache"})
        await response.prepare(request)
        for chunk in stream_chunks(answer, include_usage):
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _models(self, request):
        try:
            self._authorize(request)
        except EndpointError as error:
            return self._error(str(error), error.status, error.kind)
        return self._web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                              "owned_by": "rldsl"}]})

    def _error(self, message: str, status: int, kind: str):
        return self._web.json_response({"error": {"message": message, "type": kind}}, status=status)

    def _authorize(self, request) -> None:
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), self._token.encode()):
            raise EndpointError("a wrong or missing API key", status=401, kind="authentication_error")

    def close(self) -> None:
        async def stop():
            await self._runner.cleanup()

        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._pool.shutdown(wait=False, cancel_futures=True)


def stream_chunks(answer: dict, include_usage: bool) -> list[dict]:
    """A ``chat.completion`` as the ``chat.completion.chunk`` objects OpenAI
    streams: the message as one delta (tool calls indexed), then the finish
    reason, then the usage if asked for."""
    choice = answer["choices"][0]
    message = choice["message"]
    delta = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        delta["tool_calls"] = [{"index": index, **call} for index, call in enumerate(message["tool_calls"])]
    head = {key: answer[key] for key in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    chunks = [head | {"choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]},
              head | {"choices": [{"index": 0, "delta": {}, "logprobs": None,
                                   "finish_reason": choice["finish_reason"]}]}]
    if include_usage:
        chunks.append(head | {"choices": [], "usage": answer["usage"]})
    return chunks
