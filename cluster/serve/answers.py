"""The service's error answer, one shape for every route: `{"detail": <message>}` with the HTTP status,
as FastAPI answers its own errors and as the tinker SDK reads them (`APIStatusError.message`)."""

from __future__ import annotations

from fastapi.responses import JSONResponse


def error(status: int, detail: str) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status)
