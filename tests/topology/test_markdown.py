"""The docs agree with the code: docs/topology.md holds the tables autopar/topology/markdown.py makes."""

from __future__ import annotations

from pathlib import Path

from autopar import topology as topo

REPO = Path(__file__).resolve().parents[2]


def test_docs_table_matches_code():
    text = (REPO / "docs" / "topology.md").read_text()
    assert topo._markdown_table() in text, "regenerate the table in docs/topology.md from topology._markdown_table()"
    assert topo._markdown_names() in text, "regenerate the names table in docs/topology.md from _markdown_names()"
