#!/usr/bin/env python3
"""Per deployed policy of a deploy run (e.g. deploy/online-mini): held-out policy_reward at the first and
last evaluation (mean over cells), each arm minus the base policy and minus best-of-n paired over
(seed, strategy) with the paired SE and the smallest difference it could detect (2 SE), the update and
critic statistics, and the time split per arm (generation, φ, reward model, policy, critic, evaluation;
seconds summed over cells). An arm is its policy, its reward source when the run sweeps it, and its
adapter life (persistent / fresh-per-chunk) when the run sweeps that.

    python3 scripts/policy_arms.py RUN_DIR
"""
import sys, numpy as np, pandas as pd
run=sys.argv[1]

def arm(df):
    """The arm's name: policy, (reward) when not learned, [adapter] when the run has both lives."""
    name=df.policy.copy()
    if "reward" in df and (df.reward.isin(["oracle","null"])).any():
        name=name+np.where(df.reward.isin(["oracle","null"]), " ("+df.reward+")", "")
    if "adapter" in df and df.adapter.replace("", np.nan).dropna().nunique()>1:
        name=name+np.where(df.adapter!="", " ["+df.adapter+"]", "")
    return name

p=pd.read_parquet(f"{run}/policy.parquet"); p["arm"]=arm(p)
last=p.chunk.max()
key=["seed","strategy"]
f=p[p.chunk==0].pivot_table(index=key,columns="arm",values="policy_reward")
l=p[p.chunk==last].pivot_table(index=key,columns="arm",values="policy_reward")
print(f"held-out policy_reward, chunk 0 → {last} (mean over {len(l)} (seed, strategy) cells)")
print(pd.DataFrame({"first":f.mean(),"last":l.mean()}).round(3).to_string())
base=p[p.chunk==0].groupby(key).sample_reward.first()
for a in l.columns:
    for b in ["base","best-of-n"]:
        if a==b: continue
        other = base if b=="base" else l.get(b)
        if other is None: continue
        d=(l[a]-other).dropna(); se=d.std(ddof=1)/np.sqrt(len(d)) if len(d)>1 else float("nan")
        print(f"{a} − {b}: {d.mean():+.3f} ± {se:.3f} (n={len(d)}, detectable {2*se:.3f})")
u=pd.read_parquet(f"{run}/policy_updates.parquet"); u["arm"]=arm(u)
cols=[c for c in ["kl","update_grad_norm","update_steps","critic_loss","value_mean","return_mean"] if c in u]
print(u[u.chunk>0].groupby("arm")[cols].mean().round(4).to_string())
t=pd.read_parquet(f"{run}/policy_timings.parquet")
c=pd.read_parquet(f"{run}/cells.parquet")[["cell_id","policy"]+[x for x in ["reward","adapter"] if x in pd.read_parquet(f"{run}/cells.parquet")]]
t=t.drop(columns=["policy"]).merge(c,on="cell_id"); t["arm"]=arm(t)
cols=[x for x in ["generation_s","phi_s","estimator_s","policy_s","critic_s","eval_s","eval_generation_s","eval_phi_s","eval_score_s"] if x in t]
print(t.groupby("arm")[cols].sum().round(0).to_string())
