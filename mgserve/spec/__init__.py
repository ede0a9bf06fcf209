"""n-gram speculation: drafts from each session's own tokens (ngram.py), gated where they pay
(gate.py), as the scheduler's ``Drafter`` (speculator.py), counted for /metrics (stats.py)."""

from mgserve.spec.speculator import Speculator, speculator_from
from mgserve.spec.stats import SpecStats

__all__ = ["SpecStats", "Speculator", "speculator_from"]
