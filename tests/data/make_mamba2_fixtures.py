"""Makes the Mamba-2 parity fixtures of tests/test_pretrained_mamba2.py with `transformers`.

    python tests/data/make_mamba2_fixtures.py [OUT_DIR]   (default: tests/data/mamba2)

For each small random Mamba-2 (one, two and four B/C groups, tied and
untied embeddings, a chunk that does not divide the prompt),
``transformers`` initialises the model from a fixed seed, saves it
(``config.json``, ``model.safetensors``), and records in ``expected.npz``
its float32 logits on fixed prompts and 32 greedy tokens after each prompt.
Needs torch and transformers; runs on the CPU in float32 (transformers'
own PyTorch path, not the CUDA kernels).
"""

import math
import os

import torch
import transformers
from hf_fixtures import make_all, save_with_expectations

CONFIGS = {
    "groups2_untied": dict(n_groups=2, num_heads=8, head_dim=8, hidden_size=32, state_size=8,
                           chunk_size=8, tie_word_embeddings=False),
    "groups1_tied": dict(n_groups=1, num_heads=4, head_dim=16, hidden_size=32, state_size=16,
                         chunk_size=16, tie_word_embeddings=True),
    "groups4_odd_chunk": dict(n_groups=4, num_heads=8, head_dim=12, hidden_size=48,
                              state_size=8, chunk_size=7, tie_word_embeddings=False),
}
BASE = dict(vocab_size=211, num_hidden_layers=2, expand=2, conv_kernel=4,
            layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True, hidden_act="silu",
            bos_token_id=None, eos_token_id=None, pad_token_id=None)  # greedy runs all 32 tokens


def make(name: str, fields: dict, out: str) -> None:
    torch.manual_seed(sum(map(ord, name)))
    config = transformers.Mamba2Config(**BASE, **fields)
    model = transformers.Mamba2ForCausalLM(config).float().eval()
    with torch.no_grad():  # weights well away from zero, as a trained model's
        for p in model.parameters():
            p.normal_(0.0, 0.08)
        for layer in model.backbone.layers:
            layer.norm.weight.uniform_(0.5, 1.5)
            mixer = layer.mixer
            mixer.norm.weight.uniform_(0.5, 1.5)
            mixer.conv1d.weight.uniform_(-0.5, 0.5)
            mixer.A_log.uniform_(0.0, math.log(4.0))
            mixer.D.uniform_(0.5, 1.5)
            mixer.dt_bias.uniform_(-2.0, 0.0)
        model.backbone.norm_f.weight.uniform_(0.5, 1.5)
    save_with_expectations(name, model, config.vocab_size, out)


if __name__ == "__main__":
    make_all(make, CONFIGS, os.path.join(os.path.dirname(__file__), "mamba2"))
