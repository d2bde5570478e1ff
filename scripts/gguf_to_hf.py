"""Converts a GGUF model to a transformers directory (config.json, safetensors, tokenizer and
chat template) for servers that read that layout (vLLM): `python gguf_to_hf.py MODEL.gguf OUT`.
transformers dequantizes the GGUF tensors to float32 and rebuilds the tokenizer and the chat
template from the file's metadata (`tokenizer.chat_template`), so the directory's model,
tokenizer and template are the ones onepass reads from the same file."""
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

src, out = Path(sys.argv[1]), Path(sys.argv[2])
kw = dict(gguf_file=src.name)
tok = AutoTokenizer.from_pretrained(src.parent, **kw)
model = AutoModelForCausalLM.from_pretrained(src.parent, dtype=torch.float32, **kw)
# transformers marks a GGUF-loaded model as quantized and will not save it; its tensors are
# already dequantized, so a fresh model of the same config takes them as they are
config = model.config
if hasattr(config, "quantization_config"):
    del config.quantization_config
fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
missing, unexpected = fresh.load_state_dict(model.state_dict(), strict=False)
# a tied LM head is not a separate tensor in the state dict
assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
fresh.tie_weights()
model = fresh
out.mkdir(parents=True, exist_ok=True)
model.save_pretrained(out, safe_serialization=True)
tok.save_pretrained(out)
print(f"{src} -> {out}: {sum(p.numel() for p in model.parameters())} parameters, template {'yes' if tok.chat_template else 'no'}")
