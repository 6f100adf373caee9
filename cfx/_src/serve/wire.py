"""What goes over the wire: OpenAI's error JSON (``BadRequest``), response ids, server-sent events."""
from __future__ import annotations

import json
import time
import uuid
from typing import Any


class BadRequest(ValueError):
    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error", param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.headers = status, kind, param, headers or {}


def error_response(e: BadRequest):
    from starlette.responses import JSONResponse

    body = {"error": {"message": str(e), "type": e.kind, "param": e.param, "code": e.status}}
    return JSONResponse(body, status_code=e.status, headers=e.headers)


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def now() -> int:
    return int(time.time())


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"
