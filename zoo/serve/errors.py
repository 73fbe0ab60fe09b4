"""APIError: a request the server answers with an error, in the OpenAI error shape by default
(serve/anthropic.py and serve/responses.py write it in their own). At the bottom of zoo/serve:
limits.py's `Refused` is one, so every API catches a bound the same way."""
from __future__ import annotations

from typing import Optional

from fastapi.responses import JSONResponse


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=self.headers)
