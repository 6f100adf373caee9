"""``cfx.serve.app(engine, tokenizer)``: OpenAI's HTTP API over the serving engine, as an ASGI app.

    POST /v1/completions        {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed",
                                 "stop", "n", "stream", "ignore_eos"}  (a prompt: text or token ids)
    POST /v1/chat/completions   {"model", "messages", ...}            (the tokenizer's chat template)
    GET  /v1/models, /health, /metrics (Prometheus text)

A request's ``model`` is the base model's name or a LoRA adapter's the engine serves
(``Engine.add_adapter``; ``python -m cfx.serve --lora NAME=DIR``), each its own entry of ``/v1/models``.
Responses follow OpenAI's shapes (``usage`` included); ``"stream": true`` answers with server-sent
events in OpenAI's chunk format, ending with ``data: [DONE]``. Bad input is a 400 with OpenAI's error
JSON, an unknown model a 404, a full waiting queue a 429 with ``Retry-After``; a client that goes
away has its request aborted (its blocks given back); no traceback ever reaches a client. The engine
steps in its own thread (``runner.EngineThread``); without a seed, a sampled request draws one.
"""
from __future__ import annotations

import asyncio
import secrets
from typing import Any

from cfx._src.serve import handlers
from cfx._src.serve.metrics import Metrics
from cfx._src.serve.request import SamplingParams
from cfx._src.serve.runner import Closed, EngineThread, QueueFull
from cfx._src.serve.wire import BadRequest

FIELDS = {  # name -> (accepted types, default): anything else in a request is refused
    "model": ((str,), None), "prompt": ((str, list), None), "messages": ((list,), None),
    "max_tokens": ((int,), 16), "max_completion_tokens": ((int,), None), "temperature": ((int, float), 1.0),
    "top_p": ((int, float), 1.0), "top_k": ((int,), None), "seed": ((int,), None),
    "stop": ((str, list), None), "n": ((int,), 1), "stream": ((bool,), False), "ignore_eos": ((bool,), False),
    "stream_options": ((dict,), None), "user": ((str,), None),
}
MAX_N = 16


