"""Metrics in tests: one sample's value from an engine's registry or from a /metrics text."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples(text: str) -> Samples:
    """Every sample of a /metrics text, by (name, labels)."""
    return {
        (s.name, frozenset(s.labels.items())): float(s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def metric(source: CollectorRegistry | str | Samples, name: str, **labels: str) -> float | None:
    """The value of sample ``name`` with ``labels`` (None: no such sample)."""
    if isinstance(source, CollectorRegistry):
        return source.get_sample_value(name, labels)
    parsed = samples(source) if isinstance(source, str) else source
    return parsed.get((name, frozenset(labels.items())))
