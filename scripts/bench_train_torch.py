#!/usr/bin/env python3
"""PyTorch + transformers + PEFT side of `just bench-train`.

Reads the token ids the onepass side wrote (batch × len, the second half of each row the
response), loads the same GGUF through transformers (dequantized into plain nn.Linear, float32),
wraps it in PEFT LoRA (r = 8, alpha = 16, q_proj and v_proj, dropout 0) and times the same
step: loss = -mean over rows of the sum of log pi over the response tokens, backward, gradient
clipping at global norm 1, Adam (lr 1e-4). One untimed warm-up step, then --reps timed ones, on
--threads threads. Prints one JSON line (the fields of bench_features_report.py).
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
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the frozen weights' dtype (bfloat16: PEFT keeps the adapters in float32)")
    a = ap.parse_args()

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(a.threads)
    d, f = os.path.split(os.path.abspath(a.model))
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=getattr(torch, a.dtype))
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                             target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    model.train()
    spec = json.load(open(a.ids))
    x = torch.tensor(spec["ids"], dtype=torch.long)
    b, t = x.shape
    p = spec["response_from"]
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.Adam(params, lr=1e-4)

    def step():
        logits = model(input_ids=x).logits[:, p - 1:t - 1, :]
        lp = torch.log_softmax(logits.float(), dim=-1).gather(-1, x[:, p:].unsqueeze(-1)).squeeze(-1)
        loss = -lp.sum(dim=1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return float(loss)

    step()
    passes, loss = [], 0.0
    for _ in range(a.reps):
        t1 = time.perf_counter()
        loss = step()
        passes.append(time.perf_counter() - t1)
    print(json.dumps({
        "engine": "torch", "model": a.model, "dtype": a.dtype, "torch": torch.__version__,
        "adapter_dtype": str(params[0].dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(), "batch": b, "len": t, "reps": a.reps, "pass_s": passes,
        "tok_s": b * t * a.reps / sum(passes),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, "abs_sum": loss,
    }))


if __name__ == "__main__":
    sys.exit(main())
