"""The demo model's training text: prose from the documentation that Debian packages ship, each
source with its licence (written next to the model as DATA_LICENSE.txt), as documents split into
training and held-out ones (every 12th document of each source, by path, is held out).

Sphinx builds ship their reStructuredText sources under _sources/, which clean_rst turns into prose;
other documentation is HTML, which html_to_rst turns into reST-like headings and paragraphs first.
The reST also feeds the question-and-answer pairs (qa.py).
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path


@dataclass(frozen=True)
class Source:
    package: str  # the Debian package that ships it
    root: str  # where its documents lie
    pattern: str  # their glob under root
    licence: str  # the licence, as the package's copyright file states it
    html: bool = False  # HTML pages (html_to_rst reads them), else reST sources


def _sphinx(package: str, licence: str, root: str | None = None) -> Source:
    return Source(package, root or f"/usr/share/doc/{package}/html/_sources", "**/*.txt", licence)


SOURCES = (
    _sphinx("python3.11-doc", "Copyright (c) 2001-2023 Python Software Foundation; PSF License Agreement (and the "
            "Zero-Clause BSD license for code examples): https://docs.python.org/3/license.html",
            "/usr/share/doc/python3.11/html/_sources"),
    Source("python-django-doc", "/usr/share/doc/python-django-doc/html", "**/*.html",
           "Django Software Foundation and contributors; BSD-3-Clause", html=True),
    _sphinx("python-flask-doc", "Pallets; BSD-3-Clause"),
    _sphinx("python-click-doc", "Pallets; BSD-3-Clause"),
    _sphinx("python-requests-doc", "Kenneth Reitz; Apache-2.0"),
    _sphinx("python-pytest-doc", "Holger Krekel and others; MIT (Expat)"),
    _sphinx("sphinx-doc", "the Sphinx team; BSD-2-Clause"),
    Source("postgresql-doc-15", "/usr/share/doc/postgresql-doc-15/html", "*.html",
           "The PostgreSQL Global Development Group and the Regents of the University of California; "
           "PostgreSQL License", html=True),
    Source("sqlite3-doc", "/usr/share/doc/sqlite3", "*.html", "public domain (the SQLite documentation)", html=True),
)


@dataclass(frozen=True)
class Document:
    source: str  # its package
    name: str  # its path under the source's root
    rst: str  # as shipped

    @property
    def text(self) -> str:
        return clean_rst(self.rst)


_ROLE = re.compile(r":[a-zA-Z:]+:`~?!?([^`<]*?)(?:\s*<[^>]*>)?`")
_LINK = re.compile(r"`([^`<]+?)(?:\s*<[^>]*>)?`_+")


# Directives whose indented body is not prose.
_SKIP_BODY = ("code-block", "code", "highlight", "doctest", "testcode", "testoutput", "testsetup", "literalinclude",
              "productionlist", "toctree", "image", "figure", "index", "csv-table", "list-table", "raw", "only",
              "sourcecode", "program", "cmdoption", "option", "audit-event", "impl-detail", "include")


def clean_rst(text: str) -> str:
    """Prose out of reST: drop directive lines, section underlines, code and literal blocks and
    doctest lines (the prose inside directives such as function:: stays); turn roles
    (:func:`len`) and links into their text."""
    out, skip_indent = [], None
    for line in text.splitlines():
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if skip_indent is not None:
            if stripped and indent <= skip_indent:
                skip_indent = None
            else:
                continue
        if stripped.startswith(".. "):
            name = stripped[3:].split("::", 1)[0].strip()
            if "::" not in stripped or name in _SKIP_BODY or name.startswith("_") or stripped.startswith(".. _"):
                skip_indent = indent
            continue
        if re.match(r":[\w -]+:(\s|$)", stripped):  # field lists (:param x:, :noindex:), not roles (:func:`x`)
            continue
        if re.fullmatch(r"[=\-~^\"'`#*+<>._:]{3,}", stripped) or stripped.startswith((">>>", "...", "|", "+-")):
            continue
        if stripped.endswith("::"):  # a literal block follows
            line = line.rstrip()[:-1] if stripped != "::" else ""
            skip_indent = indent
        out.append(line.strip())
    text = "\n".join(out)  # roles and links may span lines
    text = _LINK.sub(r"\1", _ROLE.sub(r"\1", text)).replace("``", "").replace("**", "").replace("*", "")
    return re.sub(r"\n{3,}", "\n\n", text).strip()


_SKIP_TAGS = {"script", "style", "pre", "head", "nav", "header", "footer", "table", "form", "button", "select"}
_SKIP_CLASS = re.compile(r"nav|sidebar|related|footer|header|\bhd\b|toc\b|breadcrumb|searchbox|headerlink|highlight|copyright|menu|tagline")
_BLOCKS = {"p", "li", "dd", "dt", "blockquote", "td", "caption"}
_VOID = {"br", "img", "hr", "meta", "link", "input", "wbr", "col", "area", "base", "source"}


class _Prose(HTMLParser):
    """An HTML page's headings and paragraphs as reST-like text, code and navigation left out. A
    left-out element ends at the end tag that balances its own tag (HTML leaves many tags open)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.out: list[str] = []
        self.text: list[str] = []
        self.skip_tag: str | None = None  # the tag of the element being left out
        self.skip_depth = 0  # its nesting

    def flush(self, heading: bool = False) -> None:
        text = " ".join("".join(self.text).split())
        self.text = []
        if text:
            self.out.append(f"{text}\n{'=' * len(text)}" if heading else text)

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag in _VOID:
            return
        if self.skip_tag is not None:
            self.skip_depth += tag == self.skip_tag
            return
        attributes = dict(attrs)
        if tag in _SKIP_TAGS or _SKIP_CLASS.search(f"{attributes.get('class', '')} {attributes.get('id', '')}"):
            self.skip_tag, self.skip_depth = tag, 1  # a heading's ¶ link is left out, the heading stays whole
        elif tag in _BLOCKS or tag in {"h1", "h2", "h3", "h4", "div"}:
            self.flush()

    def handle_endtag(self, tag: str) -> None:
        if self.skip_tag is not None:
            if tag == self.skip_tag:
                self.skip_depth -= 1
                if self.skip_depth == 0:
                    self.skip_tag = None
            return
        if tag in {"h1", "h2", "h3", "h4"}:
            self.flush(heading=True)
        elif tag in _BLOCKS or tag == "div":
            self.flush()

    def handle_data(self, data: str) -> None:
        if self.skip_tag is None:
            self.text.append(data)


