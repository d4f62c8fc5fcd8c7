"""A real headless browser for pages the feeder serves: Debian's `chromium` package
(.ci/run installs it), run once per page with a fresh profile.

    rows = table_rows(dump_dom(url), "streams")   # [[cell, ...], ...] of <table id=streams>
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from html.parser import HTMLParser

FLAGS = [
    "--headless",
    "--no-sandbox",  # the tests run as root
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def dump_dom(url: str, timeout: float = 120.0) -> str:
    """The page's DOM as Chromium renders it."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    assert exe, "no chromium on PATH: install Debian's chromium package (.ci/run does)"
    with tempfile.TemporaryDirectory(prefix="tokenfeed-chromium-") as profile:
        proc = subprocess.run(
            [exe, *FLAGS, f"--user-data-dir={profile}", "--dump-dom", url],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


class _Rows(HTMLParser):
    def __init__(self, table_id: str) -> None:
        super().__init__()
        self.table_id = table_id
        self.depth = 0  # > 0 inside the table
        self.rows: list[list[str]] = []
        self.cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table" and (self.depth or ("id", self.table_id) in attrs):
            self.depth += 1
        elif self.depth and tag == "tr":
            self.rows.append([])
        elif self.depth and tag == "td":
            self.cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "table" and self.depth:
            self.depth -= 1
        elif tag == "td" and self.cell is not None:
            self.rows[-1].append("".join(self.cell).strip())
            self.cell = None

    def handle_data(self, data: str) -> None:
        if self.cell is not None:
            self.cell.append(data)


def table_rows(html: str, table_id: str) -> list[list[str]]:
    """The data rows (<td> cells) of the table with that id."""
    parser = _Rows(table_id)
    parser.feed(html)
    return [r for r in parser.rows if r]
