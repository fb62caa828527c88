"""The documentation holds together: every relative link and anchor resolves, the README stays a front door
(at most 120 lines, linking every page of docs/), and the reference tables of docs/ say what the code does
(the config keys, the exit codes, the command-line flags)."""

import argparse
import re
from pathlib import Path

import pytest

from diloco_peer import cli
from diloco_peer.config import PeerConfig

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
README_MAX_LINES = 120
# the pages a reader reaches from the README; bench/report.py rewrites part of BENCHMARKS.md, never its links
PAGES = [README, *sorted(DOCS.glob("*.md")), ROOT / "SECURITY.md", ROOT / "BENCHMARKS.md",
         ROOT / "bootstrap" / "README.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code: a `[x](y)` or `# ...` inside code is no link or heading."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for the headings of a markdown page: lower case, punctuation dropped, spaces to '-'."""
    headings = re.findall(r"^#{1,6}\s+(.*?)\s*$", re.sub(r"^```.*?^```", "", page.read_text(),
                                                          flags=re.MULTILINE | re.DOTALL), flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.replace("`", "").lower()).replace(" ", "-") for heading in headings}


def relative_links(page: Path) -> list[str]:
    return [target for target in LINK.findall(prose(page.read_text()))
            if not re.match(r"[a-z][a-z0-9+.-]*:", target)]  # http:, https:, mailto: are not checked here


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target} (no file {resolved})")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target} (no heading '#{anchor}' in {resolved.relative_to(ROOT)})")
    assert not broken, f"{page.relative_to(ROOT)} has broken links: {'; '.join(broken)}"


def test_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (f"README.md has {len(lines)} lines, at most {README_MAX_LINES}: "
                                            f"move the detail to a page of docs/ and link it")
    linked = {(README.parent / target.partition("#")[0]).resolve() for target in relative_links(README)}
    unlinked = [page.name for page in sorted(DOCS.glob("*.md")) if page.resolve() not in linked]
    assert DOCS.is_dir() and not unlinked, f"docs/ pages the README does not link: {unlinked}"


def table_rows(page: Path, header: str) -> list[list[str]]:
    """The rows of the markdown table whose header line starts with ``header``, as lists of cells."""
    lines = page.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_configuration_table_lists_every_key():
    """docs/configuration.md's sections table names exactly the keys of each config section."""
    rows = table_rows(DOCS / "configuration.md", "| section |")
    documented = {re.fullmatch(r"`\[(\w+)\]`", section).group(1): set(re.findall(r"`(\w+)`(?! *[/)])", keys))
                  for section, keys, _ in rows}
    actual = {name: set(field.annotation.model_fields) for name, field in PeerConfig.model_fields.items()}
    assert documented.keys() == actual.keys()
    for section, keys in actual.items():
        assert documented[section] == keys, (f"[{section}] in docs/configuration.md: missing "
                                             f"{sorted(keys - documented[section])}, unknown "
                                             f"{sorted(documented[section] - keys)}")


def test_exit_codes_table_matches_the_cli():
    rows = table_rows(DOCS / "cli.md", "| exit code |")
    codes = [int(code) for code, *_ in rows]
    assert codes == [cli.EXIT_OK, cli.EXIT_RUNTIME, cli.EXIT_USAGE, cli.EXIT_UNREACHABLE, cli.EXIT_INTERRUPTED]


def test_every_command_and_flag_is_documented():
    """Each command of ``diloco-peer`` has a section of docs/cli.md that names each of its flags."""
    text = (DOCS / "cli.md").read_text()
    sections = dict(re.findall(r"^## (\w+)\n(.*?)(?=^## |\Z)", text, flags=re.MULTILINE | re.DOTALL))
    subparsers = next(action for action in cli.build_parser()._actions
                      if isinstance(action, argparse._SubParsersAction))
    missing = []
    for command, parser in subparsers.choices.items():
        if command not in sections:
            missing.append(f"the command {command}")
            continue
        flags = {option for action in parser._actions for option in action.option_strings
                 if option.startswith("--") and option != "--help"}
        common = {"--config", "--set"} & flags  # documented once, at the top of the page
        missing += [f"{command} {flag}" for flag in sorted(flags - common) if flag not in sections[command]]
    assert not missing, f"docs/cli.md does not document: {', '.join(missing)}"
