"""The parsed arguments a CPU bench's ``run`` takes in its tests: the bench's own defaults, not
recorded, with the given values in place."""

from __future__ import annotations

import argparse
from types import ModuleType


def bench_args(bench: ModuleType, **kw: object) -> argparse.Namespace:
    """``mgserve bench NAME``'s namespace for the module ``bench``, ``kw`` set over its defaults."""
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args([])
    args.record = False
    for k, v in kw.items():
        setattr(args, k, v)
    return args
