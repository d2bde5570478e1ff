#!/usr/bin/env python3
"""llama.cpp side of `just bench-generate` (through llama-cpp-python, built from PyPI).

Reads the templated prompt ids that onepass's `generate_bench` example wrote and runs llama.cpp on
the same GGUF file *as quantized* (Q4_1 weights: llama.cpp computes on the quantized blocks,
onepass and transformers dequantize at load, so this peer reads ~1/7 of the weight bytes per token).
Same sampling: T = 1, top_p = 1, top_k and min_p off, no repetition penalty, at most max_new_tokens
new tokens, stopping at the end-of-turn ids. llama-cpp-python's `generate` decodes one sequence at
a time (no batch of n samples per step): each prompt is prefilled once per sample, minus what its
prompt cache keeps from the previous sample of the same prompt. One untimed warm-up on the first
prompt, then one timed pass. tok/s counts generated tokens up to and including each stop token, as
onepass counts them. Prints one JSON line.
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
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    a = ap.parse_args()

    import llama_cpp

    spec = json.load(open(a.ids))
    ids, n, max_new, eos = spec["ids"], spec["n"], spec["max_new_tokens"], set(spec["eos"])
    ctx = max(len(x) for x in ids) + max_new + 8
    llm = llama_cpp.Llama(model_path=a.model, n_ctx=ctx, n_threads=a.threads, n_threads_batch=a.threads,
                          seed=0, verbose=False, logits_all=False)

    def sample(prompt):
        count = 0
        for tok in llm.generate(prompt, top_k=0, top_p=1.0, min_p=0.0, temp=1.0, repeat_penalty=1.0, reset=True):
            count += 1
            if tok in eos or count >= max_new:
                break
        return count

    sample(ids[0])
    t0 = time.perf_counter()
    tokens = sum(sample(p) for p in ids for _ in range(n))
    s = time.perf_counter() - t0
    print(json.dumps({
        "engine": "llama.cpp", "dtype": "q4_1", "model": a.model, "llama_cpp_python": llama_cpp.__version__,
        "threads": a.threads, "batch": 1, "len": max_new, "reps": 1, "pass_s": [s], "tok_s": tokens / s,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, "abs_sum": float(tokens),
    }))


if __name__ == "__main__":
    sys.exit(main())
