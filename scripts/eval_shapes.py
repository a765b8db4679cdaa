"""Caption accuracy and MTP acceptance of a model trained with configs/shapes_qwen35_vl_tiny.toml, on the held-back
scenes (val.jsonl, never trained on): greedy captions, plain and speculative, compared with the true captions.

    python scripts/eval_shapes.py runs/shapes_qwen35_vl_tiny/hf [--data ~/.cache/mtpkit/shapes] [--k 3]
"""

import argparse
import json
from pathlib import Path

import mtpkit
from mtpkit.models.multimodal import open_images
from mtpkit.datasets.shapes import PROMPT


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="the exported model directory")
    p.add_argument("--data", default="~/.cache/mtpkit/shapes", help="the prepare_shapes.py directory")
    p.add_argument("--k", type=int, default=3, help="draft tokens for the speculative run")
    p.add_argument("--batch", type=int, default=20, help="prompts decoded together")
    args = p.parse_args()
    root = Path(args.data).expanduser()
    model, tok, _, _ = mtpkit.load_for_decoding(args.model, vision=True)
    processor = mtpkit.load_processor(args.model)
    records = [json.loads(line) for line in (root / "val.jsonl").read_text().splitlines()]
    images = [root / r["messages"][0]["content"][0]["image"] for r in records]
    prompts = [mtpkit.image_inputs(model, processor, PROMPT, open_images([im]), chat=True) for im in images]
    truth = [r["messages"][1]["content"] for r in records]
    same = exact = 0
    totals = {"verification_steps": 0, "accepted": 0, "drafted": 0}
    for i in range(0, len(prompts), args.batch):
        batch = prompts[i : i + args.batch]
        plain = mtpkit.generate(model, batch, max_new_tokens=64, eos_token_id=tok.eos_token_id)
        fast = mtpkit.generate(model, batch, max_new_tokens=64, draft_tokens=args.k, eos_token_id=tok.eos_token_id)
        same += sum(a == b for a, b in zip(plain.tokens, fast.tokens))
        exact += sum(tok.decode(t, skip_special_tokens=True).strip() == c for t, c in zip(plain.tokens, truth[i:]))
        for key in totals:
            totals[key] += fast.stats[key]
    n = len(prompts)
    print(f"{n} held-back scenes: caption exact match {exact}/{n} ({exact / n:.1%}); speculative k={args.k} "
          f"identical to plain {same}/{n}; acceptance rate {totals['accepted'] / totals['drafted']:.1%}, mean "
          f"acceptance length {1 + totals['accepted'] / totals['verification_steps']:.2f}")


if __name__ == "__main__":
    main()
