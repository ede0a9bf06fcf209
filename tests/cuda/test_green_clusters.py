"""A green context's process leaves thread block clusters (cuda/green.py ``without_clusters``):
the hyper-connection mixes (whose bits the clusters set) and the QSA selections (the same output
either way) both turn them off; the return value says whether the mixes had them."""

from __future__ import annotations

from types import SimpleNamespace

from mgserve.cuda.green import without_clusters


def test_mixes_and_selections_leave_clusters() -> None:
    b = SimpleNamespace(hc=SimpleNamespace(cluster=True), qsa=SimpleNamespace(cluster=True))
    assert without_clusters(b) is True
    assert b.hc.cluster is False and b.qsa.cluster is False
    assert without_clusters(b) is False  # nothing left on


def test_selections_alone_and_backends_without_the_families() -> None:
    b = SimpleNamespace(hc=SimpleNamespace(cluster=False), qsa=SimpleNamespace(cluster=True))
    assert without_clusters(b) is False and b.qsa.cluster is False
    assert without_clusters(SimpleNamespace()) is False
