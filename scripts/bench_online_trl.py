#!/usr/bin/env python3
"""bench-online's peer: one chunk of online-mini's loop in TRL (issue 31).

The same chunk onepass times (scripts/bench_online.sh): the policy (SmolLM2-135M-Instruct in
f32, LoRA r 8 / alpha 16 on q_proj and v_proj, PEFT) samples n completions (T = 1, top-p 1, no
top-k, <= max_new tokens) of the chunk's prompts, a reward function returns phi^T theta (phi: the
final-norm hidden state at the last token of the chat-templated conversation, from the frozen
model in PyTorch; theta: a fixed random vector, which does not change the timing), TRL's
RLOOTrainer takes one update on them (sequence-level k1 KL penalty beta, clip 0.2, advantages
normalised, minibatch 8, one epoch: steps_per_generation = samples / minibatch; gradient
checkpointing off), then a held-out evaluation (eval prompts x n
samples, their phi and reward, the policy's and the reference's log-probabilities for KL and
entropy) as onepass's evaluation does.

TRL trains max_steps = 2 x steps_per_generation: the first generation round warms up (as
onepass's first chunk does) and the second is the chunk timed. Prints one JSON line: seconds of
generation, phi + reward, scoring (TRL's old and reference log-probabilities), update, the
evaluation's parts, and the chunk's total.

Usage: bench_online_trl.py --hf DIR --run RUN_DIR --prompts FILE --rows 8 --eval-prompts 8
       --n 4 --max-new 32 --threads 2
"""
import argparse
import json
import math
import time
from collections import defaultdict

