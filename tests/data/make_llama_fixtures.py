"""Makes the Llama parity fixtures of tests/test_pretrained.py with `transformers`.

    python tests/data/make_llama_fixtures.py [OUT_DIR]   (default: tests/data/llama)

For each small random Llama (several configs: grouped-query attention,
tied and untied embeddings, Llama 3.1's rope scaling, a head width other
than hidden / heads, and one that the one-kernel decode step takes: head
width 64, widths in its blocks of 16 and 32), ``transformers`` initialises the model from a fixed
seed, saves it (``config.json``, ``model.safetensors``), and records in
``expected.npz`` its float32 logits on fixed prompts and 32 greedy tokens
after each prompt. Needs torch and transformers (the GPU machine has both);
runs on the CPU in float32.
"""

import os

import torch
import transformers
from hf_fixtures import make_all, save_with_expectations

CONFIGS = {
    "gqa_untied": dict(num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False),
    "gqa_tied_llama3_rope": dict(
        num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "mha_wide_heads": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=24,
                           tie_word_embeddings=False, rope_theta=500000.0),
    "kernel_llama3_rope": dict(
        hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, tie_word_embeddings=True, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
}
BASE = dict(vocab_size=211, hidden_size=64, intermediate_size=88, num_hidden_layers=2,
            rms_norm_eps=1e-5, max_position_embeddings=128, attention_bias=False,
            mlp_bias=False, hidden_act="silu",
            bos_token_id=None, eos_token_id=None)  # greedy runs all 32 tokens


def make(name: str, fields: dict, out: str) -> None:
    torch.manual_seed(sum(map(ord, name)))
    config = transformers.LlamaConfig(**{**BASE, **fields})
    model = transformers.LlamaForCausalLM(config).float().eval()
    with torch.no_grad():  # weights well away from zero, as a trained model's
        for p in model.parameters():
            p.normal_(0.0, 0.08)
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.uniform_(0.5, 1.5)
    save_with_expectations(name, model, config.vocab_size, out)


if __name__ == "__main__":
    make_all(make, CONFIGS, os.path.join(os.path.dirname(__file__), "llama"))
