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
    d, ff = shapes["hidden"], shapes["intermediate"]
    q_out = shapes["heads"] * shapes["head_dim"]
    kv_out = shapes["kv_heads"] * shapes["head_dim"]
    layers, vocab = shapes["layers"], shapes["vocab"]
    tokens = batch * length
    dims = {"q_proj": (d, q_out), "k_proj": (d, kv_out), "v_proj": (d, kv_out), "o_proj": (q_out, d),
            "gate_proj": (d, ff), "up_proj": (d, ff), "down_proj": (ff, d)}
    frozen_params = layers * sum(i * o for i, o in dims.values())
    parts = {
        "frozen": 2 * 2 * frozen_params * tokens,
        "lm_head": 2 * 2 * vocab * d * (batch * (length - length // 2)),
        "attention": layers * batch * 6 * 2 * length * length * q_out,
        "lora": layers * 3 * 2 * sum((dims[t][0] + dims[t][1]) * lora_rank for t in lora_targets) * tokens,
    }
    parts["total"] = sum(parts.values())
    return parts


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
