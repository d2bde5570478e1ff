#!/usr/bin/env python3
"""PyTorch + transformers + PEFT side of `just bench-rm-step`.

Reads the token ids the onepass side wrote (2*pairs rows of len tokens: pair i is rows 2i and
2i+1, label 1), loads the same GGUF through transformers (dequantized into plain nn.Linear,
float32), wraps it in PEFT LoRA (r = 8, alpha = 16, every linear layer of the blocks, dropout 0)
with a linear head theta = 1/(d+1) on the final-norm state of the last token, and times the
step the onepass side takes:
  sgd: loss = mean softplus(-(r_a - r_b)), backward, global-norm clip 1, theta -= 1e-3 * g;
  omd: paper Alg. 5 as the authors compute it (rm_trainer_hvp.py): g by autograd with
       create_graph, then K = 3 conjugate-gradient steps on (H + lambda I) v = g with exact
       Hessian-vector products by double backward (autograd.grad of g.p), lambda = 0.8 * t/T
       (T = 100, t = the step), then params -= 1e-3 * v.
Double backward needs attention that is twice differentiable: omd runs transformers' eager
attention (PyTorch's fused CPU attention has no second derivative); sgd runs the default (SDPA),
whichever is faster for it. One untimed warm-up step, then --reps timed ones, on --threads
threads. Prints one JSON line.
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
    ap.add_argument("--rule", choices=["sgd", "omd"], required=True)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(a.threads)
    d, f = os.path.split(os.path.abspath(a.model))
    kw = {"attn_implementation": "eager"} if a.rule == "omd" else {}
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32, **kw)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                             "gate_proj", "up_proj", "down_proj"]))
    model.train()
    backbone = model.base_model.model.model
    x = torch.tensor(json.load(open(a.ids))["ids"], dtype=torch.long)
    hidden = backbone.config.hidden_size
    theta = torch.full((hidden,), 1.0 / (hidden + 1), requires_grad=True)
    params = [q for q in model.parameters() if q.requires_grad] + [theta]

    def loss_fn():
        h = backbone(input_ids=x).last_hidden_state[:, -1, :]
        r = h @ theta
        return torch.nn.functional.softplus(-(r[0::2] - r[1::2])).mean()

    t_step = [0]

    def sgd():
        loss = loss_fn()
        gs = torch.autograd.grad(loss, params)
        norm = torch.sqrt(sum((g * g).sum() for g in gs))
        c = min(1.0, 1.0 / (float(norm) + 1e-6))
        with torch.no_grad():
            for p, g in zip(params, gs):
                p.sub_(1e-3 * c * g)
        return float(loss), 0

    def omd():
        t_step[0] += 1
        lam = max(1e-6, 0.8 * min(1.0, t_step[0] / 100))
        loss = loss_fn()
        gs = torch.autograd.grad(loss, params, create_graph=True)
        g = [q.detach() for q in gs]
        x_ = [torch.zeros_like(q) for q in g]
        r = [q.clone() for q in g]
        p = [q.clone() for q in g]
        rr = sum((q * q).sum() for q in r)
        hvps = 0
        for k in range(3):
            hv = torch.autograd.grad(sum((gi * pi).sum() for gi, pi in zip(gs, p)), params, retain_graph=True)
            hvps += 1
            ap_ = [h + lam * pi for h, pi in zip(hv, p)]
            pap = sum((pi * a_).sum() for pi, a_ in zip(p, ap_))
            if pap <= 0:
                if k == 0:
                    x_ = g
                break
            alpha = rr / pap
            x_ = [xi + alpha * pi for xi, pi in zip(x_, p)]
            if k == 2:
                break
            r = [ri - alpha * a_ for ri, a_ in zip(r, ap_)]
            rr_new = sum((q * q).sum() for q in r)
            p = [ri + (rr_new / rr) * pi for ri, pi in zip(r, p)]
            rr = rr_new
        with torch.no_grad():
            for q, v in zip(params, x_):
                q.sub_(1e-3 * v)
        return float(loss), hvps

    step = sgd if a.rule == "sgd" else omd
    step()
    times, loss, hvps = [], 0.0, 0
    for _ in range(a.reps):
        t1 = time.perf_counter()
        loss, hvps = step()
        times.append(time.perf_counter() - t1)
    print(json.dumps({
        "engine": "torch", "rule": a.rule, "model": a.model, "dtype": "float32", "torch": torch.__version__,
        "threads": torch.get_num_threads(), "pairs": x.shape[0] // 2, "len": x.shape[1], "reps": a.reps,
        "step_s": times, "hvps": hvps,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, "loss": loss,
    }))


if __name__ == "__main__":
    sys.exit(main())
