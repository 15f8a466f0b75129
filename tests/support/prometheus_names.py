"""Metric names: the series names a Prometheus exposition has, and the ones a PromQL query uses.

A family exposes several series: a counter `x` as `x_total` (and `x_created`), a histogram as
`x_bucket`, `x_sum`, `x_count`. Queries name series; `series_names` expands families so the
two can be compared.
"""

from __future__ import annotations

import re

SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("_sum", "_count", "_created", ""),
    "gauge": ("",),
    "info": ("_info",),
    "unknown": ("",),
}

# A PromQL metric name of ours: every meshllm metric carries the `meshllm:` prefix.
_QUERY_NAME = re.compile(r"\bmeshllm:[a-zA-Z_][a-zA-Z0-9_:]*")
_TYPE_LINE = re.compile(r"^# TYPE (\S+) (\S+)$", re.MULTILINE)
_SAMPLE_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{|\s)", re.MULTILINE)


def series_names(families: dict[str, str]) -> set[str]:
    """family name -> type, to every series name those families expose."""
    out: set[str] = set()
    for name, kind in families.items():
        if kind == "counter" and name.endswith("_total"):
            # prometheus-client 0.26 declares a labelled counter with no sample yet under its
            # series name (`# TYPE x_total counter`), not its family name.
            name = name.removesuffix("_total")
        out.update(name + suffix for suffix in SUFFIXES.get(kind, ("",)))
    return out


def exposition_names(text: str) -> set[str]:
    """Series names in a /metrics text: its samples, and the families its TYPE lines declare
    (a labelled family with no sample yet still says what it will expose)."""
    families = dict(_TYPE_LINE.findall(text))
    return series_names(families) | set(_SAMPLE_LINE.findall(text))


def query_names(query: str) -> set[str]:
    """The meshllm series a PromQL expression reads (`rate(x[5m])`, `x{a="b"}`, `x_bucket`)."""
    return set(_QUERY_NAME.findall(query))
