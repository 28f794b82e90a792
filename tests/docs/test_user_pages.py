"""What a reader of the site and the READMEs gets is the product's, not its making's: no
reference to an issue, a commit or a work session."""

from __future__ import annotations

import re
from pathlib import Path

from tests.docs.markdown import DOCS, ROOT

#: Pulled into a page by pymdownx.snippets: ``--8<-- "path"``.
_SNIPPET = re.compile(r'^--8<-- "([^"]+)"', re.MULTILINE)

#: What a reference to how the work was organised looks like.
REFERENCES = {
    "an issue": re.compile(r"\bissues? #?\d+\b", re.IGNORECASE),
    "a GitHub-style number": re.compile(r"(?:^|[\s(\[])#\d+\b(?![0-9a-fA-F])"),
    "a commit": re.compile(
        r"(?<![\w-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)(?:[0-9a-f]{7,12}|[0-9a-f]{40})(?![\w-])"
    ),
    "a work session": re.compile(r"\bsession \d+\b", re.IGNORECASE),
}
#: Another project's issue may be cited, named with its project ("db-scheduler #441").
OTHER_PROJECTS = re.compile(
    r"(db-scheduler|postgresql-job-queue-benchmarking|pgqueuer|procrastinate|awa|apscheduler|dbos|nats-server|nats|psycopg|"
    r"postgresql|sqlite|opentelemetry|mkdocs|python|cpython)('s)?$",
    re.IGNORECASE,
)


def user_pages() -> list[Path]:
    """The site's Markdown with every file it includes, and the READMEs users read."""
    pages = [*sorted(DOCS.glob("**/*.md")), ROOT / "README.md", *sorted(ROOT.glob("*/README.md"))]
    pages.remove(ROOT / "bench" / "README.md")  # the maintainers' notes, not a user page
    seen: list[Path] = []
    while pages:
        page = pages.pop(0)
        if page in seen:
            continue
        seen.append(page)
        pages += [ROOT / included for included in _SNIPPET.findall(page.read_text())]
    return seen


def test_user_pages_name_no_issue_commit_or_session() -> None:
    """No page of the site (nor a file it includes) and no README names an issue, a commit
    or a work session: users get what the product does, in its own words."""
    found = []
    for page in user_pages():
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for what, pattern in REFERENCES.items():
                for match in pattern.finditer(line):
                    if OTHER_PROJECTS.search(line[: match.start()].rstrip(" ([")):
                        continue
                    found.append(f"{page.relative_to(ROOT)}:{number}: {what}: {match.group()!r}")
    assert found == []


def test_no_page_points_at_a_placeholder_host() -> None:
    """No user page sends a reader to a made-up address (``git.example.com`` and the like):
    where Timer has no public address yet, the pages say so."""
    placeholder = re.compile(r"[\w.-]*\bexample\.(?:com|org|net)\b|\blocalhost\.invalid\b")
    found = [
        f"{page.relative_to(ROOT)}:{number}: {match.group()!r}"
        for page in user_pages()
        for number, line in enumerate(page.read_text().splitlines(), 1)
        for match in placeholder.finditer(line)
    ]
    assert found == []


def test_the_licence_the_packages_declare_is_at_the_root() -> None:
    """LICENSE holds the Apache License 2.0, the licence every package's metadata names."""
    licence = (ROOT / "LICENSE").read_text()
    assert "Apache License" in licence and "Version 2.0, January 2004" in licence
    for pyproject in sorted(ROOT.glob("*/pyproject.toml")):
        assert 'license = "Apache-2.0"' in pyproject.read_text(), pyproject


def test_every_test_a_page_cites_exists() -> None:
    """A page that backs an answer with a test (``tests/path.py::Class::test_name``, or
    ``tests/path.py::test_name``) names one that exists, in that class: a renamed or removed
    test does not leave a dead citation."""
    cited = re.compile(r"`(tests/[\w/]+\.py)::(?:(\w+)::)?(\w+)`")
    missing = []
    cited_count = 0
    for page in user_pages():
        for path, cls, name in cited.findall(page.read_text()):
            cited_count += 1
            source = ROOT / path
            text = source.read_text() if source.is_file() else ""
            if cls:
                found = re.search(rf"^class {cls}\b.*?(?=^class |\Z)", text, re.M | re.S)
                ok = found is not None and f"def {name}(" in found.group()
            else:
                ok = re.search(rf"^(async )?def {name}\(", text, re.M) is not None
            if not ok:
                missing.append(
                    f"{page.relative_to(ROOT)}: {path}::{cls + '::' if cls else ''}{name}"
                )
    assert missing == []
    assert cited_count > 0
