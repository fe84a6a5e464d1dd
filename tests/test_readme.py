"""The README's configuration reference is checked against the settings model."""

import re
from pathlib import Path

from api.settings import Settings

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
SDK_ONLY = {"ECHO2_BASE_URL", "ECHO2_API_KEY"}


def test_every_setting_is_documented_and_nothing_else():
    table = set(re.findall(r"^\| `(ECHO2_[A-Z_]+)` \|", README, re.M))
    fields = {f"ECHO2_{name.upper()}" for name in Settings.model_fields}
    assert fields - table == set(), "settings missing from the README table"
    assert table - fields == set(), "README documents settings that do not exist"
    assert set(re.findall(r"ECHO2_[A-Z_]+", README)) >= SDK_ONLY


def test_readme_opens_with_the_two_commands():
    blocks = re.findall(r"```bash\n(.+?)\n```", README, re.S)
    assert blocks[:2] == ["./scripts/demo.sh", "./scripts/test.sh"]
    assert (Path(__file__).resolve().parents[1] / ".ci/run").read_text().count("scripts/test.sh") == 1
