"""What both fixture scripts (make_llama_fixtures.py, make_mamba2_fixtures.py)
do with a model that `transformers` made: save it, and record its float32
logits on fixed prompts and its greedy tokens after them."""

import json
import os
import sys

import numpy as np
import torch
import transformers

PROMPTS = 2
PROMPT_LEN = 12
NEW_TOKENS = 32


def save_with_expectations(name: str, model, vocab_size: int, out: str) -> None:
    """``model`` saved under ``out/name`` (config.json, model.safetensors),
    with ``expected.npz`` (prompts, logits, greedy) and ``made_with.json``."""
    path = os.path.join(out, name)
    model.save_pretrained(path, safe_serialization=True)
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, vocab_size, (PROMPTS, PROMPT_LEN))
    with torch.no_grad():
        tokens = torch.from_numpy(prompts)
        logits = model(tokens).logits.numpy().astype(np.float32)
        greedy = model.generate(tokens, max_new_tokens=NEW_TOKENS, do_sample=False,
                                attention_mask=torch.ones_like(tokens),
                                pad_token_id=0).numpy()
    np.savez(os.path.join(path, "expected.npz"), prompts=prompts, logits=logits, greedy=greedy)
    with open(os.path.join(path, "made_with.json"), "w") as f:
        json.dump({"torch": torch.__version__, "transformers": transformers.__version__}, f)
    print(f"{name}: logits {logits.shape}, greedy {greedy.shape}")


def make_all(make, configs: dict, default_dir: str) -> None:
    """``make(name, fields, out)`` for each of ``configs``, into the directory
    the command line names, else ``default_dir``."""
    out = sys.argv[1] if len(sys.argv) > 1 else default_dir
    for name, fields in configs.items():
        make(name, fields, out)
