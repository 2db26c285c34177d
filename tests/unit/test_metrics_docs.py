"""The Grafana dashboard and docs/metrics.md name only metrics the collector exposes, and
docs/metrics.md describes every one of them."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from kombu_pgskip.metrics import FAMILIES, PgSkipCollector, exposed_names
from tests.helpers import REPO_ROOT

DASHBOARD = REPO_ROOT / "docs" / "grafana-dashboard.json"
GUIDE = REPO_ROOT / "docs" / "metrics.md"
_METRIC = re.compile(r"\bpgskip_[a-z0-9_]+")


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # the panels of a collapsed row


def _queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every query of the dashboard: its panels' and its query variables'."""
    for panel in _panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r} {target['refId']}", target["expr"]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable["type"] == "query":
            query = variable["query"]
            yield (
                f"variable {variable['name']!r}",
                query["query"] if isinstance(query, dict) else query,
            )


def test_each_dashboard_query_names_metrics_that_exist() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exposed = exposed_names()
    queries = list(_queries(dashboard))
    assert queries
    named: set[str] = set()
    for where, expr in queries:
        metrics = set(_METRIC.findall(expr))
        assert metrics, f"{where}: names no pgskip metric: {expr}"
        assert metrics <= exposed, f"{where}: no such metric {metrics - exposed}: {expr}"
        named |= metrics
    # what the dashboard is for
    assert {
        "pgskip_pending_messages",
        "pgskip_oldest_pending_age_seconds",
        "pgskip_running_messages",
        "pgskip_failed_messages",
        "pgskip_consumers_alive",
        "pgskip_xmin_horizon_age_seconds",
        "pgskip_jobs_table_size_bytes",
        "pgskip_jobs_dead_tuples",
    } <= named
    ids = [panel["id"] for panel in _panels(dashboard["panels"])]
    assert len(ids) == len(set(ids))


def test_the_guide_describes_every_metric_and_names_no_other() -> None:
    text = GUIDE.read_text()
    exposed = exposed_names()
    named = {m for m in _METRIC.findall(text) if not m.endswith("_")}  # not `pgskip_cron_*`
    assert named <= exposed, named - exposed
    for name in exposed:
        assert f"`{name}`" in text, name
    assert "grafana-dashboard.json" in text


def test_describe_yields_every_family_without_reading_the_database() -> None:
    # No server listens on port 1: describe() must not connect.
    collector = PgSkipCollector("pgskip://nobody@127.0.0.1:1/none")
    assert [family.name for family in collector.describe()] == list(FAMILIES)
    assert all(not family.samples for family in collector.describe())
