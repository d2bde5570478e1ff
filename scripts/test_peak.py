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


class OtherPasses(unittest.TestCase):
    def test_features_by_hand(self):
        # φ: forward only, no LM head. 144 frozen params x 2 tokens x 2 = 576; attention forward
        # (QK^T and PV, 32 each as above) = 64
        f = peak.features_flops(TINY, batch=1, length=2)
        self.assertEqual((f["frozen"], f["attention"], f["total"]), (576, 64, 640))
        # negative control: the LM head is not in φ's count but is in the training step's
        self.assertLess(f["total"], peak.train_step_flops(TINY, batch=1, length=2, lora_rank=1)["total"])

    def test_generate_by_hand(self):
        # one prompt of 2 tokens, one sample, 2 tokens generated: prefill 640 + LM head on the last
        # row 2*10*4 = 80; decode 2 x (144 + 40) x 2 = 736; the two new tokens attend to 3 and 4
        # positions: 7 x 2 x 2 x 4 (heads x head_dim) = 112
        f = peak.generate_flops(TINY, [2], samples=1, generated=2)
        self.assertEqual((f["prefill"], f["decode"], f["attention"]), (720, 736, 112))
        self.assertEqual(f["total"], 720 + 736 + 112)
        # two samples of one prompt: the prefill counted once, decode and attention twice
        g = peak.generate_flops(TINY, [2], samples=2, generated=4)
        self.assertEqual((g["prefill"], g["decode"], g["attention"]), (720, 2 * 736, 2 * 112))

    def test_rm_step_by_hand(self):
        # one pair = 2 sequences of 2 tokens, LoRA r = 1 on all 7 layers (64 adapter params):
        # frozen 2 x 2 x 144 x 4 = 2304; attention 2 seqs x 192 = 384; LoRA 3 x 2 x 64 x 4 = 1536
        f = peak.rm_step_flops(TINY, pairs=1, length=2, lora_rank=1)
        self.assertEqual(f["grad_pass"], 2304 + 384 + 1536)
        self.assertEqual(f["total"], f["grad_pass"])
        c = peak.rm_step_flops(TINY, pairs=1, length=2, hvps=2, hvp="central", lora_rank=1)
        self.assertEqual(c["total"], 5 * 4224)
        e = peak.rm_step_flops(TINY, pairs=1, length=2, hvps=2, hvp="exact", lora_rank=1)
        self.assertEqual(e["total"], 3 * 4224)
        with self.assertRaises(KeyError):
            peak.rm_step_flops(TINY, pairs=1, length=2, hvps=1, hvp="guess")


def gguf_bytes(kv, magic=b"GGUF", version=3):
    """A GGUF header with metadata `kv` ({key: (type, value)}) and no tensors, written by hand."""
    import struct

    def s(x):
        b = x.encode()
        return struct.pack("<Q", len(b)) + b
    out = magic + struct.pack("<IQQ", version, 0, len(kv))
    for k, (t, v) in kv.items():
        out += s(k) + struct.pack("<I", t)
        if t == 4:
            out += struct.pack("<I", v)
        elif t == 8:
            out += s(v)
        elif t == 9:  # an array of strings
            out += struct.pack("<IQ", 8, len(v)) + b"".join(s(x) for x in v)
    return out


class Shapes(unittest.TestCase):
    KV = {"general.architecture": (8, "llama"), "llama.embedding_length": (4, 4),
          "llama.feed_forward_length": (4, 8), "llama.block_count": (4, 1), "llama.attention.head_count": (4, 2),
          "llama.attention.head_count_kv": (4, 1), "tokenizer.ggml.tokens": (9, [f"t{i}" for i in range(10)])}

    def test_gguf_metadata_gives_the_shapes(self):
        import tempfile
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "m.gguf")
            pathlib.Path(p).write_bytes(gguf_bytes(self.KV))
            self.assertEqual(peak.model_shapes(p), TINY)  # head_dim = 4 / 2, vocab = 10 tokens
            pathlib.Path(p).write_bytes(gguf_bytes(self.KV, magic=b"GGUX"))
            with self.assertRaisesRegex(ValueError, "not a GGUF"):
                peak.model_shapes(p)
            pathlib.Path(p).write_bytes(gguf_bytes(self.KV)[:-7])
            with self.assertRaisesRegex(ValueError, "ends early"):
                peak.model_shapes(p)

    def test_config_json(self):
        import json
        import tempfile
        with tempfile.TemporaryDirectory() as d:
            json.dump({"hidden_size": 4, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "num_key_value_heads": 1, "vocab_size": 10}, open(os.path.join(d, "config.json"), "w"))
            self.assertEqual(peak.model_shapes(d), TINY)


