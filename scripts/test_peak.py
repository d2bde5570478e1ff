#!/usr/bin/env python3
"""Tests of scripts/peak.py: the step's FLOP count against a hand count on a tiny shape, and the
peaks against hand-multiplied figures for given CPUs.

    python3 scripts/test_peak.py

Python 3 standard library only.
"""

import os
import pathlib
import sys
import unittest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import peak  # noqa: E402

TINY = {"hidden": 4, "intermediate": 8, "layers": 1, "heads": 2, "kv_heads": 1, "head_dim": 2, "vocab": 10}


def cpu(flags, vendor="GenuineIntel", mhz=2000.0, cores=2):
    return {"cores": cores, "flags": flags.split(), "vendor": vendor, "model": "", "mhz": mhz, "clock_source": "test"}


class TrainStepFlops(unittest.TestCase):
    def test_tiny_shape_by_hand(self):
        # One sequence of 2 tokens (response: the last 1), LoRA r = 1 on q and v.
        # Frozen weights: q 4x4 = 16, k 4x2 = 8, v 4x2 = 8, o 4x4 = 16, gate/up/down 4x8 = 32 each
        # -> 144 params; forward 2*144*2 = 576, input gradient 576 -> 1152.
        # LM head 10x4 = 40 on 1 response row: forward 80 + input gradient 80 = 160.
        # Attention: QK^T is (2x2)·(2x2) per head = 2*2*2*2 = 16 FLOPs, x 2 heads = 32; PV the same:
        # forward 64; backward 4 such products: 128; total 192.
        # LoRA: q: A 4x1 + B 1x4 = 8 params, v: A 4x1 + B 1x2 = 6 -> 14; forward 2*14*2 = 56,
        # input gradient 56, weight gradient 56 -> 168.
        f = peak.train_step_flops(TINY, batch=1, length=2, lora_rank=1)
        self.assertEqual(f["frozen"], 1152)
        self.assertEqual(f["lm_head"], 160)
        self.assertEqual(f["attention"], 192)
        self.assertEqual(f["lora"], 168)
        self.assertEqual(f["total"], 1152 + 160 + 192 + 168)

    def test_kv_heads_and_length_matter(self):
        # negative control: full-width k/v (kv_heads = heads) adds 2 x (4x2) params per layer,
        # 2*2*16*2 = 128 FLOPs; doubling the length quadruples the attention
        base = peak.train_step_flops(TINY, batch=1, length=2, lora_rank=1)
        wide = peak.train_step_flops({**TINY, "kv_heads": 2}, batch=1, length=2, lora_rank=1)
        self.assertEqual(wide["frozen"] - base["frozen"], 128)
        longer = peak.train_step_flops(TINY, batch=1, length=4, lora_rank=1)
        self.assertEqual(longer["attention"], 4 * base["attention"])
        self.assertNotEqual(wide["total"], base["total"])

    def test_smollm2_135m(self):
        # the bench's model (SmolLM2-135M: 30 layers, 576 hidden, 1536 intermediate, 9/3 heads of
        # 64, vocab 49152) at 8 x 256: 106,168,320 frozen params
        s = {"hidden": 576, "intermediate": 1536, "layers": 30, "heads": 9, "kv_heads": 3, "head_dim": 64,
             "vocab": 49152}
        f = peak.train_step_flops(s, batch=8, length=256)
        self.assertEqual(f["frozen"], 4 * 106_168_320 * 2048)
        self.assertEqual(f["lm_head"], 4 * 49152 * 576 * 1024)


class Peak(unittest.TestCase):
    def setUp(self):
        os.environ.pop("ONEPASS_FMA_UNITS", None)

    def test_amx_xeon(self):
        c = cpu("avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile", mhz=2600.0)
        self.assertEqual(peak.peak("f32", c), 2 * 2 * 16 * 2 * 2600e6)
        self.assertEqual(peak.peak("bf16", c), 2 * 1024 * 2600e6)

    def test_avx512_bf16_without_amx(self):
        c = cpu("avx2 fma avx512f avx512_bf16")
        self.assertEqual(peak.peak("bf16", c), 2 * 2 * 32 * 2 * 2000e6)

    def test_zen4_one_512bit_unit_and_no_bf16(self):
        self.assertEqual(peak.peak("f32", cpu("avx2 fma avx512f avx512_bf16", vendor="AuthenticAMD")), 2 * 32 * 2000e6)
        # without bf16 instructions bf16 runs at the f32 rate
        self.assertEqual(peak.peak("bf16", cpu("avx2 fma")), peak.peak("f32", cpu("avx2 fma")))
        self.assertEqual(peak.peak("f32", cpu("avx2 fma")), 2 * 2 * 8 * 2 * 2000e6)

    def test_no_clock_no_peak(self):
        self.assertIsNone(peak.peak("f32", cpu("avx2 fma", mhz=None)))
        with self.assertRaises(ValueError):
            peak.flop_per_cycle("f16", cpu("avx2 fma"))


if __name__ == "__main__":
    unittest.main()
