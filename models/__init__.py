"""Language models on the overlap ops: a Llama-style Transformer and Mamba-2.

Both are Flax NNX modules with tensor parallelism (heads / MLP width / SSM
groups split over a ``tensor`` mesh axis), sequence parallelism of the
residual stream, and data parallelism over a ``data`` axis. Installed as
``jax_flashoverlap.models``::

    from jax_flashoverlap.models import Transformer, TransformerConfig

    mesh = jax.make_mesh((2, 4), ("data", "tensor"))
    with jax.set_mesh(mesh):
        model = Transformer(TransformerConfig.preset("tiny"), rngs=nnx.Rngs(0))
        logits = nnx.jit(lambda m, t: m(t))(model, tokens)   # tokens [b, s]
        tokens = generate(model, prompt, max_new_tokens=32)   # prompt [b, p]
"""

# As models.norm_pallas etc., like conv_pallas and ssd_pallas:
from . import (  # noqa: F401
    decode_attention_pallas,
    mamba_decode_cuda,
    mamba_decode_pallas,
    norm_pallas,
    shapes,
    ssd,
    transformer_decode_cuda,
    transformer_decode_weights,
)
from .config import (
    ATTENTION_IMPLS,
    DECODE_ATTENTION_IMPLS,
    DECODE_BLOCKS,
    DECODE_MATMUL_IMPLS,
    IMPLS,
    NORM_BACKWARDS,
    PARAM_DTYPES,
    SIZES,
    RopeScaling,
    ShardingConfig,
    TransformerConfig,
)
from .decoding import Generator, generate
from .layers import CausalLM, RMSNorm
from .mamba import Mamba2
from .mamba_config import (
    CONV_IMPLS,
    DECODE_MIXER_IMPLS,
    MAMBA_DECODE_BLOCKS,
    RESIDUALS,
    SSD_IMPLS,
    MambaConfig,
    SSDTiling,
)
from .pretrained import (
    from_pretrained,
    llama_config,
    mamba2_config,
    pretrained_config,
    save_pretrained,
)
from .transformer import (
    Transformer,
    attention_implementation,
    decode_blocks_implementation,
    resolve_scan_layers,
)

__all__ = ["Transformer", "TransformerConfig", "Mamba2", "MambaConfig", "ShardingConfig",
           "SSDTiling", "RopeScaling", "from_pretrained", "save_pretrained", "llama_config",
           "mamba2_config", "pretrained_config",
           "generate", "Generator",
           "CausalLM", "RMSNorm", "IMPLS", "SIZES", "MODELS", "ATTENTION_IMPLS", "SSD_IMPLS",
           "CONV_IMPLS", "NORM_BACKWARDS", "RESIDUALS", "DECODE_MATMUL_IMPLS",
           "DECODE_ATTENTION_IMPLS", "DECODE_MIXER_IMPLS", "DECODE_BLOCKS",
           "MAMBA_DECODE_BLOCKS", "PARAM_DTYPES",
           "attention_implementation", "decode_blocks_implementation", "resolve_scan_layers"]

# --model name -> (config class, model class).
MODELS = {"transformer": (TransformerConfig, Transformer), "mamba": (MambaConfig, Mamba2)}
