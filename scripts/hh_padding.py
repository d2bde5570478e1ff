#!/usr/bin/env python3
"""Padding of a reward model's batches on HH-RLHF pairs (issue 30, session 26): how many tokens
the passes run against the tokens the sequences hold, in the order given and sorted by length.

  .venv-bench/bin/python scripts/hh_padding.py [--hf DIR] [--data FILE] [--seeds 1 2]

Held-out scoring: 400 random pairs, both sides adjacent, batches of 16 sequences (`[reward]
eval_batch`). Training: 592 random pairs in steps of 8, passes of 2 pairs (`pairs_per_pass`),
in the stream's order or sorted by each pair's longer side within the step. Lengths are the
SmolLM2 chat template's tokens (transformers' tokenizer of the converted model, `just
bench-online` makes it), + 2 for the EOS rule, capped at max_len 256 as prompt-first truncation
does. Random draws, not mini-hh-ci's exact split: the ratios, not the rows, are the point.
"""
import argparse
import gzip
import json
import random
import re

from transformers import AutoTokenizer


def messages(text):
    parts = re.split(r"\n\n(Human|Assistant): ", text)
    return [{"role": "user" if parts[i] == "Human" else "assistant", "content": parts[i + 1]}
            for i in range(1, len(parts) - 1, 2)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", default=".cache/bench/smollm2-135m-instruct")
    ap.add_argument("--data", default="../shared/datasets/hh_rlhf/helpful-base-test.jsonl.gz")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    a = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(a.hf)
    rows = [json.loads(line) for line in gzip.open(a.data)]

    def length(text):
        t = tok.apply_chat_template(messages(text), tokenize=False)
        return min(len(tok(t, add_special_tokens=False)["input_ids"]) + 2, 256)

    def padded(ls, b):
        return sum(len(ls[i:i + b]) * max(ls[i:i + b]) for i in range(0, len(ls), b))

    for seed in a.seeds:
        random.seed(seed)
        pairs = [(length(r["chosen"]), length(r["rejected"])) for r in random.sample(rows, 592)]
        held = [l for p in pairs[:400] for l in p]
        real = sum(held)
        print(f"seed {seed}: held-out scoring, batches of 16: given order {padded(held, 16) / real:.3f}x, "
              f"sorted {padded(sorted(held), 16) / real:.3f}x the tokens held")
        steps = [pairs[i:i + 8] for i in range(0, 592, 8)]
        real = sum(a + b for a, b in pairs)

        def cost(sort):
            tot = 0
            for s in steps:
                s = sorted(s, key=max) if sort else s
                tot += sum(4 * max(max(p) for p in s[i:i + 2]) for i in range(0, 8, 2))
            return tot

        print(f"seed {seed}: training, passes of 2 pairs: given {cost(False) / real:.3f}x, "
              f"sorted within the step {cost(True) / real:.3f}x")


if __name__ == "__main__":
    main()
