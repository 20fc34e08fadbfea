#!/usr/bin/env python3
"""Checks tools/grafana/kvshard-dashboard.json against a /metrics scrape.

Usage: check-dashboard.py URL_OR_FILE [--dashboard FILE]

URL_OR_FILE is a live endpoint (http://host:port/metrics) or a file holding a
scrape. The dashboard must be well-formed (valid JSON, an importable shape with a
${DS_PROMETHEUS} datasource input, unique panel ids, every query with a refId),
and every metric name its PromQL expressions and variable queries use must be
in the scrape. Series that exist only with an L2 adapter (`l2_name` labels,
kvshard_s3_*) need a server started with an fs and an s3 adapter.

Exits 0 when all holds, 1 with one line per problem otherwise, 2 on bad usage
or an unreachable scrape.
"""

import argparse
import json
import os
import re
import sys
import urllib.request

DEFAULT_DASHBOARD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kvshard-dashboard.json")

# PromQL words that look like metric names: aggregations, their modifiers,
# binary operators and vector-matching keywords. Functions are recognized by the
# `(` that follows them.
PROMQL_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool",
    "and", "or", "unless", "offset", "inf", "nan",
}
IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def read_scrape(source):
    """The text of a /metrics scrape, from a URL or a file."""
    if re.match(r"^https?://", source):
        with urllib.request.urlopen(source, timeout=10) as resp:
            return resp.read().decode("utf-8")
    with open(source, encoding="utf-8") as f:
        return f.read()


def scrape_names(text):
    """Metric names with at least one sample in a Prometheus text exposition."""
    names = set()
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = IDENT.match(line)
        if m:
            names.add(m.group(0))
    return names


def promql_metric_names(expr):
    """Metric names an expression selects.

    Strips what cannot hold a metric name (string literals, label matchers,
    range and subquery brackets, Grafana variables, grouping label lists), then
    keeps the identifiers that are neither functions (followed by `(`) nor
    PromQL keywords.
    """
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"'(?:[^'\\]|\\.)*'", "''", e)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\$\{[^}]*\}|\$[A-Za-z0-9_]+", " ", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    names = set()
    for m in IDENT.finditer(e):
        word = m.group(0)
        if m.start() > 0 and (e[m.start() - 1].isdigit() or e[m.start() - 1] == "."):
            continue  # the tail of a number such as 1e3
        if word.lower() in PROMQL_KEYWORDS:
            continue
        if re.match(r"\s*\(", e[m.end():]):
            continue  # a function or aggregation
        names.add(word)
    return names


def variable_metric_names(query):
    """Metric names of a Grafana Prometheus variable query (label_values, query_result, metrics)."""
    if isinstance(query, dict):
        query = query.get("query", "")
    if not isinstance(query, str):
        return set()
    m = re.match(r"^\s*label_values\s*\((.*)\)\s*$", query, re.S)
    if m:
        inner = m.group(1)
        # label_values(metric_or_selector, label) or label_values(label)
        parts = inner.rsplit(",", 1)
        return promql_metric_names(parts[0]) if len(parts) == 2 else set()
    m = re.match(r"^\s*query_result\s*\((.*)\)\s*$", query, re.S)
    if m:
        return promql_metric_names(m.group(1))
    return set()


def walk_panels(panels):
    for p in panels:
        yield p
        yield from walk_panels(p.get("panels", []))


def check_dashboard(dash, problems):
    """Structural checks; returns [(where, expr)] of every PromQL expression."""
    if not isinstance(dash, dict):
        problems.append("the dashboard is not a JSON object")
        return []
    for key in ("title", "uid", "panels", "schemaVersion"):
        if key not in dash:
            problems.append(f"the dashboard has no {key!r}")
    if not isinstance(dash.get("schemaVersion"), int):
        problems.append("schemaVersion is not an integer")
    inputs = [i.get("name") for i in dash.get("__inputs", []) if i.get("type") == "datasource"]
    if "DS_PROMETHEUS" not in inputs:
        problems.append("no DS_PROMETHEUS datasource in __inputs")
    exprs = []
    ids = set()
    for p in walk_panels(dash.get("panels", [])):
        pid = p.get("id")
        title = p.get("title", "?")
        if pid in ids:
            problems.append(f"panel id {pid} ({title}) is used twice")
        ids.add(pid)
        grid = p.get("gridPos", {})
        if not all(isinstance(grid.get(k), int) for k in ("h", "w", "x", "y")):
            problems.append(f"panel {title!r} has no whole gridPos")
        elif grid["x"] + grid["w"] > 24:
            problems.append(f"panel {title!r} is wider than the 24-column grid")
        if p.get("type") == "row":
            continue
        ds = p.get("datasource", {})
        if ds.get("uid") != "${DS_PROMETHEUS}":
            problems.append(f"panel {title!r} does not use ${{DS_PROMETHEUS}}")
        targets = p.get("targets", [])
        if not targets:
            problems.append(f"panel {title!r} has no query")
        refs = [t.get("refId") for t in targets]
        if len(set(refs)) != len(refs) or None in refs:
            problems.append(f"panel {title!r} has missing or repeated refIds")
        for t in targets:
            expr = t.get("expr")
            if not isinstance(expr, str) or not expr.strip():
                problems.append(f"panel {title!r} query {t.get('refId')} has no expr")
                continue
            if expr.count("(") != expr.count(")") or expr.count("{") != expr.count("}"):
                problems.append(f"panel {title!r} query {t.get('refId')}: unbalanced brackets: {expr}")
            exprs.append((f"panel {title!r} query {t.get('refId')}", expr))
    return exprs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("scrape", metavar="URL_OR_FILE", help="a /metrics URL or a file holding a scrape")
    ap.add_argument("--dashboard", default=DEFAULT_DASHBOARD, help="the dashboard JSON (default: %(default)s)")
    args = ap.parse_args()

    problems = []
    try:
        with open(args.dashboard, encoding="utf-8") as f:
            dash = json.load(f)
    except (OSError, ValueError) as e:
        print(f"{args.dashboard}: not a readable JSON file: {e}", file=sys.stderr)
        return 1
    try:
        text = read_scrape(args.scrape)
    except OSError as e:
        print(f"{args.scrape}: cannot read the scrape: {e}", file=sys.stderr)
        return 2
    exported = scrape_names(text)
    if not exported:
        print(f"{args.scrape}: no samples in the scrape", file=sys.stderr)
        return 1

    used = {}
    for where, expr in check_dashboard(dash, problems):
        for name in promql_metric_names(expr):
            used.setdefault(name, where)
    for var in dash.get("templating", {}).get("list", []):
        for name in variable_metric_names(var.get("query")):
            used.setdefault(name, f"variable {var.get('name')!r}")
    if not used:
        problems.append("no metric name found in the dashboard's queries")
    for name in sorted(used):
        if name not in exported:
            problems.append(f"{name} (in {used[name]}) is not in the scrape")

    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        return 1
    print(f"ok: {len(used)} metric names in {args.dashboard}, all in the scrape of {args.scrape}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
