"""The docs read in order and stay short: a README of at most 150 lines whose headline rows each
link to their section of docs/benchmarks.md (at most 400 lines), and kept results filed in a
folder per benchmark, superseded ones under archive/, each folder's files in its index."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"


def _anchors(page: pathlib.Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    return {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for line in page.read_text().splitlines() if line.startswith("#")}


def test_the_readme_and_the_benchmarks_page_stay_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150
    assert len(BENCHMARKS.read_text().splitlines()) <= 400


def test_each_headline_row_links_to_its_section_of_the_benchmarks_page():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Headline figures", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| what ")]
    assert 1 <= len(rows) <= 5
    anchors = _anchors(BENCHMARKS)
    for row in rows:
        links = re.findall(r"\(docs/benchmarks\.md#([\w-]+)\)", row)
        assert links and set(links) <= anchors, row


def test_every_link_into_the_benchmarks_page_finds_its_section():
    anchors = _anchors(BENCHMARKS)
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), RESULTS / "README.md",
             RESULTS / "archive" / "README.md"]
    for page in pages:
        for anchor in re.findall(r"benchmarks\.md#([\w-]+)\)", page.read_text()):
            assert anchor in anchors, f"{page.relative_to(ROOT)}: #{anchor}"


def test_kept_results_sit_in_a_folder_per_benchmark_and_each_index_names_its_files():
    loose = [p.name for p in RESULTS.iterdir() if p.is_file() and p.name != "README.md"]
    assert not loose, f"kept results belong in their benchmark's folder: {loose}"
    index = (RESULTS / "README.md").read_text()
    for folder in sorted(p for p in RESULTS.iterdir() if p.is_dir() and p.name != "archive"):
        assert f"## {folder.name}\n" in index, folder.name
        if folder.name == "pretrained_arithmetic_cpu":  # a run directory, with its own README
            continue
        for f in folder.iterdir():
            named = f"`{f.name}`" in index or f"`{folder.name}/{f.name}`" in index
            assert named, f"{folder.name}/{f.name} is not in bench/results/README.md"
    archive = (RESULTS / "archive" / "README.md").read_text()
    for folder in sorted(p for p in (RESULTS / "archive").iterdir() if p.is_dir()):
        assert f"## {folder.name}\n" in archive, folder.name
        for f in folder.rglob("*"):
            if f.is_file():
                assert f"`{f.relative_to(folder)}`" in archive, f"archive/{folder.name}/{f.relative_to(folder)}"
