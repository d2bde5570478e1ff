#!/usr/bin/env python3
"""Per deployed policy of a deploy run (e.g. deploy/online-mini): held-out policy_reward at the first and
last evaluation (mean over cells), each arm minus the base policy and minus best-of-n paired over
(seed, strategy) with the paired SE, the update and critic statistics, and the time split per arm.

    python3 scripts/policy_arms.py RUN_DIR
"""
import sys, numpy as np, pandas as pd
run=sys.argv[1]
p=pd.read_parquet(f"{run}/policy.parquet")
last=p.chunk.max()
key=["seed","strategy"]
f=p[p.chunk==0].pivot_table(index=key,columns="policy",values="policy_reward")
l=p[p.chunk==last].pivot_table(index=key,columns="policy",values="policy_reward")
print("first → last (mean over 4 cells)"); print(pd.DataFrame({"first":f.mean(),"last":l.mean()}).round(3).to_string())
for a in l.columns:
    for b in ["base","best-of-n"]:
        if a==b: continue
        other = p[p.chunk==0].groupby(key).sample_reward.first() if b=="base" else l[b]
        d=(l[a]-other).dropna(); print(f"{a} − {b}: {d.mean():+.3f} ± {d.std(ddof=1)/np.sqrt(len(d)):.3f} (n={len(d)})")
u=pd.read_parquet(f"{run}/policy_updates.parquet")
print(u.groupby("policy")[["kl","update_grad_norm","critic_loss","value_mean","return_mean"]].mean().round(4).to_string())
t=pd.read_parquet(f"{run}/policy_timings.parquet")
print(t.groupby("policy")[["generation_s","phi_s","estimator_s","policy_s","eval_s"]].sum().round(0).to_string())
