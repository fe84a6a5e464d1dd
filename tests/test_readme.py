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


def test_the_tinker_cookbook_commands_are_those_that_work():
    """What bench/tinker_cookbook.py runs (docs/TINKER.md measures it), the setup that installs the cookbook,
    and the command that writes a model folder outside Echo2's data, as the README gives them."""
    root = Path(__file__).resolve().parents[1]
    block = README.split("**tinker-cookbook recipes**", 1)[1].split("```bash\n", 1)[1].split("\n```", 1)[0]
    words = block.replace("\\\n", " ").split()
    assert block.startswith("COOKBOOK=1 scripts/setup_tinker_venv.sh")
    assert 'COOKBOOK:-0}" == "1"' in (root / "scripts/setup_tinker_venv.sh").read_text()
    fixed = re.findall(r'"((?:renderer_name|loss_fn|env)=[a-z_0-9]+)"', (root / "bench/tinker_cookbook.py").read_text())
    assert len(fixed) == 3 and set(fixed) <= set(words)
    import_at = words.index("import-smollm2")
    from server.cli import _parser

    args = _parser().parse_args(words[import_at - 1:import_at + 3])
    assert args.model_command == "import-smollm2" and f"model_name={args.out.replace('~', '$HOME')}" in words
