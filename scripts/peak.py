#!/usr/bin/env python3
"""The machine's peak FLOP rate per dtype, and the FLOPs of a bench's pass counted from the
model's shapes: the one place the bench reports take "% of peak" from.

Peak (FLOP/s) = cores x FLOP per cycle per core x clock, where

- f32: FMA units x lanes x 2 (an FMA is a multiply and an add). Lanes: 16 with AVX-512F, 8 with
  AVX2+FMA, 4 otherwise. FMA units: ASSUMED 2 on Intel (Skylake-SP and later Xeons with two
  512-bit FMA ports; client parts with one would read half the peak) and on AVX2-only AMD; 1 on
  AMD with AVX-512 (Zen 4 runs a 512-bit FMA as two 256-bit halves). ONEPASS_FMA_UNITS overrides.
- bf16 with AMX (amx_bf16): the TMUL rate, 1,024 FLOP per cycle per core (512 bf16
  multiply-adds: a full 16 x 16 x 32 TDPBF16PS is 8,192 multiply-adds issued every 16 cycles, the
  "1,024 BF16 operations per cycle" Intel gives for 4th-gen Xeon Scalable). Taken from Intel's
  published figure, not measured here.
- bf16 with AVX-512 BF16 only: VDPBF16PS does 32 bf16 multiply-adds per 512-bit instruction, so
  FMA units x 32 x 2.
- bf16 without bf16 instructions: the f32 peak (the products run as f32).

Clock: the kernel's reported frequency (/sys/devices/system/cpu/cpu0/cpufreq/base_frequency when
present, else /proc/cpuinfo "cpu MHz") — the nominal or observed clock, not turbo; in a VM
"cpu MHz" is the host's nominal clock as the hypervisor reports it. Cores: os.cpu_count() (the
logical CPUs the process may use; with two hyperthreads per core this overstates the peak 2x).

    python3 scripts/peak.py            # the peaks of this machine, one line per dtype
    python3 scripts/peak.py --json     # the same as JSON

Python 3 standard library only.
"""

import json
import os
import sys


def cpu_info(cpuinfo_text=None):
    """Cores, flags, vendor and clock (MHz) of this machine, and where the clock came from."""
    if cpuinfo_text is None:
        try:
            cpuinfo_text = open("/proc/cpuinfo").read()
        except OSError:
            cpuinfo_text = ""
    lines = cpuinfo_text.splitlines()

    def field(name):
        return next((l.split(":", 1)[1].strip() for l in lines if l.split(":")[0].strip() == name), None)

    flags = (field("flags") or "").split()
    mhz, source = None, None
    try:
        khz = int(open("/sys/devices/system/cpu/cpu0/cpufreq/base_frequency").read())
        mhz, source = khz / 1000, "cpufreq base_frequency"
    except (OSError, ValueError):
        pass
    if mhz is None and field("cpu MHz"):
        mhz, source = float(field("cpu MHz")), "/proc/cpuinfo cpu MHz"
    return {
        "cores": os.cpu_count() or 1,
        "flags": flags,
        "vendor": field("vendor_id") or "",
        "model": field("model name") or "",
        "mhz": mhz,
        "clock_source": source,
    }


def fma_units(info):
    """FMA units per core (assumed; see the module doc); ONEPASS_FMA_UNITS overrides."""
    if os.environ.get("ONEPASS_FMA_UNITS"):
        return int(os.environ["ONEPASS_FMA_UNITS"])
    if info["vendor"] == "AuthenticAMD" and "avx512f" in info["flags"]:
        return 1
    return 2


def flop_per_cycle(dtype, info):
    """FLOP per cycle per core for products in `dtype` ("f32" or "bf16")."""
    flags = info["flags"]
    lanes = 16 if "avx512f" in flags else (8 if "avx2" in flags and "fma" in flags else 4)
    f32 = fma_units(info) * lanes * 2
    if dtype == "f32":
        return f32, f"{fma_units(info)} FMA units x {lanes} f32 lanes x 2"
    if dtype != "bf16":
        raise ValueError(f"dtype {dtype}: expected f32 or bf16")
    if "amx_bf16" in flags:
        return 1024, "AMX TMUL: 1,024 bf16 FLOP/cycle (Intel's figure)"
    if "avx512_bf16" in flags:
        return fma_units(info) * 32 * 2, f"{fma_units(info)} units x 32 bf16 pairs (VDPBF16PS) x 2"
    return f32, "no bf16 instructions: the f32 rate"


def peak(dtype, info=None):
    """Peak FLOP/s for `dtype` on the machine `info` (cpu_info() when None), or None without a clock."""
    info = info or cpu_info()
    per_cycle, _ = flop_per_cycle(dtype, info)
    if not info["mhz"]:
        return None
    return info["cores"] * per_cycle * info["mhz"] * 1e6


