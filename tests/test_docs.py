"""The docs stay true to the code: the attacks table is the registry's, every relative link resolves, the README is
short, and no file cites a document users do not have."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from mia.attacks import AttackSpec, available, catalog, get
from mia.validate import Range

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
LINKED_PAGES = [README, ROOT / "experiments" / "README.md", *DOCS]
README_LIMIT = 12 * 1024  # bytes

# ------------------------------------------------------------------------------------------ markdown helpers
_FENCE = re.compile(r"^(```|~~~).*?^\1\s*$", re.S | re.M)
_CODE_SPAN = re.compile(r"(`+).+?\1", re.S)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
_HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"", re.I)


def strip_code(text: str) -> str:
    """Markdown without fenced blocks and code spans (a link inside code is not a link)."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def links(text: str) -> list[str]:
    """Targets of the markdown links and images of ``text``, outside code."""
    return _LINK.findall(strip_code(text))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: markup dropped, lower case, punctuation removed, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor a page defines: its headings' slugs (repeats numbered -1, -2, as GitHub does) and explicit
    ``<a id="...">`` / ``<a name="...">`` tags."""
    found: set[str] = set(_HTML_ANCHOR.findall(text))
    seen: dict[str, int] = {}
    for heading in _HEADING.findall(_FENCE.sub("", text)):
        base = slug(heading)
        n = seen.get(base, 0)
        found.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return found


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """'page: target (why)' for each relative link of ``page`` whose file or anchor does not exist."""
    problems = []
    text = page.read_text(encoding="utf-8")
    for target in links(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto: ...
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        where = f"{page.relative_to(root)}: {target}"
        if not dest.exists():
            problems.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text(encoding="utf-8")):
            problems.append(f"{where} (no anchor #{anchor} in {dest.relative_to(root)})")
    return problems


# ------------------------------------------------------------------------------------------------- the helpers
def test_slug_follows_github():
    assert slug("The scoring engine (`mia/engine/`)") == "the-scoring-engine-miaengine"
    assert slug("Will it fit? (`mia plan`)") == "will-it-fit-mia-plan"
    assert (slug("`camia`: CAMIA Table 1 (and Table 13's AUC), Table 2")
            == "camia-camia-table-1-and-table-13s-auc-table-2")
    assert anchors("# A\n## A\n<a id=\"x_y\"></a>\n```\n# not a heading\n```\n") == {"a", "a-1", "x_y"}


def test_broken_links_are_found(tmp_path):
    (tmp_path / "other.md").write_text("## Here\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#here) [gone](missing.md) [bad anchor](other.md#there) [self](#top)\n"
                    "`[in code](missing.md)` [web](https://example.org/x.md)\n# Top\n", encoding="utf-8")
    assert broken_links(page, tmp_path) == ["page.md: missing.md (no such file)",
                                            "page.md: other.md#there (no anchor #there in other.md)"]


# ------------------------------------------------------------------------------------------------- the docs
def test_readme_is_short():
    size = len(README.read_bytes())
    assert size < README_LIMIT, f"README.md is {size} bytes; keep it under {README_LIMIT} and move detail to docs/"


@pytest.mark.parametrize("page", LINKED_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert broken_links(page) == []


def test_attacks_table_is_the_registry():
    """docs/attacks.md embeds exactly the generated table: an attack added, removed or changed in the registry
    (name, parameters, limits, needs, summary) fails here until the table is regenerated."""
    text = (ROOT / "docs" / "attacks.md").read_text(encoding="utf-8")
    assert catalog.embedded_table(text, "docs/attacks.md") == catalog.attacks_table(), (
        "docs/attacks.md's attacks table is stale: run `python -m mia.attacks.catalog --write docs/attacks.md`")


def test_every_attack_has_a_row_and_a_definition():
    table = catalog.attacks_table()
    definitions = anchors((ROOT / "docs" / "algorithms.md").read_text(encoding="utf-8"))
    for name in available():
        assert f"| [`{name}`](algorithms.md#{name}) |" in table
        assert name in definitions, f"docs/algorithms.md has no section <a id=\"{name}\"> for attack {name}"


def test_a_new_attack_makes_the_docs_table_stale():
    spec = AttackSpec("zz_new", fn=lambda ctx, *, k: None, needs=("stats", "calib"), defaults={"k": 0.5, "on": True},
                      doc="New | attack (higher = member).\n    Second line.\n\nDetails.", limits={"k": Range(0, 1)})
    table = catalog.markdown_table([*(get(name) for name in available()), spec])
    row = ("| [`zz_new`](algorithms.md#zz_new) | `k=0.5` in [0, 1]<br>`on=true` | stats, calib | stats | "
           "New \\| attack (higher = member). Second line. |")
    assert row in table.splitlines()
    text = (ROOT / "docs" / "attacks.md").read_text(encoding="utf-8")
    assert catalog.embedded_table(text) != table


def test_catalog_table_is_one_row_per_attack_with_escaped_cells():
    rows = catalog.attacks_table().splitlines()
    assert len(rows) == 2 + len(available())
    n_columns = len(catalog.COLUMNS)
    for row in rows:  # an unescaped '|' in a docstring would add a column
        assert len(re.findall(r"(?<!\\)\|", row)) == n_columns + 1, row


def test_catalog_rewrites_only_the_marked_block(tmp_path):
    page = tmp_path / "attacks.md"
    page.write_text(f"before\n{catalog.BEGIN_MARKER}\nold table\n\n{catalog.END_MARKER}\nafter\n", encoding="utf-8")
    assert catalog.main(["--write", str(page)]) == 0
    text = page.read_text(encoding="utf-8")
    assert text.startswith("before\n") and text.endswith(f"{catalog.END_MARKER}\nafter\n")
    assert catalog.embedded_table(text) == catalog.attacks_table()
    page.write_text("no markers\n", encoding="utf-8")
    assert catalog.main(["--write", str(page)]) == 2


def test_catalog_prints_the_table(capsys, monkeypatch):
    """`python -m mia.attacks.catalog` (its ``__main__`` block, run in this process) prints the table."""
    import runpy
    import warnings

    monkeypatch.setattr(sys, "argv", ["catalog.py"])  # as `python -m mia.attacks.catalog`: no arguments
    with pytest.raises(SystemExit) as done, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module is already imported (by this file)
        runpy.run_module("mia.attacks.catalog", run_name="__main__")
    assert done.value.code in (0, None) and capsys.readouterr().out == catalog.attacks_table()


_PRIVATE = ("ALGORITHMS" + ".md", "../" + "shared/")  # spelt in pieces so that this file does not cite them


def test_no_file_cites_documents_users_do_not_have():
    """Definitions live in docs/algorithms.md; nothing may point users at a private spec or a private folder."""
    files = [README, *(p for d in ("mia", "experiments", "tests", "notebooks", "docs") for p in (ROOT / d).rglob("*")
                       if p.suffix in (".py", ".md", ".ipynb"))]
    offenders = []
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text(encoding="utf-8", errors="replace")
        offenders += [f"{rel}: {bad}" for bad in _PRIVATE if bad in text]
    assert offenders == []
