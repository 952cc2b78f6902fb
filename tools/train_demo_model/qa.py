"""Question-and-answer pairs made from reStructuredText documents, for the demo model's instruction
tuning: short answers that the documents themselves give.

- A section whose title is a question (the FAQs): the title, and its first paragraph (the next one
  too when the first is a bare "Yes." or "No.").
- A glossary entry: "What is TERM?", and its definition's first sentences.
- An API entry (``.. function::``, ``.. method::``, ``.. class::``, ``.. exception::``): "What
  does NAME do?", and its description's first sentences; a module's synopsis answers "What is the
  NAME module for?".
- Any other section: "Tell me about TITLE.", and its first paragraph's first sentences.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from tools.train_demo_model.corpus import clean_rst

MAX_ANSWER_CHARS = 320
_UNDERLINE = re.compile(r"[=\-~^\"'`#*+]{3,}")
_DIRECTIVE = re.compile(r"\.\. (function|method|class|exception|classmethod|staticmethod|decorator)::\s+([^\s(]+)")
_NUMBERING = re.compile(r"^(Part [IVXLC]+\.|Chapter \d+\.|[A-Z]?\d+(\.\d+)*\.)\s+")  # "17.7.1. AIX"
_SENTENCE_END = re.compile(r"(?<!\be\.g)(?<!\bi\.e)(?<!\betc)([.!?])\s+(?=[A-Z(`\"'])")


@dataclass(frozen=True)
class QAPair:
    question: str
    answer: str


def first_sentences(text: str, max_chars: int = MAX_ANSWER_CHARS) -> str:
    """Whole sentences from the start of text, as many as fit in max_chars (at least one)."""
    text = " ".join(text.split())
    out = ""
    for sentence in _SENTENCE_END.sub(r"\1\n", text).split("\n"):
        if out and len(out) + 1 + len(sentence) > max_chars:
            break
        out = f"{out} {sentence}".strip()
    return out


def paragraphs(rst: str) -> list[str]:
    """The prose paragraphs of a piece of reST, cleaned, one string each."""
    return [" ".join(p.split()) for p in clean_rst(rst).split("\n\n") if p.strip()]


def answer_of(rst: str) -> str | None:
    paras = paragraphs(rst)
    if not paras:
        return None
    text = paras[0]
    if text.rstrip(".!") in ("Yes", "No") and len(paras) > 1:
        text = f"{text} {paras[1]}"
    answer = first_sentences(text)
    # not a signature ("encode_chunked=False)", "f(x)[source]"), nor an introduction to a list
    return answer if len(answer.split()) >= 4 and answer[0].isupper() and not answer.endswith(":") else None


def _sections(lines: list[str]) -> list[tuple[str, list[str]]]:
    """(title, body lines) of each section: a title is a line underlined by punctuation of at
    least its length (an overline, if any, is dropped)."""
    sections, title, body = [], None, []
    i = 0
    while i < len(lines):
        line = lines[i]
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if line.strip() and not line.startswith(" ") and _UNDERLINE.fullmatch(nxt.strip()) \
                and len(nxt.strip()) >= len(line.strip()) and not _UNDERLINE.fullmatch(line.strip()):
            if title is not None:
                sections.append((title, body))
            title, body = _NUMBERING.sub("", clean_rst(line.strip()) or line.strip()), []
            i += 2
            continue
        if title is not None and not _UNDERLINE.fullmatch(line.strip() or "x"):
            body.append(line)
        i += 1
    if title is not None:
        sections.append((title, body))
    return sections


def _indented_blocks(lines: list[str], start: int) -> tuple[list[str], int]:
    """The lines indented deeper than lines[start] (blank lines inside kept), and where they end."""
    indent = len(lines[start]) - len(lines[start].lstrip())
    end = start + 1
    while end < len(lines) and (not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > indent):
        end += 1
    return [line for line in lines[start + 1:end]], end


def _dedent(lines: list[str]) -> str:
    indents = [len(line) - len(line.lstrip()) for line in lines if line.strip()]
    cut = min(indents, default=0)
    return "\n".join(line[cut:] for line in lines)


def glossary_pairs(lines: list[str]) -> list[QAPair]:
    pairs = []
    for i, line in enumerate(lines):
        if line.strip() != ".. glossary::":
            continue
        block, _ = _indented_blocks(lines, i)
        terms = _dedent(block).splitlines()
        j = 0
        while j < len(terms):
            term = terms[j]
            if term.strip() and not term.startswith(" "):
                definition, j = _indented_blocks(terms, j)
                name = clean_rst(term.strip()).strip()
                answer = answer_of(_dedent(definition))
                if name and answer and len(name) < 60:
                    pairs.append(QAPair(f"What is {name}?", answer))
                continue
            j += 1
    return pairs


def api_pairs(lines: list[str]) -> list[QAPair]:
    pairs = []
    for i, line in enumerate(lines):
        stripped = line.strip()
        match = _DIRECTIVE.match(stripped)
        if match:
            kind, name = match.groups()
            body, _ = _indented_blocks(lines, i)
            # a signature's continuation lines and the directive's options come before the first blank line
            blank = next((j for j, b in enumerate(body) if not b.strip()), len(body))
            answer = answer_of(_dedent(body[blank:]))
            if answer:
                name = name.split(".")[-1] if kind in ("method", "classmethod", "staticmethod") else name
                call = f"{name}()" if kind not in ("class", "exception") else name
                what = "the exception" if kind == "exception" else "the class" if kind == "class" else ""
                pairs.append(QAPair(f"What does {what + ' ' if what else ''}{call} do?", answer))
        elif stripped.startswith(".. module::") and i + 1 < len(lines) and ":synopsis:" in lines[i + 1]:
            name = stripped.split("::", 1)[1].strip()
            synopsis = lines[i + 1].split(":synopsis:", 1)[1].strip()
            if synopsis:
                pairs.append(QAPair(f"What is the {name} module for?", clean_rst(synopsis)))
    return pairs


# Section titles that name a part of a reference page, not a topic
GENERIC_TITLES = {"description", "compatibility", "notes", "note", "examples", "example", "see also", "parameters",
                  "synopsis", "tip", "warning", "caution", "important", "overview", "introduction", "usage",
                  "outputs", "diagnostics", "files", "environment", "options", "arguments", "return value",
                  "attributes", "methods", "footnotes", "summary", "history", "bugs", "limitations", "details"}


def section_pairs(lines: list[str]) -> list[QAPair]:
    pairs = []
    for title, body in _sections(lines):
        answer = answer_of("\n".join(body))
        if not answer or len(title) > 100 or title.lower().rstrip(".") in GENERIC_TITLES \
                or not re.search(r"[A-Za-z]{3}", title):
            continue
        question = title if title.endswith("?") else f"Tell me about {title}."
        pairs.append(QAPair(question, answer))
    return pairs


def qa_pairs(rst: str, name: str = "") -> list[QAPair]:
    """Every pair one reST document gives; none from release notes (whatsnew/, changelog), whose
    sections are lists of changes, not answers."""
    if re.search(r"(^|/)(whatsnew|changelog|changes|releases?|news)", name.lower()):
        return []
    lines = rst.splitlines()
    return glossary_pairs(lines) + api_pairs(lines) + section_pairs(lines)
