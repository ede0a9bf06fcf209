"""Metrics in tests: one sample's value from an engine's registry or from a /metrics text."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families


def metric(source: CollectorRegistry | str, name: str, **labels: str) -> float | None:
    """The value of sample ``name`` with ``labels`` (None: no such sample)."""
    if isinstance(source, CollectorRegistry):
        return source.get_sample_value(name, labels)
    for family in text_string_to_metric_families(source):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    return None
