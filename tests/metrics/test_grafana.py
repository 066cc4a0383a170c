"""The Grafana dashboard asks only for metrics the services really export."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from tests.metrics.conftest import get

GRAFANA = Path(__file__).resolve().parents[2] / "dashboards" / "grafana"

PROMQL_WORDS = {
    # aggregations, functions and keywords that can stand where a metric name could
    "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile",
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
    "unless", "offset", "rate", "irate", "increase", "delta", "idelta", "deriv",
    "histogram_quantile", "label_values", "label_replace", "clamp_min", "clamp_max", "abs",
    "avg_over_time", "max_over_time", "min_over_time", "sum_over_time", "time", "vector",
    "scalar", "absent", "inf", "nan",
}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (label matchers, grouping labels,
    ranges, strings and Grafana variables removed)."""
    expr = re.sub(r"label_values\(([^,)]+),[^)]*\)", r"\1", expr)  # Grafana: (metric, label)
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)           # strings
    expr = re.sub(r"\{[^}]*\}", "", expr)                     # label matchers
    expr = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", expr)  # grouping labels
    expr = re.sub(r"\[[^\]]*\]", "", expr)                    # ranges
    expr = re.sub(r"\$\w+", "", expr)                          # Grafana variables
    names = set(re.findall(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)", expr))
    return {n for n in names if n not in PROMQL_WORDS and not re.fullmatch(r"[0-9.e]+", n)}


def dashboard_expressions() -> list[str]:
    dash = json.loads((GRAFANA / "tierstack.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            exprs.append(var["query"]["query"] if isinstance(var["query"], dict) else var["query"])
    return exprs


def exported_names(text: str) -> set[str]:
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            family, kind = line.split()[2:4]
            names.add(family)
            if kind == "histogram":
                names |= {f"{family}_bucket", f"{family}_sum", f"{family}_count"}
        elif line and not line.startswith("#"):
            names.add(re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0))
    return names


def test_the_name_extraction_reads_promql():
    assert metric_names('histogram_quantile(0.99, sum by (le, method) (rate('
                        'tierstack_rpc_duration_seconds_bucket{instance=~"$instance"}[5m])))') == \
        {"tierstack_rpc_duration_seconds_bucket"}
    assert metric_names("sum by (tier) (a_used) / sum by (tier) (b_capacity)") == {"a_used", "b_capacity"}


def test_every_promql_expression_names_metrics_a_real_node_exports(metrics_daemon, traffic):
    traffic.one_pass()
    traffic.store.reports.send()
    exported = exported_names(get(metrics_daemon.url, "/metrics", parse=False))
    exprs = dashboard_expressions()
    assert len(exprs) >= 15
    for expr in exprs:
        names = metric_names(expr)
        assert names, f"no metric in {expr!r}"
        assert names <= exported, f"{expr!r} asks for {sorted(names - exported)}, not exported"


def test_provisioning_points_grafana_at_the_dashboard_and_prometheus():
    dashboards = yaml.safe_load((GRAFANA / "provisioning" / "dashboards.yaml").read_text())
    [provider] = dashboards["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].endswith("tierstack")
    sources = yaml.safe_load((GRAFANA / "provisioning" / "datasources.yaml").read_text())
    assert [s["type"] for s in sources["datasources"]] == ["prometheus"]
    dash = json.loads((GRAFANA / "tierstack.json").read_text())
    assert dash["uid"] and len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
