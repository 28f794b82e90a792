"""The Python versions Timer says it is tested on are the ones CI tests: every package's
classifiers, the README and the install page name the machine's 3.11 and the versions
``.ci/run`` hands to ``.ci/python``, and ``.ci/python`` knows a Debian root for each."""

from __future__ import annotations

import re
import tomllib

from tests.docs.markdown import DOCS, ROOT

CLASSIFIER = "Programming Language :: Python :: "


def ci_versions() -> list[str]:
    """3.11 (the machine's Python in CI) and the versions .ci/run runs in Debian roots."""
    found = re.search(r"^versions=\(([^)]*)\)$", (ROOT / ".ci" / "run").read_text(), re.M)
    assert found is not None, ".ci/run names its versions in versions=(...)"
    return ["3.11", *found.group(1).split()]


def packages() -> list[str]:
    """The workspace's members: every distribution of the repository."""
    workspace = tomllib.loads((ROOT / "pyproject.toml").read_text())
    members: list[str] = workspace["tool"]["uv"]["workspace"]["members"]
    return members


def test_every_package_declares_the_versions_ci_tests() -> None:
    """requires-python starts at 3.11, and the version classifiers are exactly CI's."""
    expected = {CLASSIFIER + version for version in ci_versions()}
    assert len(packages()) >= 7
    for member in packages():
        project = tomllib.loads((ROOT / member / "pyproject.toml").read_text())["project"]
        assert project["requires-python"] == ">=3.11", member
        declared = {c for c in project["classifiers"] if re.fullmatch(r".*:: 3\.\d+", c)}
        assert declared == expected, member
        assert CLASSIFIER + "3 :: Only" in project["classifiers"], member


def test_the_readme_and_the_install_page_name_them() -> None:
    """Both say "3.11, 3.13 and 3.14" (CI's list), and how to run the suite on one."""
    *first, last = ci_versions()
    named = f"{', '.join(first)} and {last}"
    for page in (ROOT / "README.md", DOCS / "install.md"):
        text = " ".join(page.read_text().split())
        assert f"CPython {named}" in text or f"CPython **{named}**" in text, page
        assert f"sudo .ci/python {last}" in text, page


def test_ci_python_has_a_root_for_each() -> None:
    """.ci/python maps every version .ci/run asks for to a Debian suite."""
    script = (ROOT / ".ci" / "python").read_text()
    for version in ci_versions()[1:]:
        assert re.search(rf"^\s+{re.escape(version)}\) suite=\w+ ;;$", script, re.M), version
