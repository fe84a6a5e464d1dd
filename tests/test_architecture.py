"""docs/ARCHITECTURE.md is the newcomer's map: every module and folder it names must exist, and it
must stay short enough to read (two pages)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAP = ROOT / "docs" / "ARCHITECTURE.md"
NAMED = re.compile(r"`((?:[\w.-]+/)+[\w.-]*)`")  # `api/services/pool.py`, `api/routes/`
SYMBOL = re.compile(r"`(\w+)\.(\w+)` in `([\w/]+\.py)`")  # `JobSpec.admissible` in `sdk/.../jobs.py`


def test_every_path_the_map_names_exists():
    named = set(NAMED.findall(MAP.read_text()))
    assert len(named) > 40, "the map names the modules it explains"
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert missing == [], f"docs/ARCHITECTURE.md names paths that are gone: {missing}"


def test_every_symbol_the_map_names_is_defined_where_it_says():
    text = MAP.read_text()
    found = SYMBOL.findall(text.replace("\n", " "))
    assert found, "the map names symbols with their module"
    for owner, name, path in found:
        source = (ROOT / path).read_text()
        assert re.search(rf"^class {owner}\b", source, re.M) and re.search(rf"def {name}\b", source), (
            f"{owner}.{name} is not in {path}")


def test_the_map_fits_on_two_pages():
    assert len(MAP.read_text().splitlines()) <= 120  # about two printed pages
