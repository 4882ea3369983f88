"""The live status page: ``GET /status`` (HTML) polls ``GET /status.json`` every second
(``?interval=MS`` to change it).

The JSON is the scheduler's view of each worker (its running batch, its queue and its KV block
map, from ``Scheduler/GetStats``) and nothing from users' requests beyond their ids and sizes.
Under ``canteen up`` (``--suite-state``) it also lists the suite's processes from the
launcher's state file: each one's state, PID, port and restarts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
from aiohttp import web

from canteen.tools.up.state import read_state
from canteen.v1 import scheduler_pb2, scheduler_pb2_grpc

_CHILD_FIELDS = ("name", "state", "pid", "port", "restarts", "last_exit", "since")


async def status_json(
    scheduler: scheduler_pb2_grpc.SchedulerStub, suite_state: str = ""
) -> dict[str, Any]:
    body: dict[str, Any] = {"suite": suite_json(Path(suite_state))} if suite_state else {}
    try:
        stats = await scheduler.GetStats(scheduler_pb2.GetStatsRequest(), timeout=2)
    except grpc.aio.AioRpcError as exc:
        return {**body, "scheduler": f"unreachable: {exc.code().name}", "workers": []}
    return {**body, "scheduler": "ok", "workers": [_worker_json(w) for w in stats.workers]}


def suite_json(path: Path) -> dict[str, Any]:
    """The processes of the ``canteen up`` that wrote ``path`` (a small local file)."""
    state = read_state(path)
    if state is None:
        return {"state": "unknown", "message": f"no state in {path}", "children": []}
    children = [{k: getattr(c, k) for k in _CHILD_FIELDS} for c in state.children]
    return {"state": state.state, "message": state.message, "children": children}


def _worker_json(w: scheduler_pb2.WorkerStats) -> dict[str, Any]:
    return {
        "worker_id": w.worker_id,
        "model": f"{w.model}:{w.version}",
        "is_ready": w.is_ready,
        "num_running": w.num_running,
        "num_waiting": w.num_waiting,
        "last_batch_size": w.last_batch_size,
        "num_steps": w.num_steps,
        "num_preemptions": w.num_preemptions,
        "prefix_cache_hit_rate": round(w.prefix_cache_hit_rate, 4),
        "speculative": {"draft_tokens": w.num_draft_tokens, "accepted": w.num_accepted_tokens},
        "blocks": {
            "total": w.num_total_blocks,
            "free": w.num_free_blocks,
            "cached": w.num_cached_blocks,
            "map": w.block_map,
        },
        "kv_tiers": {
            "host": {"bytes": w.kv_host_bytes, "blocks": w.num_host_tier_blocks},
            "disk": {"bytes": w.kv_disk_bytes, "blocks": w.num_disk_tier_blocks},
            "offloads": w.num_tier_offloads,
            "reloads": w.num_tier_reloads,
            "failed_reloads": w.num_failed_reloads,
        },
        "running": [
            {
                "request_id": s.request_id,
                "prompt_tokens": s.num_prompt_tokens,
                "output_tokens": s.num_output_tokens,
                "blocks": s.num_blocks,
                "phase": "decode" if s.is_decoding else "prefill",
            }
            for s in w.running
        ],
    }


def status_routes(
    scheduler: scheduler_pb2_grpc.SchedulerStub, suite_state: str = ""
) -> list[web.RouteDef]:
    async def page(_request: web.Request) -> web.Response:
        return web.Response(text=PAGE, content_type="text/html")

    async def data(_request: web.Request) -> web.Response:
        return web.json_response(await status_json(scheduler, suite_state))

    return [web.get("/status", page), web.get("/status.json", data)]


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Canteen status</title>
<style>
body { font: 14px system-ui, sans-serif; margin: 1.5rem; color: #222; }
h1 { font-size: 1.3rem; } h2 { font-size: 1.05rem; margin: 1.2rem 0 .4rem; }
.worker { border: 1px solid #ccc; border-radius: 6px; padding: .8rem 1rem; margin-bottom: 1rem; }
.down { opacity: .55; } .figures span { margin-right: 1.2rem; }
table { border-collapse: collapse; margin-top: .5rem; }
td, th { padding: 2px 10px; border-bottom: 1px solid #eee; text-align: left; }
.map { display: flex; flex-wrap: wrap; gap: 2px; max-width: 820px; margin-top: .5rem; }
.map i { width: 10px; height: 10px; display: block; }
.U { background: #d9480f; } .C { background: #1c7ed6; } .F { background: #dee2e6; }
.legend i { display: inline-block; width: 10px; height: 10px; margin: 0 4px 0 10px; }
#services tr.backoff td, #services tr.down td { color: #c92a2a; }
</style></head>
<body>
<h1>Canteen status <small id="updated"></small></h1>
<div id="suite"></div>
<div id="scheduler"></div>
<div id="workers"></div>
<script>
function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
function renderWorker(w) {
  const box = el("div", {class: "worker" + (w.is_ready ? "" : " down"), id: "w-" + w.worker_id});
  box.appendChild(el("h2", {}, w.worker_id + " - " + w.model + (w.is_ready ? "" : " (not ready)")));
  const fig = el("div", {class: "figures"});
  const b = w.blocks;
  for (const [name, value] of [["running", w.num_running], ["waiting", w.num_waiting],
      ["last batch", w.last_batch_size], ["steps", w.num_steps],
      ["preemptions", w.num_preemptions],
      ["KV used", (b.total - b.free) + "/" + b.total], ["cached", b.cached],
      ["prefix hit rate", (100 * w.prefix_cache_hit_rate).toFixed(1) + "%"],
      ["drafts accepted", w.speculative.draft_tokens ? (100 * w.speculative.accepted /
        w.speculative.draft_tokens).toFixed(1) + "%" : "-"]]) {
    fig.appendChild(el("span", {"data-figure": name}, name + ": " + value));
  }
  box.appendChild(fig);
  const map = el("div", {class: "map", "data-blocks": b.map});
  for (const c of b.map) map.appendChild(el("i", {class: c === "." ? "F" : c}));
  box.appendChild(map);
  const legend = el("div", {class: "legend"});
  for (const [c, name] of [["U", "used"], ["C", "cached"], ["F", "free"]]) {
    legend.appendChild(el("i", {class: c})); legend.appendChild(document.createTextNode(name));
  }
  box.appendChild(legend);
  const table = el("table", {class: "batch"});
  const head = el("tr");
  for (const h of ["request", "phase", "prompt", "output", "blocks"]) {
    head.appendChild(el("th", {}, h));
  }
  table.appendChild(head);
  for (const s of w.running) {
    const row = el("tr", {class: "seq", "data-request-id": s.request_id});
    for (const v of [s.request_id, s.phase, s.prompt_tokens, s.output_tokens, s.blocks]) {
      row.appendChild(el("td", {}, String(v)));
    }
    table.appendChild(row);
  }
  box.appendChild(table);
  return box;
}
function renderSuite(suite) {
  const box = el("div");
  const why = suite.message ? " - " + suite.message : "";
  box.appendChild(el("h2", {}, "services: " + suite.state + why));
  const table = el("table", {id: "services"});
  const head = el("tr");
  for (const h of ["service", "state", "pid", "port", "restarts", "last exit"]) {
    head.appendChild(el("th", {}, h));
  }
  table.appendChild(head);
  for (const c of suite.children) {
    const row = el("tr", {class: "child " + c.state, "data-name": c.name});
    for (const v of [c.name, c.state, c.pid || "-", c.port, c.restarts, c.last_exit || "-"]) {
      row.appendChild(el("td", {}, String(v)));
    }
    table.appendChild(row);
  }
  box.appendChild(table);
  return box;
}
async function refresh() {
  try {
    const r = await fetch("status.json", {cache: "no-store"});
    const s = await r.json();
    document.getElementById("suite").replaceChildren(...(s.suite ? [renderSuite(s.suite)] : []));
    document.getElementById("scheduler").textContent = "scheduler: " + s.scheduler;
    const list = document.getElementById("workers");
    list.replaceChildren(...s.workers.map(renderWorker));
    document.getElementById("updated").textContent = new Date().toLocaleTimeString();
  } catch (e) {
    document.getElementById("scheduler").textContent = "gateway unreachable: " + e;
  }
}
const interval = Number(new URLSearchParams(location.search).get("interval")) || 1000;
refresh();
setInterval(refresh, Math.max(interval, 100));
</script>
</body></html>
"""