import numpy as np
import pyarrow.parquet as pq
import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True, help="transformers directory of the policy (scripts/gguf_to_hf.py)")
    ap.add_argument("--run", required=True, help="onepass's run directory: its second chunk's prompts")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--eval-prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--beta", type=float, default=0.05)
    ap.add_argument("--minibatch", type=int, default=8)
    ap.add_argument("--out", default="/tmp/bench-online-trl")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the models' weights (bfloat16: TRL's bf16=True; PEFT keeps the adapters float32)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)

    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import RLOOConfig, RLOOTrainer

    rows = [json.loads(l)["prompt"] for l in open(a.prompts) if l.strip()]
    # the chunk onepass timed: its second chunk's prompts, as rounds.parquet lists them
    rounds = pq.read_table(f"{a.run}/rounds.parquet").to_pandas()
    first_cell = rounds.cell_id.iloc[0]
    chunk = rounds[(rounds.chunk == 2) & (rounds.cell_id == first_cell)].prompt.tolist()
    train = [rows[i] for i in chunk]
    held_out = rows[a.rows : a.rows + a.eval_prompts]

    tok = AutoTokenizer.from_pretrained(a.hf)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    end_of_turn = tok.convert_tokens_to_ids("<|im_end|>")
    frozen = AutoModelForCausalLM.from_pretrained(a.hf, dtype=getattr(torch, a.dtype)).eval()
    d = frozen.config.hidden_size
    theta = torch.from_numpy(np.random.default_rng(0).standard_normal(d) / math.sqrt(d)).float()
    times = defaultdict(float)

    def phi_reward(prompts, completions, **_):
        texts = [tok.apply_chat_template(p + c, tokenize=False) for p, c in zip(prompts, completions)]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False, truncation=True, max_length=256)
        with torch.no_grad():
            h = frozen.model(**enc).last_hidden_state[:, -1, :].float()
        return (h @ theta).tolist()

    samples = len(train) * a.n
    steps_per_generation = max(1, samples // a.minibatch)
    args = RLOOConfig(
        output_dir=a.out,
        use_cpu=True,
        bf16=a.dtype == "bfloat16",
        learning_rate=a.lr,
        per_device_train_batch_size=a.minibatch,
        steps_per_generation=steps_per_generation,
        gradient_accumulation_steps=1,
        num_generations=a.n,
        max_completion_length=a.max_new,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=a.beta,
        normalize_advantages=True,
        # onepass keeps every activation for the backward; TRL's default recomputes them
        # (gradient checkpointing), which a small model does not need: off, in TRL's favour
        gradient_checkpointing=False,
        num_iterations=1,
        max_steps=2 * steps_per_generation,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        generation_kwargs={"eos_token_id": end_of_turn},
    )
    peft = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")
    policy = AutoModelForCausalLM.from_pretrained(a.hf, dtype=getattr(torch, a.dtype))
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in train])
    trainer = RLOOTrainer(model=policy, reward_funcs=phi_reward, args=args, train_dataset=data,
                          processing_class=tok, peft_config=peft)

    # time TRL's own steps by wrapping them on the instance: generation, the reward functions,
    # generate-and-score (generation + rewards + old/reference log-probabilities) and each
    # training step (which calls generate-and-score once per round); only the second round counts
    timed_round = [False]

    def wrap(name):
        f = getattr(trainer, name)

        def g(*args, **kw):
            t0 = time.perf_counter()
            try:
                return f(*args, **kw)
            finally:
                if timed_round[0]:
                    times[name] += time.perf_counter() - t0

        setattr(trainer, name, g)

    for name in ["_generate", "_calculate_rewards", "_generate_and_score_completions", "training_step"]:
        wrap(name)
    from transformers import TrainerCallback

    class Round(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            timed_round[0] = state.global_step >= steps_per_generation

    trainer.add_callback(Round())
    trainer.train()
    generation = times["_generate"]
    reward = times["_calculate_rewards"]
    scoring = times["_generate_and_score_completions"] - generation - reward
    update = times["training_step"] - times["_generate_and_score_completions"]

    # the held-out evaluation, as onepass's: samples of the current policy, phi and reward,
    # log-probabilities of the policy and of the reference (adapters off) for KL and entropy
    model = trainer.model
    model.eval()
    t0 = time.perf_counter()
    enc = tok.apply_chat_template([[{"role": "user", "content": p}] for p in held_out], add_generation_prompt=True,
                                  return_tensors="pt", padding=True, return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=a.max_new,
                             num_return_sequences=a.n, eos_token_id=end_of_turn, pad_token_id=tok.pad_token_id)
    t1 = time.perf_counter()
    plen = enc["input_ids"].shape[1]
    completions = tok.batch_decode(out[:, plen:], skip_special_tokens=True)
    prompts = [[{"role": "user", "content": p}] for p in held_out for _ in range(a.n)]
    phi_reward(prompts, [[{"role": "assistant", "content": c}] for c in completions])
    t2 = time.perf_counter()
    mask = enc["attention_mask"].repeat_interleave(a.n, 0)
    resp = out[:, plen:]
    body = torch.ones_like(resp)
    for i in range(resp.shape[0]):
        stop = (resp[i] == end_of_turn).nonzero()
        if len(stop):
            body[i, stop[0, 0] + 1 :] = 0
    att = torch.cat([mask, body], 1)

    def logps():
        # the LM head and log-softmax only where a response token is predicted (as TRL does)
        with torch.no_grad():
            logits = model(input_ids=out, attention_mask=att, logits_to_keep=resp.shape[1] + 1).logits[:, :-1, :]
            lp = torch.log_softmax(logits.float(), -1).gather(-1, resp.unsqueeze(-1)).squeeze(-1)
        return (lp * body).sum(1)

    lp = logps()
    with model.disable_adapter():
        lr = logps()
    kl = (lp - lr).mean().item()
    t3 = time.perf_counter()
    ev = {"eval_generation_s": t1 - t0, "eval_phi_s": t2 - t1, "eval_score_s": t3 - t2}
    res = {
        "engine": "trl",
        "dtype": {"float32": "f32", "bfloat16": "bf16"}[a.dtype],
        "trl": __import__("trl").__version__,
        "torch": torch.__version__,
        "threads": a.threads,
        "prompts": len(train),
        "n": a.n,
        "generation_s": generation,
        "phi_s": reward,
        "score_s": scoring,
        "update_s": update,
        **ev,
        "eval_s": sum(ev.values()),
        "chunk_s": generation + reward + scoring + update + sum(ev.values()),
        "eval_kl": kl,
    }
    print(json.dumps(res))


if __name__ == "__main__":
    main()
