#!/usr/bin/env python3
"""transformers side of `just bench-generate`.

Reads the templated prompt ids that onepass's `generate_bench` example wrote (with n,
max_new_tokens, batch_prompts and the end-of-turn ids), loads the same model file (a GGUF through
transformers' GGUF loader, dequantized into the requested dtype), and times `model.generate()`
on the same shape: batch_prompts prompts × n samples per call (left-padded), T = 1, top_p = 1,
no top_k, at most max_new_tokens new tokens, stopping at the end-of-turn ids. One untimed warm-up
call on the first batch, then one timed pass over all prompts. tok/s counts the generated tokens
up to and including each row's stop token, as onepass counts them. Prints one JSON line.
"""
import argparse
import json
import os
import resource
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--ids", required=True)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    a = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, a.dtype)
    d, f = os.path.split(os.path.abspath(a.model))
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=dtype) if a.model.endswith(".gguf") \
        else AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype)
    model.eval()
    spec = json.load(open(a.ids))
    ids, n, max_new, bp, eos = spec["ids"], spec["n"], spec["max_new_tokens"], spec["batch_prompts"], spec["eos"]
    pad = eos[0]

    def call(batch):
        t = max(len(x) for x in batch)
        x = torch.tensor([[pad] * (t - len(r)) + r for r in batch], dtype=torch.long)
        m = torch.tensor([[0] * (t - len(r)) + [1] * len(r) for r in batch], dtype=torch.long)
        with torch.inference_mode():
            out = model.generate(input_ids=x, attention_mask=m, do_sample=True, temperature=1.0, top_p=1.0,
                                 top_k=0, max_new_tokens=max_new, num_return_sequences=n,
                                 eos_token_id=eos, pad_token_id=pad)
        new = out[:, t:].tolist()
        count = 0
        for row in new:
            k = next((i + 1 for i, tok in enumerate(row) if tok in eos), len(row))
            count += min(k, max_new)
        return count

    call(ids[:bp])
    t0 = time.perf_counter()
    tokens = sum(call(ids[i:i + bp]) for i in range(0, len(ids), bp))
    s = time.perf_counter() - t0
    print(json.dumps({
        "engine": "torch", "dtype": a.dtype, "model": a.model, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "batch": bp * n, "len": max_new, "reps": 1,
        "pass_s": [s], "tok_s": tokens / s,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, "abs_sum": float(tokens),
    }))


if __name__ == "__main__":
    sys.exit(main())