class Reports(unittest.TestCase):
    """The bench reports' GFLOP/s columns: the counts above, applied to each record's rate."""

    def run_report(self, module, argv):
        import contextlib
        import importlib
        import io
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            importlib.import_module(module).main(argv)
        return out.getvalue()

    def gflops(self, text, engine):
        # the GFLOP/s column is the second to last of the engine's row
        row = next(l for l in text.splitlines() if l.startswith(engine + " "))
        return float(row.split()[-2])

    def test_features_and_generate_rates(self):
        import json
        import tempfile
        with tempfile.TemporaryDirectory() as d:
            m = os.path.join(d, "m.gguf")
            pathlib.Path(m).write_bytes(gguf_bytes(Shapes.KV))
            rec = {"engine": "candle", "dtype": "float32", "model": m, "threads": 2, "batch": 1, "len": 2, "reps": 1,
                   "tok_s": 1e9, "peak_rss_mb": 1.0, "abs_sum": 2.0}
            a = os.path.join(d, "a.json")
            pathlib.Path(a).write_text(json.dumps(rec))
            # φ: 640 FLOP per 2 tokens at 1e9 tok/s = 320 GFLOP/s
            self.assertEqual(self.gflops(self.run_report("bench_features_report", ["--pass", "features", "--model", m, a]),
                                         "candle"), 320)
            # generation: 1568 FLOP for the 2 generated tokens (abs_sum) at 1e9 tok/s = 784 GFLOP/s
            ids = os.path.join(d, "ids.json")
            pathlib.Path(ids).write_text(json.dumps({"ids": [[1, 2]], "n": 1}))
            out = self.run_report("bench_features_report", ["--pass", "generate", "--model", m, "--ids", ids, a])
            self.assertEqual(self.gflops(out, "candle"), 784)
            # negative control: without --pass the record carries no shapes and no rate is printed
            self.assertNotIn("GFLOP/s", self.run_report("bench_features_report", [a]).splitlines()[1])

    def test_rm_step_rates(self):
        import json
        import tempfile
        with tempfile.TemporaryDirectory() as d:
            m = os.path.join(d, "m.gguf")
            pathlib.Path(m).write_bytes(gguf_bytes(Shapes.KV))
            paths = []
            for eng, rule, hvps in (("candle", "omd", 2), ("torch", "omd", 2)):
                p = os.path.join(d, f"{eng}.json")
                json.dump({"engine": eng, "rule": rule, "model": m, "threads": 2, "pairs": 1, "len": 2, "reps": 1,
                           "step_s": [1e-9], "hvps": hvps, "peak_rss_mb": 1.0, "loss": 0.5}, open(p, "w"))
                paths.append(p)
            out = self.run_report("bench_rm_step_report", ["--model", m] + paths)
            # r 8 on all 7 layers of TINY: 4 tokens x 3 x 2 x 64 x 8 = 12288 + 2304 + 384 = 14976 per gradient
            # pass; onepass's central differences: 1 + 2 x 2 passes; PyTorch's double backward: 1 + 2
            self.assertEqual(self.gflops(out, "candle"), 5 * 14976)
            self.assertEqual(self.gflops(out, "torch"), 3 * 14976)
            # a rule whose HVPs have no stated cost is refused, not counted as exact
            unknown = os.path.join(d, "unknown.json")
            pathlib.Path(unknown).write_text(json.dumps({"engine": "candle", "rule": "omd-new", "model": m, "threads": 2,
                                                         "pairs": 1, "len": 2, "reps": 1, "step_s": [1e-9], "hvps": 2,
                                                         "peak_rss_mb": 1.0, "loss": 0.5}))
            with self.assertRaises(SystemExit):
                self.run_report("bench_rm_step_report", ["--model", m, unknown])


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