def html_to_rst(html: str) -> str:
    """Headings (underlined, as reST titles) and paragraphs of an HTML page, for clean_rst and qa.py."""
    parser = _Prose()
    parser.feed(html)
    parser.close()
    parser.flush()
    return "\n\n".join(parser.out)


def load_documents(seed: int, sources: tuple[Source, ...] = SOURCES) -> tuple[list[Document], list[Document]]:
    """(training, held-out) documents with at least 200 characters of prose, each list shuffled."""
    train, test = [], []
    for source in sources:
        files = sorted(Path(source.root).glob(source.pattern))
        if not files:
            raise SystemExit(f"no documents under {source.root}: apt-get install {source.package}")
        docs = [Document(source.package, str(f.relative_to(source.root)),
                         html_to_rst(f.read_text(errors="replace")) if source.html else f.read_text(errors="replace"))
                for f in files if "_modules" not in f.parts and "_static" not in f.parts]
        docs = [d for d in docs if len(d.text) > 200]
        for i, doc in enumerate(docs):
            (test if i % 12 == seed % 12 else train).append(doc)
    random.Random(seed).shuffle(train)
    random.Random(seed + 1).shuffle(test)  # so that any prefix of the held-out text mixes the sources
    return train, test


def licence_note(sources: tuple[Source, ...] = SOURCES) -> str:
    lines = ["Training data: the prose of documentation shipped in these Debian packages (with question and",
             "answer pairs made from it by tools/train_demo_model/qa.py):", ""]
    for source in sources:
        lines += [f"- {source.package} ({source.root}): {source.licence}"]
    lines += ["", "The model weights are derived from that text by tools/train_demo_model."]
    return "\n".join(lines) + "\n"
