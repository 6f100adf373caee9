"""The server's endpoints (``http.app``): each a Starlette handler over one ``http.Api``."""
from __future__ import annotations

import json
import logging
import time
from typing import Any

from cfx._src.serve.wire import BadRequest, error_response, new_id, now, sse
from cfx._src.serve.tokens import Detokenizer

log = logging.getLogger("cfx.serve")


def completions(api: Any, *, chat: bool):
    """``POST /v1/completions`` (``chat=False``) or ``/v1/chat/completions``."""
    from starlette.responses import StreamingResponse

    async def endpoint(request):
        try:
            try:
                body = json.loads(await request.body())
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise BadRequest("the request body is not valid JSON.") from None
            ids, params, opts = api.parse(body, chat)
            stream = api.submit(ids, params)
        except BadRequest as e:
            api.metrics.requests.labels(str(e.status)).inc()
            return error_response(e)
        run = Run(api, stream, request, len(ids), params.n, opts, chat)
        if opts["stream"]:
            return StreamingResponse(run.chunks(), media_type="text/event-stream")
        try:
            return await run.whole()
        except BadRequest as e:
            return error_response(e)
    return endpoint


class Run:
    """One request's answer: its samples' text (stop strings applied), timings into the metrics."""

    def __init__(self, api, stream, request, prompt_tokens: int, n: int, opts: dict, chat: bool):
        self.api, self.stream, self.request, self.opts, self.chat = api, stream, request, opts, chat
        self.id, self.created, self.prompt_tokens = new_id(chat), now(), prompt_tokens
        self.dets = [Detokenizer(api.tok, opts["stop"]) for _ in range(n)]
        self.reasons: list[str | None] = [None] * n
        self.last: list[float | None] = [None] * n
        self.completion_tokens = 0

    def take(self, out) -> str:
        """The text ``out`` (a sample's step) adds; its finish reason noted, its timing observed."""
        j, det, t = out.index, self.dets[out.index], time.perf_counter()
        delta = ""
        if out.token is not None and self.reasons[j] is None:
            self.completion_tokens += 1
            if self.last[j] is None:
                self.api.metrics.ttft.observe(t - self.stream.created)
            else:
                self.api.metrics.itl.observe(t - self.last[j])
            self.last[j] = t
            eos = self.api.tok.eos_id is not None and out.token == self.api.tok.eos_id and out.finish_reason == "stop"
            delta = "" if eos else det.add(out.token)
            if det.stopped:
                self.reasons[j] = "stop"
                if len(self.dets) == 1:
                    self.api.runner.abort(self.stream.request_id)  # one sample: its blocks back now
        if out.finished and self.reasons[j] is None:
            delta += det.final()
            self.reasons[j] = "stop" if out.finish_reason == "stop" else "length"
        return delta

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def _head(self) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.api.model_name}

    async def whole(self):
        from starlette.responses import JSONResponse

        texts = [""] * len(self.dets)
        async for out in self.api.events(self.stream, self.request):
            texts[out.index] += self.take(out)
        for j, det in enumerate(self.dets):  # aborted at a stop string: the rest never came
            self.reasons[j] = self.reasons[j] or ("stop" if det.stopped else "length")
        self.api.metrics.requests.labels("200").inc()
        if self.chat:
            choices = [{"index": j, "message": {"role": "assistant", "content": t}, "logprobs": None,
                        "finish_reason": r} for j, (t, r) in enumerate(zip(texts, self.reasons))]
        else:
            choices = [{"index": j, "text": t, "logprobs": None, "finish_reason": r}
                       for j, (t, r) in enumerate(zip(texts, self.reasons))]
        return JSONResponse({"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                             "created": self.created, "model": self.api.model_name, "choices": choices,
                             "usage": self.usage()})

    def _chunk(self, j: int, text: str | None, reason: str | None) -> str:
        if self.chat:
            delta = {} if text is None else {"content": text}
            choice = {"index": j, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": j, "text": text or "", "logprobs": None, "finish_reason": reason}
        return sse({**self._head(), "choices": [choice]})

    async def chunks(self):
        """Server-sent events in OpenAI's chunk format, ``data: [DONE]`` last."""
        if self.chat:
            for j in range(len(self.dets)):
                yield sse({**self._head(), "choices": [{"index": j, "delta": {"role": "assistant", "content": ""},
                                                        "logprobs": None, "finish_reason": None}]})
        done = [False] * len(self.dets)
        try:
            async for out in self.api.events(self.stream, self.request):
                j = out.index
                delta = self.take(out)
                if delta:
                    yield self._chunk(j, delta, None)
                if self.reasons[j] is not None and not done[j]:
                    done[j] = True
                    yield self._chunk(j, None, self.reasons[j])
        except BadRequest as e:
            yield sse({"error": {"message": str(e), "type": e.kind, "code": e.status}})
            return
        for j in range(len(self.dets)):
            if not done[j]:
                yield self._chunk(j, None, "stop" if self.dets[j].stopped else "length")
        if self.opts["usage_in_stream"]:
            yield sse({**self._head(), "choices": [], "usage": self.usage()})
        self.api.metrics.requests.labels("200").inc()
        yield "data: [DONE]\n\n"


def models(api: Any):
    async def endpoint(request):
        from starlette.responses import JSONResponse

        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "cfx",
             **({} if name == api.model_name else {"parent": api.model_name})} for name in api.model_names]})
    return endpoint


def health(api: Any):
    async def endpoint(request):
        from starlette.responses import JSONResponse

        if api.runner.error is not None:
            return JSONResponse({"status": "error", "error": type(api.runner.error).__name__}, status_code=503)
        return JSONResponse({"status": "ok", "running": api.runner.in_flight})
    return endpoint


def metrics(api: Any):
    async def endpoint(request):
        from starlette.responses import Response

        return Response(api.metrics.text(), media_type="text/plain; version=0.0.4")
    return endpoint


async def internal_error(request, exc: Exception):
    """Any error a handler did not expect: logged here, a 500 without a traceback there."""
    log.exception("cfx.serve: %s %s failed", request.method, request.url.path, exc_info=exc)
    return error_response(BadRequest("internal server error; see the server's log.", status=500, kind="server_error"))
