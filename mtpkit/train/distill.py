"""Self-distillation data for an MTP head: the model's own greedy continuations of real prompts.

A head trained on the text the trunk itself produces learns exactly what it will be asked to draft, which is the
usual way to get high acceptance (Medusa-2, EAGLE, FastMTP). Nothing is downloaded: the prompts are everyday
requests and openings built from templates over a list of general topics (chat through the tokenizer's chat
template, prose and lists to continue), plus the Python standard library's own docstrings for code. The
benchmark's prompts and their topics are never used (tests/train/test_distill.py checks it).
"""

from __future__ import annotations

import ast
import json
import random
import sysconfig
from pathlib import Path

from tqdm import tqdm

from ..tokenizer import encode_prompt

_CHAT_TEMPLATES = (
    "Explain what the Python function `{qual}` does: \"{doc}\"",
    "Write a Python function for this task: {doc}",
    "In simple terms, what does this mean? {doc}",
    "Give me a numbered list of tips related to this: {doc}",
    "Describe a situation where this would be useful: {doc}",
)


# Everyday topics, disjoint from the benchmark's (mtpkit/resources/bench_prompts.jsonl).
_TOPICS = (
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
)
_GENERAL_CHAT = (
    "Explain {t} in simple terms.", "Give me three tips about {t}.", "Write a short paragraph about {t}.",
    "What are the pros and cons of {t}?", "Write a short poem about {t}.", "How would you explain {t} to a child?",
    "What should a beginner know about {t}?", "Write a short email to a friend about {t}.",
    "Summarize the key ideas of {t}.", "Give me a numbered list of facts about {t}.",
    "List five things to keep in mind about {t}.", "Write a short story that involves {t}.",
)
_GENERAL_PROSE = (
    "{T} is", "The most interesting thing about {t} is that", "Many people do not realize that {t}",
    "A short guide to {t}:\n1.", "Here are some facts about {t}:\n-", "When it comes to {t}, the first step is",
    "Yesterday I read an article about {t}. It said that", "Three reasons to care about {t}:\n1.",
)


def general_prompts(n: int, seed: int = 0) -> list[dict]:
    """n prompts {"prompt", "chat", "kind"} on everyday topics: about 60% chat requests, 40% prose or lists."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        t = rng.choice(_TOPICS)
        if rng.random() < 0.6:
            out.append({"prompt": rng.choice(_GENERAL_CHAT).format(t=t), "chat": True, "kind": "chat"})
        else:
            text = rng.choice(_GENERAL_PROSE).format(t=t, T=t[0].upper() + t[1:])
            out.append({"prompt": text, "chat": False, "kind": "list" if "\n" in text else "prose"})
    return out


def mixed_prompts(n: int, seed: int = 0, general: float = 0.6) -> list[dict]:
    """A shuffled mix: `general` of them from general_prompts, the rest (code among them) from stdlib_prompts."""
    k = round(n * general)
    out = general_prompts(k, seed) + stdlib_prompts(n - k, seed)
    random.Random(seed).shuffle(out)
    return out


def _docstrings() -> tuple[list[str], list[tuple[str, str, str]]]:
    """(first paragraphs of module docstrings, (qualified name, signature line, first docstring line) of
    public functions and classes) from the standard library's top-level modules, in a fixed order."""
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


def stdlib_prompts(n: int, seed: int = 0) -> list[dict]:
    """n prompts {"prompt", "chat", "kind"}: about 35% prose, 40% chat, 25% code."""
    rng = random.Random(seed)
    modules, defs = _docstrings()
    out = []
    for i in range(n):
        r = rng.random()
        if r < 0.35:
            words = rng.choice(modules).split()
            out.append({"prompt": " ".join(words[: rng.randint(6, min(20, len(words) - 1))]), "chat": False,
                        "kind": "prose"})
        elif r < 0.75:
            qual, _, doc = rng.choice(defs)
            out.append({"prompt": rng.choice(_CHAT_TEMPLATES).format(qual=qual, doc=doc), "chat": True,
                        "kind": "chat"})
        else:
            _, sig, doc = rng.choice(defs)
            out.append({"prompt": f'{sig}\n    """{doc}"""\n', "chat": False, "kind": "code"})
    return out


def distill(model, tokenizer, prompts: list[dict], out_path, *, max_new_tokens: int = 128, batch_size: int = 32) -> dict:
    """Greedy-decode every prompt with mtpkit's engine and write one JSONL record per sample:
    {"input_ids": prompt + completion, "loss_mask": 0 on prompt tokens and 1 on the completion, "kind", "prompt"}.
    Returns {"samples", "tokens" (completion tokens), "seconds"}."""
    from ..decode.generate import generate

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_suffix(out_path.suffix + ".tmp")
    eos = tokenizer.eos_token_id
    encoded = [encode_prompt(tokenizer, p["prompt"], p["chat"]) for p in prompts]
    # similar lengths per batch: less padding waste in the prefill groups
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
    total, seconds = 0, 0.0
    with tmp.open("w") as f, tqdm(total=len(prompts), desc="distill", unit="prompt") as bar:
        for s in range(0, len(order), batch_size):
            idx = order[s : s + batch_size]
            res = generate(model, [encoded[i] for i in idx], max_new_tokens=max_new_tokens, eos_token_id=eos)
            seconds += res.stats["seconds"]
            for i, new in zip(idx, res.tokens):
                total += len(new)
                rec = {"input_ids": encoded[i] + new, "loss_mask": [0] * len(encoded[i]) + [1] * len(new),
                       "kind": prompts[i]["kind"], "prompt": prompts[i]["prompt"]}
                f.write(json.dumps(rec) + "\n")
            bar.update(len(idx))
    tmp.replace(out_path)
    return {"samples": len(prompts), "tokens": total, "seconds": seconds}
