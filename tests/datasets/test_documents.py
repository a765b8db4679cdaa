"""Documents from installed packages' prose: sides split by source path, token ranges, copied text found."""

from collections import Counter

from train_runs import make_tokenizer

from mtpkit.datasets.code_corpus import held_out
from mtpkit.datasets.documents import api_reference, cut_documents, headings, overlapping, split_sides, training_records

_WORDS = ("the parser reads every token of the input and builds a tree that later stages walk to emit code "
          "while errors are reported with the line and column where they were found").split()


def _prose(seed: int, paragraphs: int = 12) -> str:
    """Paragraphs of 40+ words, a section title before every third."""
    return "\n\n".join(("" if p % 3 else f"## Section {p}\n\n") +
                       " ".join(_WORDS[(seed + 7 * p + i) % len(_WORDS)] for i in range(40 + p))
                       for p in range(paragraphs))


def test_sides_are_disjoint_and_python_files_agree_with_the_code_corpus():
    sources = [{"path": f"pkg{i}/module{i}.py", "text": "x"} for i in range(300)]
    sources += [{"path": f"pkg{i}.dist-info/METADATA", "text": "x"} for i in range(300)]
    train, held = split_sides(sources)
    assert len(train) + len(held) == len(sources)
    assert not {s["path"] for s in train} & {s["path"] for s in held}
    assert held and train
    assert all(held_out(s["path"]) for s in held if s["path"].endswith(".py"))
    assert not any(held_out(s["path"]) for s in train if s["path"].endswith(".py"))
    # the same split every time: a source never changes side between builds
    assert split_sides(list(reversed(sources)))[1] == list(reversed(held))


def test_documents_keep_within_their_token_range(tmp_path):
    tok = make_tokenizer(tmp_path)
    sources = [{"path": f"p{i}.md", "text": _prose(i, 30)} for i in range(4)]
    docs = cut_documents(sources, tok, 200, 500, seed=1)
    assert len(docs) >= 8
    assert all(200 <= len(tok(d["text"])["input_ids"]) == d["tokens"] <= 500 for d in docs)
    assert all(d["text"].startswith("## Section") for d in docs)  # whole sections, from a title
    assert len({d["tokens"] for d in docs}) > 1  # lengths are drawn, not all at the cap
    assert len(cut_documents(sources, tok, 200, 500, seed=1, per_source=1)) == 4


def test_overlapping_finds_a_copied_run_of_words():
    docs = [{"text": _prose(0)}, {"text": "entirely different words " * 20}]
    copied = " ".join(_prose(0).split()[30:45])  # 15 words of the first document, inside other text
    assert overlapping(docs, ["some preamble " + copied + " and more"]) == {0}
    assert overlapping(docs, [" ".join(_prose(0).split()[30:40])]) == set()  # 10 words: too short to count


def test_api_reference_and_headings():
    source = ('"""A module that parses things."""\n\ndef parse(text, strict=False):\n    """Parse the text."""\n\n'
              'def _hidden():\n    """Private."""\n\nclass Tree:\n    """A tree."""\n\n    def walk(self):\n'
              '        """Visit every node."""\n')
    assert api_reference(source) == ("A module that parses things.\n\n## parse(text, strict=False)\n\nParse the text."
                                     "\n\n## Tree\n\nA tree.\n\n## Tree.walk(self)\n\nVisit every node.")
    assert api_reference("def broken(:\n") is None
    assert headings("# Install\n\ntext\n\nUsage notes\n-----------\n\n## parse(text)\n\nExamples\n--------\n") == \
        ["Install", "parse", "Usage notes"]


def test_training_records_read_only_the_training_side_up_to_the_token_budget(tmp_path):
    tok = make_tokenizer(tmp_path)
    sources = [{"path": f"pkg{i}/README.md", "text": _prose(i, 30)} for i in range(40)]
    train, held = split_sides(sources)
    records = training_records(sources, tok, tokens=2000, min_tokens=100, max_tokens=400, seed=1)
    assert records and {r["path"] for r in records} <= {s["path"] for s in train}
    lengths = [len(r["input_ids"]) for r in records]
    assert all(100 <= n <= 400 for n in lengths)
    assert sum(lengths[:-1]) < 2000 <= sum(lengths)  # stops at the first document that reaches the budget
    assert max(Counter(r["path"] for r in records).values()) <= 2
    assert records == training_records(sources, tok, tokens=2000, min_tokens=100, max_tokens=400, seed=1)
