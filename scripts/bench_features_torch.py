#!/usr/bin/env python3
"""PyTorch + transformers side of `just bench-features`.

Reads the token ids that `onepass features bench --ids-out` wrote, loads the same model file
(a GGUF through transformers' GGUF loader, which dequantizes into plain nn.Linear in the
requested dtype, or a model directory), and times `model.model(ids)` -- the hidden states after
the final norm, no lm_head -- exactly as the candle side does: `--warmup` untimed passes, then
`--reps` timed ones, on `--threads` threads. Prints one JSON line.
"""
import argparse
import json
import os
import resource
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help=".gguf file or model directory")
    ap.add_argument("--ids", required=True, help="ids JSON from onepass features bench --ids-out")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    a = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    t0 = time.perf_counter()
    if a.model.endswith(".gguf"):
        d, f = os.path.split(os.path.abspath(a.model))
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype)
    model.eval()
    load_s = time.perf_counter() - t0
    spec = json.load(open(a.ids))
    x = torch.tensor(spec["ids"], dtype=torch.long)
    b, t = x.shape

    def run():
        with torch.inference_mode():
            h = model.model(input_ids=x).last_hidden_state
            return h[:, -1, :].float()

    for _ in range(a.warmup):
        run()
    passes = []
    for _ in range(a.reps):
        t1 = time.perf_counter()
        phi = run()
        passes.append(time.perf_counter() - t1)
    print(json.dumps({
        "engine": "torch",
        "model": a.model,
        "dtype": a.dtype,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "batch": b,
        "len": t,
        "reps": a.reps,
        "pass_s": passes,
        "tok_s": b * t * a.reps / sum(passes),
        "load_s": load_s,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "abs_sum": float(phi.abs().sum()),
    }))


if __name__ == "__main__":
    sys.exit(main())
