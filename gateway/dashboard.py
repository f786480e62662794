"""The live status page: /dashboard (one static HTML page, no build step, nothing fetched from
elsewhere) and /dashboard/data, the JSON it polls every second.

The data is what the gateway already has: the nodes' latest GetLoad answers (health, role,
running and waiting requests, KV blocks, generated tokens/s) from the registry's polling, and
the last minute of client-side latencies (gateway/live_stats.py), overall and per decode node.
The page keeps the history it plots itself, so the gateway stores no time series.
"""

from __future__ import annotations

import time
from functools import cache
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse

from pdserve.gateway.context import GatewayContext
from pdserve.gateway.live_stats import LiveStats
from pdserve.gateway.registry import NodeState

PAGE = Path(__file__).with_name("static") / "dashboard.html"


@cache
def _page() -> str:
    return PAGE.read_text()


def node_status(node: NodeState, live: LiveStats, now_s: float) -> dict[str, Any]:
    """One node as the status page shows it (load fields are absent until its first poll)."""
    entry: dict[str, Any] = {
        "address": node.address,
        "role": node.role,
        "healthy": node.healthy,
        "last_error": node.last_error,
        "gateway_in_flight": node.num_inflight,
    }
    load = node.load
    if load is not None:
        total = max(load.num_total_blocks, 1)
        entry.update(
            node_id=load.node_id,
            accepting=load.accepting,
            num_running=load.num_running,
            num_waiting=load.num_waiting,
            num_free_blocks=load.num_free_blocks,
            num_total_blocks=load.num_total_blocks,
            kv_usage=1.0 - load.num_free_blocks / total,
            generation_tokens_per_s=load.generation_tokens_per_s,
            num_preemptions=load.num_preemptions,
            metrics_address=load.metrics_address,
        )
    if node.role == "decode":
        entry["client_view"] = live.node(node.address).summary(now_s)
    return entry


def dashboard_data(ctx: GatewayContext) -> dict[str, Any]:
    """The JSON of /dashboard/data."""
    now_s = time.monotonic()
    live = ctx.metrics.live
    gateway = {
        "ready": ctx.is_ready(),
        "in_flight": ctx.admission.num_in_flight,
        **live.total.summary(now_s),
    }
    return {
        "time_unix_s": time.time(),
        "model": ctx.model_name,
        "gateway": gateway,
        "nodes": [node_status(node, live, now_s) for node in ctx.registry.nodes],
    }


def add_dashboard_routes(app: FastAPI, ctx: GatewayContext) -> None:
    async def page() -> HTMLResponse:
        return HTMLResponse(_page(), headers={"Cache-Control": "no-cache"})

    async def data() -> JSONResponse:
        return JSONResponse(dashboard_data(ctx), headers={"Cache-Control": "no-store"})

    app.add_api_route("/dashboard", page, methods=["GET"])
    app.add_api_route("/dashboard/data", data, methods=["GET"])
