"""The monitoring files, checked with promtool: Prometheus's config, rules and rule tests,
and the Grafana dashboard, whose queries may use only the metrics the services export."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml  # PyYAML, via transformers and kubernetes-validate

from tests.support.deploy import CANTEEN_METRICS, DASHBOARD, GRAFANA, PROMETHEUS

# Labels Prometheus adds to every scraped series (plus `service` from our scrape config).
TARGET_LABELS = frozenset({"instance", "job", "service"})


def series_names() -> dict[str, str]:
    """Every series name a query may use -> the metric (histograms: _bucket, _sum, _count)."""
    names = {}
    for name, (_, kind, _) in CANTEEN_METRICS.items():
        suffixes = ("_bucket", "_sum", "_count") if kind == "histogram" else ("",)
        names.update({name + s: name for s in suffixes})
    return names


# --- Prometheus -------------------------------------------------------------------------


def promtool(*args: str, cwd: Path = PROMETHEUS) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("promtool") or "/usr/bin/promtool"
    return subprocess.run([binary, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_promtool_check_config() -> None:
    result = promtool("check", "config", "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 rule files found" in result.stdout


def test_promtool_check_rules() -> None:
    result = promtool("check", "rules", "canteen.rules.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_rule_unit_tests() -> None:
    result = promtool("test", "rules", "canteen.rules.test.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def rule_exprs() -> list[str]:
    rules = yaml.safe_load((PROMETHEUS / "canteen.rules.yml").read_text())
    return [r["expr"] for g in rules["groups"] for r in g["rules"]]


def test_rules_use_only_exported_metrics() -> None:
    exprs = rule_exprs()
    check_metric_references(exprs)
    names = {n for e in exprs for n in referenced_metrics(e)}
    for required in (
        "canteen_time_to_first_token_seconds",
        "canteen_requests_total",
        "canteen_kv_blocks",
        "canteen_worker_ready",
    ):
        assert required in names


# --- Grafana ----------------------------------------------------------------------------

_METRIC = re.compile(r"(?<![\w:])canteen_[a-z0-9_]+(?![\w:])")
_SELECTOR = re.compile(r"(?<![\w:])(canteen_[a-z0-9_]+)\{([^}]*)\}")
_MATCHER = re.compile(r"(\w+)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
# Dashboard variables, replaced as Grafana would before a query runs.
_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$model": ".*", "$worker": ".*"}


def referenced_metrics(expr: str) -> set[str]:
    series = series_names()
    unknown = set(_METRIC.findall(expr)) - set(series)
    assert not unknown, f"not exported: {unknown} in {expr}"
    return {series[m] for m in _METRIC.findall(expr)}


def check_metric_references(exprs: list[str]) -> None:
    """Every canteen_* series exists, and every label a query names is one it carries."""
    series = series_names()
    for expr in exprs:
        metrics = referenced_metrics(expr)
        for name, matchers in _SELECTOR.findall(expr):
            labels = {*CANTEEN_METRICS[series[name]][2], *TARGET_LABELS}
            if name.endswith("_bucket"):
                labels.add("le")
            used = set(_MATCHER.findall(matchers))
            assert used <= labels, f"{name} has no labels {used - labels}: {expr}"
        available = {"le", *TARGET_LABELS}.union(*(CANTEEN_METRICS[m][2] for m in metrics))
        for group in _GROUPING.findall(expr):
            used = {g.strip() for g in group.split(",") if g.strip()}
            assert used <= available, f"no labels {used - available} to group by: {expr}"


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            out.extend(panel.get("panels", []))
        else:
            out.append(panel)
    return out


def dashboard_exprs(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in panels(dashboard) for t in p["targets"]]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            exprs.append(variable["query"]["query"])
    return exprs


# Panel title (a substring) -> the series its queries must use (and quantiles for latency).
REQUIRED_PANELS: dict[str, tuple[str, ...]] = {
    "Time to first token": ("canteen_time_to_first_token_seconds_bucket",),
    "Time per output token": ("canteen_time_per_output_token_seconds_bucket",),
    "Inter-token latency": ("canteen_inter_token_latency_seconds_bucket",),
    "End-to-end request latency": ("canteen_e2e_request_latency_seconds_bucket",),
    "Request throughput": ("canteen_requests_total",),
    "Token throughput": ("canteen_prompt_tokens_total", "canteen_generation_tokens_total"),
    "Queue time": ("canteen_queue_time_seconds_bucket",),
    "Running and waiting requests": ("canteen_running_requests", "canteen_waiting_requests"),
    "KV cache usage per worker": ("canteen_kv_blocks", "canteen_kv_blocks_capacity"),
    "Prefix cache hit rate": ("canteen_prefix_cache_hit_rate",),
    "Errors by status": ("canteen_requests_total",),
    "Worker readiness": ("canteen_worker_ready",),
    "Preemptions": ("canteen_preemptions_total",),
}
LATENCY_PANELS = (
    "Time to first token",
    "Time per output token",
    "Inter-token latency",
    "End-to-end request latency",
    "Queue time",
)


def test_dashboard_is_a_grafana_dashboard(dashboard: dict[str, Any]) -> None:
    assert dashboard["title"] and dashboard["uid"]
    assert 36 <= dashboard["schemaVersion"] <= 41
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    datasource = variables["DS_PROMETHEUS"]
    assert datasource["type"] == "datasource" and datasource["query"] == "prometheus"
    provisioned = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yml").read_text())
    assert datasource["current"]["value"] == provisioned["datasources"][0]["uid"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24
        mine = {
            (x, y)
            for x in range(pos["x"], pos["x"] + pos["w"])
            for y in range(pos["y"], pos["y"] + pos["h"])
        }
        assert not mine & cells, f"{panel['title']} overlaps another panel"
        cells |= mine
    for panel in panels(dashboard):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
        refs = [t["refId"] for t in panel["targets"]]
        assert panel["targets"] and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"]


def test_dashboard_has_the_panels(dashboard: dict[str, Any]) -> None:
    by_title = {p["title"]: p for p in panels(dashboard)}
    for title, series in REQUIRED_PANELS.items():
        matching = [p for t, p in by_title.items() if title.lower() in t.lower()]
        assert matching, f"no panel {title!r}"
        exprs = " ".join(t["expr"] for t in matching[0]["targets"])
        for name in series:
            assert re.search(rf"\b{name}\b", exprs), f"{title}: does not use {name}"
    for title in LATENCY_PANELS:
        panel = next(p for t, p in by_title.items() if title.lower() in t.lower())
        quantiles = {
            float(q)
            for t in panel["targets"]
            for q in re.findall(r"histogram_quantile\(\s*([\d.]+)", t["expr"])
        }
        assert quantiles == {0.5, 0.9, 0.99}, title
        assert all("rate(" in t["expr"] for t in panel["targets"])
        assert panel["fieldConfig"]["defaults"]["unit"] == "s"


def test_dashboard_queries_use_only_exported_metrics(dashboard: dict[str, Any]) -> None:
    check_metric_references(dashboard_exprs(dashboard))


def test_dashboard_queries_parse_with_promtool(dashboard: dict[str, Any], tmp_path: Path) -> None:
    exprs = [t["expr"] for p in panels(dashboard) for t in p["targets"]]
    rules = []
    for i, expr in enumerate(exprs):
        for variable, value in _VARIABLES.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, f"unknown variable in {expr}"
        rules.append({"record": f"dashboard:query_{i}", "expr": expr})
    path = tmp_path / "dashboard.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = promtool("check", "rules", str(path), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout


def test_promtool_catches_a_bad_query(tmp_path: Path) -> None:
    # The check above can fail: promtool rejects a query that does not parse.
    path = tmp_path / "bad.rules.yml"
    path.write_text(
        yaml.safe_dump(
            {
                "groups": [
                    {
                        "name": "g",
                        "rules": [
                            {
                                "record": "x:y",
                                "expr": "histogram_quantile(0.9, sum by (le) (rate(m_bucket[1m]))",
                            }
                        ],
                    }
                ]
            }
        )
    )
    assert promtool("check", "rules", str(path), cwd=tmp_path).returncode != 0
