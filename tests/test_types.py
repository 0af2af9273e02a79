"""The package type-checks: mypy over gapless/ with the configuration in pyproject.toml ([tool.mypy]), and
every `# type: ignore` left in it says why.

mypy keeps its cache in .mypy_cache/ (ignored by git): a fresh clone checks from scratch (about a minute
and a quarter on two cores), a later run only what changed.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "gapless"
# an ignore with its error code, then a comment saying why: `# type: ignore[code]  # why`
_IGNORE = re.compile(r"#\s*type:\s*ignore\b(?P<rest>.*)$")
_EXPLAINED = re.compile(r"^\[[a-z-]+(,\s*[a-z-]+)*\]\s+#\s*\S")


def _no_module_exempt() -> list[str]:
    """pyproject's overrides that switch mypy's errors off for some of gapless (none should)."""
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    return [str(o["module"]) for o in config.get("overrides", []) if o.get("ignore_errors")]


@pytest.mark.slow  # (~60 s with a cold mypy cache, as on a clean checkout)
def test_mypy_clean():
    pytest.importorskip("mypy", reason="the type check needs mypy (the `test` extra installs it)")
    done = subprocess.run(
        [sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, f"mypy found errors:\n{done.stdout}{done.stderr}"


def test_no_part_of_the_package_is_exempt_from_the_check():
    assert not _no_module_exempt(), "mypy's errors are switched off for these: fix them instead"


def test_every_type_ignore_says_why():
    unexplained = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            found = _IGNORE.search(line)
            if found and not _EXPLAINED.match(found["rest"]):
                unexplained.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not unexplained, "each `# type: ignore[code]` needs a `# why` after it:\n" + "\n".join(unexplained)


def test_the_ignore_check_tells_an_explained_ignore_from_a_bare_one():
    def explained(line: str) -> bool:
        found = _IGNORE.search(line)
        return bool(found and _EXPLAINED.match(found["rest"]))

    assert explained("x.y = 1  # type: ignore[attr-defined]  # torch's stub lacks it")
    assert not explained("x.y = 1  # type: ignore[attr-defined]")
    assert not explained("x.y = 1  # type: ignore  # no code")