def _dims(shapes):
    """(in, out) of each linear layer of a Llama/Qwen2 block, from the model's shapes."""
    d, ff = shapes["hidden"], shapes["intermediate"]
    q_out = shapes["heads"] * shapes["head_dim"]
    kv_out = shapes["kv_heads"] * shapes["head_dim"]
    return {"q_proj": (d, q_out), "k_proj": (d, kv_out), "v_proj": (d, kv_out), "o_proj": (q_out, d),
            "gate_proj": (d, ff), "up_proj": (d, ff), "down_proj": (ff, d)}


ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def train_step_flops(shapes, batch, length, lora_rank=8, lora_targets=("q_proj", "v_proj")):
    """FLOPs of one LoRA policy-update step (scripts/bench_train.sh: forward, backward, Adam) on
    `batch` sequences of `length` tokens whose second half is the response, counted as 2 x m x k x n
    per matrix product; elementwise work (norms, RoPE, softmax, SiLU, Adam) is not counted.

    - frozen linear layers (q, k, v, o, gate, up, down of every layer): the forward and the input
      gradient, 2 x 2 x params x tokens (no weight gradient: they are frozen);
    - LM head (vocab x hidden) on the response rows only (batch x length/2; what the loss reads):
      forward and input gradient;
    - attention, dense (the masked half of the causal scores counted, as both engines compute
      it): QK^T and PV forward (2 products), backward dP, dV, dQ, dK (4): 6 x 2 x L^2 x heads x
      head_dim per layer and sequence;
    - LoRA adapters (A: in x r, B: r x out on each target): forward, input gradient and weight
      gradient, 3 x 2 x (in + out) x r x tokens.

    Returns a dict of the parts and their "total"."""
    q_out = shapes["heads"] * shapes["head_dim"]
    layers, vocab, d = shapes["layers"], shapes["vocab"], shapes["hidden"]
    tokens = batch * length
    dims = _dims(shapes)
    frozen_params = layers * sum(i * o for i, o in dims.values())
    parts = {
        "frozen": 2 * 2 * frozen_params * tokens,
        "lm_head": 2 * 2 * vocab * d * (batch * (length - length // 2)),
        "attention": layers * batch * 6 * 2 * length * length * q_out,
        "lora": layers * 3 * 2 * sum((dims[t][0] + dims[t][1]) * lora_rank for t in lora_targets) * tokens,
    }
    parts["total"] = sum(parts.values())
    return parts


def features_flops(shapes, batch, length):
    """FLOPs of one φ pass (`onepass features bench`, scripts/bench_features_torch.py): the decoder's
    forward over `batch` sequences of `length` tokens to the final-norm hidden state, no LM head
    (φ is that state). Counted as in train_step_flops: the linear layers' forward, 2 x params x
    tokens, and dense attention forward (QK^T and PV), 2 x 2 x L^2 x heads x head_dim per layer and
    sequence; elementwise work not counted. Returns the parts and their "total"."""
    q_out = shapes["heads"] * shapes["head_dim"]
    params = shapes["layers"] * sum(i * o for i, o in _dims(shapes).values())
    parts = {
        "frozen": 2 * params * batch * length,
        "attention": shapes["layers"] * batch * 2 * 2 * length * length * q_out,
    }
    parts["total"] = sum(parts.values())
    return parts


def generate_flops(shapes, prompt_lens, samples, generated):
    """FLOPs of a generation run (`just bench-generate`): each prompt of `prompt_lens` (tokens)
    prefilled once (features_flops at its length, plus the LM head on its last row), then
    `generated` tokens in all, decoded one at a time over prompts x `samples` sequences with a KV
    cache: per token the linear layers and the LM head, 2 x (params + vocab x hidden), and
    attention to its context, 2 x 2 x ctx x heads x head_dim per layer. The context sums use each
    sequence's mean length (generated / sequences), so they are exact when all sequences stop at
    the same length and a slight undercount otherwise (attention is a few % of a token at these
    lengths). The minimal algorithm's count: an engine that prefills a prompt once per sample
    (transformers' `generate` expands the batch first) does more work than is counted.
    Returns the parts and their "total"."""
    q_out = shapes["heads"] * shapes["head_dim"]
    layers, vocab, d = shapes["layers"], shapes["vocab"], shapes["hidden"]
    params = layers * sum(i * o for i, o in _dims(shapes).values())
    prefill = sum(features_flops(shapes, 1, p)["total"] + 2 * vocab * d for p in prompt_lens)
    seqs = len(prompt_lens) * samples
    g = generated / seqs if seqs else 0.0
    # Σ over a sequence's decode steps j = 0..g-1 of its context P + j + 1, summed over sequences
    ctx = sum(samples * (g * p + g * (g + 1) / 2) for p in prompt_lens)
    parts = {
        "prefill": prefill,
        "decode": 2 * (params + vocab * d) * generated,
        "attention": layers * 2 * 2 * q_out * ctx,
    }
    parts["total"] = sum(parts.values())
    return parts


# Gradient passes one Hessian-vector product costs, by how it is formed (matrix products only):
# central differences two gradients; forward differences one; the exact products (onepass's
# R-operator over the recorded pass, PyTorch's double backward) a tangent forward and a tangent
# backward, about one; the Gauss-Newton product two forwards and one backward, 1.5 (a forward is
# half a gradient pass when the frozen weights need no weight gradient).
HVP_PASSES = {"central": 2.0, "forward": 1.0, "exact": 1.0, "gauss-newton": 1.5}


def rm_step_flops(shapes, pairs, length, hvps=0, hvp="exact", lora_rank=8, lora_targets=ALL_TARGETS):
    """FLOPs of one reward-model step (`just bench-rm-step`: LoRA r on every linear layer, a head
    on the last token's state) on `pairs` pairs of two `length`-token sequences: one gradient
    pass — frozen products forward and input gradient, dense attention forward and backward, the
    adapters' three products, as in train_step_flops but with no LM head — plus `hvps`
    Hessian-vector products at HVP_PASSES[hvp] gradient passes each (an approximation for the
    matrix products, stated there). Returns the parts, "grad_pass" and "total"."""
    f = train_step_flops({**shapes, "vocab": 0}, 2 * pairs, length, lora_rank, lora_targets)
    grad = f["total"]
    parts = {"grad_pass": grad, "hvps": hvps * HVP_PASSES[hvp] * grad}
    parts["total"] = grad + parts["hvps"]
    return parts


def model_shapes(path):
    """The shapes the counts need (hidden, intermediate, layers, heads, kv_heads, head_dim, vocab)
    from a GGUF file's metadata or a transformers directory's config.json."""
    if os.path.isdir(path):
        c = json.load(open(os.path.join(path, "config.json")))
        heads = c["num_attention_heads"]
        return {"hidden": c["hidden_size"], "intermediate": c["intermediate_size"],
                "layers": c["num_hidden_layers"], "heads": heads,
                "kv_heads": c.get("num_key_value_heads", heads),
                "head_dim": c.get("head_dim") or c["hidden_size"] // heads, "vocab": c["vocab_size"]}
    kv = gguf_metadata(path)
    arch = kv["general.architecture"]
    heads = kv[f"{arch}.attention.head_count"]
    vocab = kv.get(f"{arch}.vocab_size") or kv["tokenizer.ggml.tokens"]
    return {"hidden": kv[f"{arch}.embedding_length"], "intermediate": kv[f"{arch}.feed_forward_length"],
            "layers": kv[f"{arch}.block_count"], "heads": heads,
            "kv_heads": kv.get(f"{arch}.attention.head_count_kv", heads),
            "head_dim": kv.get(f"{arch}.attention.key_length") or kv[f"{arch}.embedding_length"] // heads,
            "vocab": vocab}


def gguf_metadata(path):
    """A GGUF file's key-value metadata (format version 2 or 3, little-endian): scalars and
    strings as values; an array is given as its length (the tokenizer's token list is long and
    only its length is needed). Raises ValueError, naming the file, on anything else."""
    import struct
    scalar = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
    with open(path, "rb") as f:
        def read(fmt):
            size = struct.calcsize(fmt)
            b = f.read(size)
            if len(b) != size:
                raise ValueError(f"{path}: GGUF metadata ends early")
            return struct.unpack(fmt, b)[0]

        def string():
            return f.read(read("<Q")).decode("utf-8", "replace")

        def value(t):
            if t in scalar:
                return read(scalar[t])
            if t == 8:
                return string()
            if t == 9:
                inner, n = read("<I"), read("<Q")
                for _ in range(n):
                    value(inner)
                return n
            raise ValueError(f"{path}: GGUF value type {t}: expected 0-12")

        if f.read(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file (expected the magic GGUF)")
        version = read("<I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version}: expected 2 or 3")
        read("<Q")  # tensor count
        out = {}
        for _ in range(read("<Q")):
            key = string()
            out[key] = value(read("<I"))
        return out


def main(argv):
    info = cpu_info()
    rows = {}
    for dt in ("f32", "bf16"):
        per_cycle, how = flop_per_cycle(dt, info)
        rows[dt] = {"flop_per_cycle_per_core": per_cycle, "how": how, "peak_gflops": (peak(dt, info) or 0) / 1e9}
    if "--json" in argv:
        print(json.dumps({"cores": info["cores"], "mhz": info["mhz"], "clock_source": info["clock_source"], **rows}))
        return
    for dt, r in rows.items():
        print(f"{dt}: {r['peak_gflops']:.0f} GFLOP/s = {info['cores']} cores x {r['flop_per_cycle_per_core']} FLOP/cycle "
              f"({r['how']}) x {info['mhz']} MHz ({info['clock_source']})")


if __name__ == "__main__":
    main(sys.argv[1:])
