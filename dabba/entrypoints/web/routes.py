"""The browser pages of `dabba serve`: the playground at / and the dashboard at /dashboard, plain
HTML, CSS and JavaScript inside the package (no build step, nothing fetched from the network);
and the engine snapshots the dashboard draws: GET /engine/stats (one, JSON) and
/engine/stats/stream (server-sent events, engine/stats_feed.py), behind the API key like /v1;
with several models, ``?model=NAME`` picks one (the dashboard lists them from /v1/models).
The pages themselves hold no data and are open; they ask for the key when the server wants one."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from fastapi import Depends, FastAPI
from fastapi.responses import FileResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles

from dabba.engine.protocol import EngineClient
from dabba.entrypoints.openai.errors import OpenAIError

if TYPE_CHECKING:
    from dabba.entrypoints.openai.model_servings import ModelTable

STATIC = Path(__file__).resolve().parent / "static"


def add_web_routes(app: FastAPI, table: "ModelTable", check_api_key: Callable[..., Any]) -> None:
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    def client_of(model: str | None) -> EngineClient:
        """The engine the dashboard watches: ``model``'s (a server of several shows the one asked
        for, loaded; it loads none), else the first loaded."""
        loaded = table.loaded()
        chosen = [s for s in loaded if model is None or s.name == model]
        if not chosen:
            raise OpenAIError(404 if model is None or model not in {c["id"] for c in table.model_list()} else 409,
                              f"the model `{model}` is not loaded" if model else "no model is loaded",
                              param="model", code="model_not_loaded")
        return chosen[0].client

    @app.get("/", include_in_schema=False)
    async def playground():
        return FileResponse(STATIC / "playground.html")

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard():
        return FileResponse(STATIC / "dashboard.html")

    @app.get("/engine/stats", dependencies=[Depends(check_api_key)])
    async def engine_stats(model: str | None = None):
        """The batch, the last step, token totals, the prefix cache and every KV block's state of
        ``model``'s engine (default: the first loaded)."""
        return await client_of(model).get_snapshot()

    # An endless stream: out of the OpenAPI schema, which the reliability suite fuzzes.
    @app.get("/engine/stats/stream", dependencies=[Depends(check_api_key)], include_in_schema=False)
    async def engine_stats_stream(model: str | None = None):
        client = client_of(model)

        async def events():
            async for snapshot in client.watch_stats():
                yield ": idle\n\n" if snapshot is None else f"data: {json.dumps(snapshot)}\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
