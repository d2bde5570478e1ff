"""Writes the data order of PyTorch's DistributedSampler (shuffle=True, epoch 0) as an int64 .npy
for `env.order = "indices"`: torch.randperm(n) from a generator seeded `seed` (+ epoch 0), what
the authors' `openrlhf/utils/distributed_sampler.py` draws. Rust cannot reproduce torch's
generator, so the permutation is exported once.
Usage: python3 scripts/export_randperm.py N SEED OUT.npy"""
import sys

import numpy as np
import torch

n, seed, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
g = torch.Generator()
g.manual_seed(seed)
perm = torch.randperm(n, generator=g).numpy().astype(np.int64)
assert sorted(perm.tolist()) == list(range(n))
np.save(out, perm)
print(f"{out}: torch.randperm({n}) with seed {seed}; first entries {perm[:8].tolist()}")
