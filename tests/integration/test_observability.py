"""docs/metrics.md, the example alerting rules and the Grafana dashboard, against the /metrics
page of a relay running in a thread with an event intake's metrics on it: the page of docs
names exactly the metrics exposed, every expression parses (promql-parser, a port of
Prometheus's own parser) and selects only metrics exposed; and the lag is there from the first
scrape."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from outbox.category import DEFAULT_CATEGORIES
from relay.http import start_http_server
from relay.intake import Intake
from relay.metrics import BUILT_IN_CATEGORIES, RelayMetrics
from relay.testing import FakeSender
from tests.support.db import Backend
from tests.support.inprocess import OUTBOX, relay_for, running
from tests.support.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "metrics.md"
RULES = ROOT / "examples" / "observability" / "alerts.yml"
DASHBOARD = ROOT / "examples" / "observability" / "grafana-dashboard.json"

PROMETHEUS_OWN = frozenset({"up"})  # made by Prometheus for each target it scrapes
# Grafana's variables, replaced by what Grafana would put there before the query is sent
GRAFANA_VARIABLES = {"$__rate_interval": "5m"}
# how the text format names a family's samples
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}
PROBE_CODES = {
    "/healthz": ("ok", "starting", "stalled", "stopped"),
    "/readyz": ("ok", "draining", "paused", "database_unreachable"),
}


class Page:
    """A /metrics page: ``families`` (name as the parser has it: type), ``samples``."""

    def __init__(self, body: str) -> None:
        families = list(text_string_to_metric_families(body))
        self.families = {f.name: f.type for f in families}
        self.samples = {
            (s.name, frozenset(s.labels.items())): s.value for f in families for s in f.samples
        }

    def documented_names(self) -> dict[str, str]:
        """Each metric by the name a reference gives it (a counter's with ``_total``, a
        histogram's without its suffixes): its type."""
        return {
            name + ("_total" if kind == "counter" else ""): kind
            for name, kind in self.families.items()
        }

    def sample_names(self) -> set[str]:
        """Every name a query may select: a counter's ``_total``, a histogram's three."""
        return {
            name + suffix
            for name, kind in self.families.items()
            for suffix in SUFFIXES.get(kind, ("",))
        }

    def named(self, name: str) -> dict[frozenset[tuple[str, str]], float]:
        return {labels: v for (n, labels), v in self.samples.items() if n == name}


@contextmanager
def exposing(backend: Backend, **metrics_options: Any) -> Iterator[Any]:
    """A relay running on a thread, an intake's metrics on its registry (the intake does not
    run: its metrics are there all the same), served on a free port; yields ``scrape()``."""
    relay = relay_for(backend, FakeSender())
    intake = Intake(engine=backend.engine, client=None, queue_url="https://sqs.example/1/q")
    metrics = RelayMetrics(relay, lag_interval=0.0, intake=intake, **metrics_options)
    server = start_http_server(relay, metrics, 0, "127.0.0.1")

    def scrape() -> Page:
        url = f"http://127.0.0.1:{server.port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            return Page(response.read().decode())

    try:
        with running(relay):
            wait_for(lambda: relay.loop_at is not None, what="the relay's first pass")
            yield scrape
    finally:
        server.stop()
        metrics.close()


# -- what the files say ------------------------------------------------------------------------


def rules() -> list[dict[str, Any]]:
    return [
        rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
    ]


def dashboard_panels() -> list[dict[str, Any]]:
    return json.loads(DASHBOARD.read_text())["panels"]


def doc_sections() -> dict[str, str]:
    """docs/metrics.md's ``### `name``` sections: their text."""
    parts = re.split(r"^### `([a-z_:]+)`\n", DOC.read_text(), flags=re.MULTILINE)
    return {name: text for name, text in zip(parts[1::2], parts[2::2], strict=True)}


def expressions() -> dict[str, str]:
    """Every PromQL expression of the rules, the dashboard and docs/metrics.md, by where."""
    found = {f"alerts.yml {r['alert']}": r["expr"] for r in rules()}
    for panel in dashboard_panels():
        for target in panel["targets"]:
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            found[f"dashboard {panel['title']} {target['refId']}"] = expr
    blocks = re.findall(r"^```promql\n(.*?)^```", DOC.read_text(), re.MULTILINE | re.DOTALL)
    found |= {f"metrics.md #{n}": block for n, block in enumerate(blocks)}
    return found


def selected(expr: str) -> set[str]:
    """The metric names ``expr`` selects, parsed by promql-parser (ValueError if it does not
    parse)."""
    names: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            by_matcher = [
                m.value
                for m in node.matchers.matchers
                if m.name == "__name__" and m.op == promql_parser.MatchOp.Equal
            ]
            assert node.name or by_matcher, f"a selector without a metric name: {node}"
            names.update([node.name] if node.name else by_matcher)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


# -- the lag from the first scrape ------------------------------------------------------------


def test_lag_and_due_are_zero_for_each_known_category_from_the_first_scrape(backend):
    """On an idle outbox, ``max(outbox_lag_seconds) > X`` has a series to compare from the
    start: the built-in categories and those the relay is given, at 0."""
    assert {c.name for c in DEFAULT_CATEGORIES} == BUILT_IN_CATEGORIES  # the relay's copy
    with exposing(backend, categories=OUTBOX.categories) as scrape:
        page = scrape()
    idle = {frozenset({("category", c)}): 0.0 for c in ("default", "transactional", "digest")}
    assert page.named("outbox_lag_seconds") == idle
    assert page.named("outbox_due_messages") == idle


# -- the reference page -----------------------------------------------------------------------


def test_the_reference_names_exactly_the_metrics_a_relay_and_its_intake_expose(backend):
    with exposing(backend) as scrape:
        exposed = scrape().documented_names()
    sections = doc_sections()
    assert sorted(sections) == sorted(exposed)
    documented_types = {
        name: text.split()[0].strip(",;").lower() for name, text in sections.items()
    }
    assert documented_types == exposed, "each section opens with its metric's type"


def test_the_reference_has_a_query_for_every_metric():
    for name, text in doc_sections().items():
        assert "```promql\n" in text, name


@pytest.mark.parametrize("path", sorted(PROBE_CODES))
def test_the_reference_gives_every_code_word_of_each_probe(path):
    (row,) = [line for line in DOC.read_text().splitlines() if line.startswith(f"| `{path}` |")]
    assert all(f"`{code}`" in row for code in PROBE_CODES[path]), row


# -- the rules and the dashboard --------------------------------------------------------------


def test_every_metric_a_rule_a_panel_or_the_reference_queries_is_exposed(backend):
    with exposing(backend) as scrape:
        exposed = scrape().sample_names() | PROMETHEUS_OWN
    queried = {where: selected(expr) for where, expr in expressions().items()}
    assert {where: names - exposed for where, names in queried.items() if names - exposed} == {}
    assert {n for names in queried.values() for n in names if n.startswith("outbox_")}


@pytest.mark.parametrize("where", sorted(expressions()))
def test_every_expression_parses(where):
    expr = expressions()[where]
    assert "$" not in expr, "a Grafana variable left unreplaced"
    promql_parser.parse(expr)


def test_every_alert_has_a_duration_a_severity_and_a_summary():
    found = rules()
    assert len({r["alert"] for r in found}) == len(found), "alert names are unique"
    for rule in found:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        promql_parser.parse_duration(rule["for"])
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"].strip(), rule["alert"]


def test_the_alerts_cover_what_operators_are_paged_for():
    queried = {r["alert"]: selected(r["expr"]) for r in rules()}
    used = set().union(*queried.values())
    assert {
        "outbox_lag_seconds",
        "outbox_messages_total",
        "outbox_event_intake_lag_seconds",
        "outbox_event_intake_errors_total",
        "outbox_bounce_rate",
        "outbox_complaint_rate",
        "outbox_relay_info",
        "outbox_paused",
        "outbox_scope_paused",
        "up",
    } <= used


def test_the_dashboard_panels_query_prometheus_through_its_variable():
    board = json.loads(DASHBOARD.read_text())
    (variable,) = board["templating"]["list"]
    assert (variable["type"], variable["name"], variable["query"]) == (
        "datasource",
        "datasource",
        "prometheus",
    )
    panels = board["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