class Api:
    """The handlers over one ``EngineThread`` (module doc): ``model_name`` names the model requests ask for."""

    def __init__(self, runner: EngineThread, tokenizer: Any, model_name: str, metrics: Metrics):
        self.runner, self.tok, self.model_name, self.metrics = runner, tokenizer, model_name, metrics

    @property
    def model_names(self) -> list[str]:
        """The base model's name, then each LoRA adapter's (``Engine.add_adapter``): what a request may name."""
        return [self.model_name] + [n for n in self.runner.engine.adapters.names if n]

    # -- parsing --------------------------------------------------------------------------------------
    def parse(self, body: Any, chat: bool) -> tuple[list[int], SamplingParams, dict]:
        """The prompt's ids, the sampling params and the options, from a request body; BadRequest otherwise."""
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object.")
        for k, v in body.items():
            if k not in FIELDS:
                raise BadRequest(f"unknown field {k!r}; this server takes {sorted(FIELDS)}.", param=k)
            types, _ = FIELDS[k]
            if v is not None and (not isinstance(v, types) or (isinstance(v, bool) and bool not in types)):
                raise BadRequest(f"{k!r} must be {' or '.join(t.__name__ for t in types)}, got {type(v).__name__}.",
                                 param=k)
        o = {k: body.get(k, d) if body.get(k) is not None else d for k, (_, d) in FIELDS.items()}
        if o["model"] is not None and o["model"] not in self.model_names:
            raise BadRequest(f"the model {o['model']!r} does not exist; this server has {self.model_names}.",
                             status=404, param="model")
        ids = self.prompt_ids(o, chat)
        max_tokens = o["max_completion_tokens"] if o["max_completion_tokens"] is not None else o["max_tokens"]
        if max_tokens < 1:
            raise BadRequest(f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
        if not 1 <= o["n"] <= MAX_N:
            raise BadRequest(f"n must be between 1 and {MAX_N}, got {o['n']}.", param="n")
        if o["temperature"] < 0 or not 0 < o["top_p"] <= 1 or (o["top_k"] is not None and o["top_k"] < 1):
            raise BadRequest("temperature must be >= 0, top_p in (0, 1] and top_k >= 1.", param="temperature")
        stop = [o["stop"]] if isinstance(o["stop"], str) else list(o["stop"] or [])
        if not all(isinstance(s, str) for s in stop) or len(stop) > 4:
            raise BadRequest("stop must be a string or a list of at most 4 strings.", param="stop")
        temperature = float(o["temperature"])
        seed = o["seed"] if o["seed"] is not None else (secrets.randbits(62) if temperature > 0 else None)
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=o["top_k"],
                                top_p=None if o["top_p"] == 1 else float(o["top_p"]), seed=seed,
                                ignore_eos=o["ignore_eos"], n=o["n"],
                                lora=o["model"] if o["model"] not in (None, self.model_name) else None)
        return ids, params, {"stream": o["stream"], "stop": stop, "usage_in_stream": bool(
            (o["stream_options"] or {}).get("include_usage"))}

    def prompt_ids(self, o: dict, chat: bool) -> list[int]:
        if chat:
            msgs = o["messages"]
            if not msgs or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                   and isinstance(m.get("content"), str) for m in msgs):
                raise BadRequest("messages must be a non-empty list of {role, content} objects with text content.",
                                 param="messages")
            try:
                return self.tok.chat(msgs)
            except ValueError as e:
                raise BadRequest(str(e), param="messages") from None
        p = o["prompt"]
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
            p = p[0]
        if isinstance(p, str):
            return self.tok.encode(p)
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return p
        raise BadRequest("prompt must be a string or a list of token ids (one prompt per request).", param="prompt")

    def submit(self, ids: list[int], params: SamplingParams):
        try:
            return self.runner.submit(ids, params)
        except QueueFull as e:
            raise BadRequest(f"the server is busy: {e}; retry shortly.", status=429, kind="rate_limit_error",
                             headers={"Retry-After": "1"}) from None
        except Closed as e:
            raise BadRequest(str(e), status=503, kind="server_error") from None
        except ValueError as e:  # the engine's own checks: context, vocabulary, pool
            raise BadRequest(str(e).replace("cfx.serve.Engine: ", ""), param="prompt") from None

    # -- running a request ------------------------------------------------------------------------------
    async def events(self, stream, request) -> Any:
        """Each ``StepOutput`` of ``stream`` as it comes; the request aborted if the client goes away."""
        try:
            while True:
                try:
                    out = await asyncio.wait_for(stream.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        self.runner.abort(stream.request_id)
                        return
                    continue
                if out is None:
                    return
                if isinstance(out, BaseException):
                    raise BadRequest("the engine failed; see the server's log.", status=500, kind="server_error")
                yield out
        finally:
            if stream.request_id in self.runner._streams:  # cancelled (a stream's client left): free its blocks
                self.runner.abort(stream.request_id)


def app(runner: EngineThread, tokenizer: Any, *, model_name: str = "cfx") -> Any:
    """The ASGI app (a Starlette application) serving ``runner``'s engine (module doc)."""
    from starlette.applications import Starlette
    from starlette.routing import Route

    metrics = Metrics(runner)
    api = Api(runner, tokenizer, model_name, metrics)
    runner.on_step = metrics.on_step
    routes = [Route("/v1/completions", handlers.completions(api, chat=False), methods=["POST"]),
              Route("/v1/chat/completions", handlers.completions(api, chat=True), methods=["POST"]),
              Route("/v1/models", handlers.models(api), methods=["GET"]),
              Route("/health", handlers.health(api), methods=["GET"]),
              Route("/metrics", handlers.metrics(api), methods=["GET"])]
    return Starlette(routes=routes, exception_handlers={Exception: handlers.internal_error})
