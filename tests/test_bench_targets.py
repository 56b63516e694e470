"""docs/bench.md lists every target tools/bench.py checks, with its limit."""

from __future__ import annotations

import re
from pathlib import Path

from tools.bench import TARGETS

PAGE = Path(__file__).resolve().parent.parent / "docs" / "bench.md"


def test_the_targets_table_is_the_benchmarks_dictionary():
    rows = re.findall(r"^\| `(\w+)` \| .+? \| [≤≥<]? ?([\d.,]+) \|$", PAGE.read_text(), re.M)
    listed = {key: float(limit.replace(",", "")) for key, limit in rows}
    assert listed == {key: float(value) for key, value in TARGETS.items()}
