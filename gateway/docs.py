"""API documentation routes (``/openapi.json``, ``/docs``, ``/redoc``) behind the API key.

FastAPI serves them without any credential; on a keyed gateway they would tell anyone
every route and schema. :func:`keyed_docs` declares them with the gateway's key check
instead (a browser must then send ``Authorization: Bearer KEY`` for ``/openapi.json`` too).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.params import Depends
from fastapi.responses import HTMLResponse, JSONResponse

# FastAPI() arguments that turn its own, unauthenticated documentation routes off.
NO_OPEN_DOCS: dict[str, Any] = {"docs_url": None, "redoc_url": None, "openapi_url": None}


def keyed_docs(app: FastAPI, auth: Sequence[Depends]) -> None:
    """Declare the documentation routes on ``app`` (created with :data:`NO_OPEN_DOCS`),
    each requiring ``auth``."""

    @app.get("/openapi.json", include_in_schema=False, dependencies=auth)
    def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False, dependencies=auth)
    def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - Swagger UI")

    @app.get("/redoc", include_in_schema=False, dependencies=auth)
    def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url="/openapi.json", title=f"{app.title} - ReDoc")
