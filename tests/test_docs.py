"""The documentation: the site builds with --strict, the generated pages are current, the configuration reference
says what validation does, nothing points outside the repository, the README stays short, and the built site works
in a real browser (Debian's headless Chromium)."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dynamo.config import ConfigError
from megatron_dynamo.trainer.config import load_run_config

ROOT = Path(__file__).resolve().parent.parent
CPU_DEFAULT = str(ROOT / "configs" / "cpu_default.yaml")


def _script(name: str):
    if name not in sys.modules:  # a dataclass needs its module in sys.modules while the class is made
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def test_readme_is_at_most_150_lines():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 150


def test_generated_pages_are_current(monkeypatch, tmp_path, capsys):
    # In a process of their own: tests register templates and losses of their own in this one.
    for command in (["docs_reference.py", "--check"], ["architecture.py", "--check-docs"]):
        proc = subprocess.run([sys.executable, str(ROOT / "scripts" / command[0]), command[1]], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    reference = _script("docs_reference")
    stale = tmp_path / "config.md"  # a page that no longer matches the dataclasses fails the check
    stale.write_text(reference.CONFIG_PAGE.read_text(encoding="utf-8").replace("dynamo.allocation.n_min", "n_mn"))
    monkeypatch.setattr(reference, "PAGES", {stale: reference.config_page})
    assert reference.main(["--check"]) == 1
    assert "config.md stale: run python scripts/docs_reference.py --write" in capsys.readouterr().err


def test_every_config_key_has_its_meaning_in_the_reference():
    reference = _script("docs_reference")
    keys = [key for _, _, section in reference.config_keys() for key in section]
    assert len(keys) > 100 and all(key.meaning and key.type and key.default for key in keys)
    page = reference.CONFIG_PAGE.read_text(encoding="utf-8")
    for key in keys:
        assert f"### `{key.dotted}`" in page, key.dotted


def _outside(bound: str, default: str) -> str:
    """A value just outside a bound as the docstrings write them: ">= 1", "> 0", "[0, 1]", "(0, 1]", "[0, 1)", "1"."""
    number = r"(-?[\d.e-]+)"
    integer = not re.search(r"[.e]", default)
    if match := re.fullmatch(rf">= {number}", bound):
        return str(int(match.group(1)) - 1 if integer else float(match.group(1)) - 1)
    if match := re.fullmatch(rf"> {number}", bound):
        return match.group(1)
    if match := re.fullmatch(rf"\[{number}, {number}\)", bound):
        return match.group(2)
    if match := re.fullmatch(rf"\({number}, {number}\]", bound):
        return match.group(1)
    if match := re.fullmatch(rf"\[{number}, {number}\]", bound):
        return str(float(match.group(1)) - 1)
    assert re.fullmatch(number, bound), bound
    return str(int(bound) + 1 if integer else float(bound) + 0.5)


def test_the_allowed_values_in_the_reference_are_what_validation_refuses():
    """Every key whose reference names a bound: a value just outside it stops the run, in one line that starts with
    the key. Every choice key: a value outside its list does the same."""
    reference = _script("docs_reference")
    checked = 0
    for _, _, keys in reference.config_keys():
        for key in keys:
            if key.choices:
                value = "no_such_value"
            elif key.bound:
                value = _outside(key.bound, key.default)
            else:
                continue
            with pytest.raises(ConfigError) as info:
                load_run_config(CPU_DEFAULT, [f"{key.dotted}={value}"])
            assert str(info.value).startswith(f"{key.dotted}: "), (key.dotted, value, str(info.value))
            checked += 1
    assert checked > 60, checked


# Machine paths that must not appear in any tracked file; built from parts so that this file holds none of them.
FORBIDDEN = tuple("/".join(parts) for parts in (("", "work", ""), ("", "root", ""), ("", "home", ""),
                                                ("..", "shared"), ("shared", "notes"), ("shared", "seeds"),
                                                ("shared", "data")))


def test_nothing_points_outside_the_repository():
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True).stdout.split("\0")
    found = []
    for name in filter(None, files):
        path = ROOT / name
        if not path.is_file() or path.suffix in (".png", ".whl", ".gz", ".sqsh"):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        found += [f"{name}: {bad}" for bad in FORBIDDEN if bad in text]
    assert not found, "\n".join(found)


def _build(site: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env={"NO_MKDOCS_2_WARNING": "1",
                                                                            "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_site_builds_with_strict(tmp_path):
    _build(tmp_path / "site")
    assert (tmp_path / "site" / "reference" / "config" / "index.html").is_file()


@pytest.mark.slow
def test_site_in_headless_chromium(tmp_path):
    """Every page loads without a console error, every internal link and anchor resolves, the search finds a config
    key; and the same check fails on a page with a script error, a broken link and a missing anchor."""
    check_site = _script("check_site")
    missing = [p for p in (check_site.CHROMIUM, check_site.CHROMEDRIVER) if not Path(p).is_file()]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (scripts/run_tests.sh installs chromium and "
                    "chromium-driver as root)")
    site = tmp_path / "site"
    _build(site)
    assert check_site.check(site, "max_overflow_share", tmp_path / "shots") == []
    assert (tmp_path / "shots" / "config_reference.png").stat().st_size > 10_000
    broken = tmp_path / "broken"
    shutil.copytree(site, broken)
    page = broken / "testing" / "index.html"
    page.write_text(page.read_text(encoding="utf-8").replace(
        "</body>", '<script>throw new Error("planted")</script><a href="../nowhere/">x</a>'
                   '<a href="../algorithm/#no-such-anchor">y</a></body>'), encoding="utf-8")
    problems = check_site.check(broken, "max_overflow_share", None)
    assert any("testing/: console error:" in p and "planted" in p for p in problems), problems
    assert any("broken link /nowhere/" in p for p in problems), problems
    assert any("no anchor #no-such-anchor" in p for p in problems), problems
