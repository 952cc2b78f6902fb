"""The demo model's training data (tools/train_demo_model): reST to prose, the question-and-answer
pairs made from documents, and the instruction-tuning examples' loss mask."""
from __future__ import annotations

from pathlib import Path

from tools.train_demo_model import sft
from tools.train_demo_model.corpus import Source, clean_rst, licence_note, load_documents
from tools.train_demo_model.qa import QAPair, first_sentences, qa_pairs

DEMO = Path(__file__).resolve().parents[1] / "dabba" / "assets" / "demo"

DOC = """\
Programming FAQ
===============

How do I copy a list?
---------------------

Yes.

Use :meth:`list.copy` or slice the whole list, as in
:ref:`the tutorial <tut-lists>`.  A third sentence that the answer leaves out, because with it the
answer would pass its bound of 320 characters: it goes on and on about copies, shallow and deep,
slices and the copy module, and what each of them shares with the list it came from, and then
about the memory each of them takes.

.. glossary::

   duck-typing
      A style that does not look at an object's type to decide
      whether it has the right interface.

.. module:: json
   :synopsis: Encode and decode the JSON format.

.. function:: dumps(obj, *, skipkeys=False, \\
                    ensure_ascii=True)

   Serialize *obj* to a JSON formatted :class:`str`.

   Second paragraph.

.. class:: JSONDecoder(*, object_hook=None)

   A simple JSON decoder.

.. function:: loads(s)

   encode_chunked=False)

Dictionaries
------------

A dictionary maps keys to values. Keys must be hashable.

.. code-block:: python

   d = {}
"""


def test_rst_becomes_prose_with_roles_and_links_across_lines() -> None:
    text = clean_rst("See :ref:`the\ntutorial <tut>` and `Python\n<https://python.org>`_.\n\n:param x: a field\n")
    assert text == "See the\ntutorial and Python."
    assert clean_rst(":func:`len` returns a length.") == "len returns a length."  # a role, not a field list


def test_pairs_come_from_faqs_glossaries_api_entries_and_sections() -> None:
    pairs = qa_pairs(DOC, "faq/programming.rst.txt")
    assert QAPair("How do I copy a list?",
                  "Yes. Use list.copy or slice the whole list, as in the tutorial.") in pairs
    assert QAPair("What is duck-typing?",
                  "A style that does not look at an object's type to decide whether it has the right interface.") in pairs
    assert QAPair("What is the json module for?", "Encode and decode the JSON format.") in pairs
    assert QAPair("What does dumps() do?", "Serialize obj to a JSON formatted str.") in pairs
    assert QAPair("What does the class JSONDecoder do?", "A simple JSON decoder.") in pairs
    assert QAPair("Tell me about Dictionaries.", "A dictionary maps keys to values. Keys must be hashable.") in pairs
    assert not [p for p in pairs if p.question == "What does loads() do?"]  # a signature's tail is no answer
    assert qa_pairs(DOC, "whatsnew/3.11.rst.txt") == []  # release notes list changes, not answers


def test_first_sentences_keep_whole_sentences() -> None:
    text = "One sentence here. Another one, e.g. with an abbreviation. A third."
    assert first_sentences(text, 40) == "One sentence here."
    assert first_sentences(text, 200) == text
    assert first_sentences("x" * 500, 50) == "x" * 500  # one sentence at least


def test_documents_are_split_by_source_and_the_licences_listed(tmp_path) -> None:
    root = tmp_path / "docs"
    root.mkdir()
    for i in range(24):
        (root / f"doc{i:02d}.txt").write_text(f"Title {i}\n=======\n\n" + "Some prose about Python. " * 20)
    (root / "tiny.txt").write_text("too short")
    source = Source("some-doc", str(root), "*.txt", "MIT")
    train, test = load_documents(0, (source,))
    assert len(train) == 22 and sorted(d.name for d in test) == ["doc00.txt", "doc12.txt"]
    assert load_documents(0, (source,)) == (train, test)  # the seed decides the order
    assert "- some-doc (" in licence_note((source,)) and "MIT" in licence_note((source,))


def test_instruction_examples_put_the_loss_on_the_answer_only() -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(DEMO / "tokenizer.json"))
    ids, labels = sft.chat_example(tok, QAPair("What is a list?", "A mutable sequence."), "Be brief.", 256)
    prompt = tok.encode("<|system|>\nBe brief.<|end|>\n<|user|>\nWhat is a list?<|end|>\n<|assistant|>\n").ids
    assert ids[:len(prompt)] == prompt and labels[:len(prompt)] == [sft.IGNORE] * len(prompt)
    assert labels[len(prompt):] == ids[len(prompt):] and ids[-1] == tok.token_to_id("<|end|>")
    assert sft.chat_example(tok, QAPair("q", "a " * 400), "", 256) is None  # too long
    x, y = sft.batch([(ids, labels), ([1, 2, 3], [sft.IGNORE, 2, 3])], pad_id=0)
    assert x.shape == y.shape == (2, len(ids) - 1)
    assert x[1, :2].tolist() == [1, 2] and y[1, :2].tolist() == [2, 3] and set(y[1, 2:].tolist()) == {sft.IGNORE}
    assert y[0].tolist() == labels[1:]  # position i predicts token i + 1
