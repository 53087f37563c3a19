"""Generates text with the Transformer or Mamba-2, tensor-parallel, all-reducing on NVRAR.

    jax-flashoverlap-generate --model transformer --size tiny --prompt "def main(" \\
        --max-new-tokens 64
    jax-flashoverlap-generate --model mamba --size 1b --mesh 1x2 --restore CKPT_DIR \\
        --prompt-file prompt.txt --max-new-tokens 256 --temperature 0.8 --top-k 40
    python -m jax_flashoverlap.cli.launch -n 2 --node-size 1 -m jax_flashoverlap.cli.generate ...

Byte-level tokens, as in training. ``--restore DIR`` loads the parameters of
the latest checkpoint that ``jax-flashoverlap-train --checkpoint-dir DIR``
wrote (same ``--model`` and ``--size``); without it the weights are random.
``--pretrained DIR`` loads a Llama or Mamba-2 checkpoint in the Hugging
Face layout instead (``models.from_pretrained``; its ``model_type`` sets
``--model``), with its ``tokenizer.json``.
The prompt runs through the model in one pass (prefill), then each new token
is one decode step, all of them in one compiled loop
(:mod:`jax_flashoverlap.models.decoding`). It prints each row's text, then
the time to the first token (prefill and its sampling), the time per decode
step and tokens/s of a run after ``--warmup`` untimed ones; compilation is
timed apart. Started through the launcher,
one GPU per process, the decode all-reduce across processes runs on NVSHMEM
when the package has it (``jax_flashoverlap.nvshmem``). Without a GPU it
runs on 8 CPU devices.
"""

from __future__ import annotations

from . import _requires_models  # noqa: F401  (first: names the extra if flax is missing)

# isort: split

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from .. import _extension, distributed
from ..decode_matmul import DECODE_MATMUL_IMPLS
from ..models import (
    DECODE_ATTENTION_IMPLS,
    DECODE_BLOCKS,
    DECODE_MIXER_IMPLS,
    IMPLS,
    MODELS,
    PARAM_DTYPES,
    Generator,
    ShardingConfig,
    from_pretrained,
    pretrained_config,
)
from . import tokens as token_codes
from .devices import ensure_cpu_devices
from .flags import HelpFormatter, parse_mesh_shape
from .kernel_flags import refuse_other_models_flags
from .model_flags import add_model_flags, resolve_model
from .train import (
    CPU_DEVICES,
    make_mesh,
    model_config,
    restore_model_state,
)

__all__ = ["main", "parse_args", "run", "encode", "decode_text"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="jax-flashoverlap-generate",
                                     description=__doc__.splitlines()[0],
                                     formatter_class=HelpFormatter)
    add_model_flags(parser)
    weights = parser.add_mutually_exclusive_group()
    weights.add_argument("--restore", type=Path, default=None, metavar="DIR",
                         help="load the latest checkpoint of jax-flashoverlap-train "
                              "--checkpoint-dir DIR (default: random weights)")
    weights.add_argument("--pretrained", type=Path, default=None, metavar="DIR",
                         help="a Llama or Mamba-2 checkpoint in the Hugging Face layout "
                              "(config.json, safetensors, tokenizer.json); --size is ignored")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the prompt text")
    prompt.add_argument("--prompt-file", type=Path, help="a file holding the prompt")
    parser.add_argument("--max-new-tokens", type=int, required=True,
                        help="tokens to generate after the prompt (at least 1)")
    parser.add_argument("--batch", type=int, default=1,
                        help="rows, each continuing the same prompt")
    parser.add_argument("--mesh", type=parse_mesh_shape, default=None, metavar="DATAxTENSOR",
                        help="mesh shape, e.g. 1x2 (default: data 1, tensor 2, or 1 with "
                             "one device)")
    parser.add_argument("--impl", choices=IMPLS, default="auto",
                        help="implementation of the overlap ops and the all-reduce")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="compute dtype (default bfloat16 on GPU, float32 on CPU)")
    parser.add_argument("--param-dtype", choices=PARAM_DTYPES, default="float32",
                        help="how the weights are kept: bfloat16 halves their memory, and a "
                             "bfloat16 model reads the same values from them")
    parser.add_argument("--decode-matmul", choices=DECODE_MATMUL_IMPLS, default="xla",
                        help="the decode step's weight matmuls: XLA's, or the library's "
                             "kernel for a few bf16 rows (cuda)")
    parser.add_argument("--decode-attention", choices=DECODE_ATTENTION_IMPLS, default="auto",
                        help="the Transformer's decode attention: the model's (cuDNN or XLA, "
                             "XLA updating the cache), one Pallas kernel that also writes the "
                             "cache (pallas), or the kernel on CUDA GPUs at batch 1 per device "
                             "(auto)")
    parser.add_argument("--decode-blocks", choices=DECODE_BLOCKS, default="auto",
                        help="the decode step: each layer's own ops (layers), all blocks in "
                             "one CUDA kernel (cuda: tensor-parallel size 1, bfloat16, at most "
                             "4 rows per device), or for the Transformer the kernel on Hopper "
                             "GPUs at up to 2 rows per device where it runs (auto; Mamba-2's "
                             "auto is layers)")
    parser.add_argument("--decode-mixer", choices=DECODE_MIXER_IMPLS, default="xla",
                        help="Mamba-2's decode step between its projections (convolution, "
                             "state update, skip): XLA's ops, or one Pallas GPU kernel a "
                             "layer (pallas)")
    parser.add_argument("--no-sequence-parallel", dest="sequence_parallel",
                        action="store_false", help="prefill without sequence parallelism")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=None,
                        help="sample among the k most likely bytes (default: all)")
    parser.add_argument("--seed", type=int, default=0,
                        help="parameters (without --restore) and sampling")
    parser.add_argument("--heap-mb", type=int, default=1024,
                        help="NVSHMEM symmetric heap per GPU, when started by the launcher")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed generations first (a compiled program's first run "
                             "carries one-time costs)")
    parser.add_argument("--json", type=Path, default=None,
                        help="write the text and the timings here")
    parser.add_argument("--stream", action="store_true",
                        help="print the text as it decodes (--batch 1; a host callback each "
                             "step, so the timings are slower)")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.batch < 1:
        parser.error(f"--batch must be at least 1, got {args.batch}")
    if args.stream and args.batch != 1:
        parser.error(f"--stream prints one row as it decodes: use --batch 1, not {args.batch}")
    if args.stream and distributed.is_launched():
        parser.error("--stream prints from one process: run it without the launcher")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.temperature < 0:
        parser.error(f"--temperature must be >= 0, got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        parser.error(f"--top-k must be at least 1, got {args.top_k}")
    if args.top_k is not None and args.temperature == 0:
        parser.error("--top-k samples among the k most likely bytes: it needs "
                     "--temperature > 0 (0 takes the most likely one)")
    if args.heap_mb < 1:
        parser.error(f"--heap-mb must be at least 1, got {args.heap_mb}")
    if args.decode_matmul == "cuda" and not _extension.cuda_ops_available():
        parser.error("--decode-matmul cuda: this jax_flashoverlap was built without its CUDA "
                     "kernels (build_info()['cuda'] is False); use --decode-matmul xla")
    if args.restore is not None and not args.restore.is_dir():
        parser.error(f"--restore {args.restore}: no such directory")
    resolve_model(parser, args, args.pretrained, "--pretrained")
    if args.prompt_file is not None and not args.prompt_file.is_file():
        parser.error(f"--prompt-file {args.prompt_file}: no such file")
    refuse_other_models_flags(parser, args, _MODEL_OF_FLAG)
    return args


# The flags that tune one model's decode step.
_MODEL_OF_FLAG = {"decode_attention": "transformer", "decode_mixer": "mamba"}


def encode(text: str) -> np.ndarray:
    """Byte-level tokens of ``text`` (UTF-8), int32 [len]."""
    return token_codes.ByteTokens().encode(text)


def decode_text(tokens: np.ndarray) -> str:
    """The text of byte-level tokens; bytes that are not UTF-8 show as U+FFFD."""
    return token_codes.ByteTokens().decode(tokens)


def run(args: argparse.Namespace) -> dict:
    """Builds the model, generates, prints the text and timings; returns them."""
    multi_process = distributed.is_launched()
    if multi_process:
        distributed.initialize()
        _start_nvshmem(args.heap_mb)
    text = args.prompt if args.prompt is not None else args.prompt_file.read_text()
    sharding = ShardingConfig(sequence_parallel=args.sequence_parallel)
    mesh = make_mesh(args.mesh or (1, min(2, jax.device_count())), sharding)
    base = args.size
    if args.pretrained is not None:
        base = pretrained_config(args.pretrained)
    config = model_config(args.model, base, impl=args.impl, dtype=args.dtype,
                          param_dtype=args.param_dtype, sharding=sharding,
                          decode_matmul=args.decode_matmul,
                          decode_attention=args.decode_attention,
                          decode_mixer=args.decode_mixer, decode_blocks=args.decode_blocks)
    codes = token_codes.for_checkpoint(args.pretrained, config.vocab_size)
    prompt = codes.encode(text)
    if prompt.size == 0:
        raise ValueError("the prompt is empty: give text to continue (--prompt or "
                         "--prompt-file)")
    if prompt.size + args.max_new_tokens > config.max_seq_len:  # before building the model
        raise ValueError(f"the prompt's {prompt.size} tokens + --max-new-tokens "
                         f"{args.max_new_tokens} exceed the model's max_seq_len="
                         f"{config.max_seq_len}; shorten the prompt or generate fewer tokens")
    _, model_cls = MODELS[args.model]
    prompts = np.tile(prompt, (args.batch, 1))
    lead = jax.process_index() == 0
    with jax.set_mesh(mesh):
        if args.pretrained is not None:
            model = from_pretrained(args.pretrained, config=config)
            _say(lead, f"loaded {args.pretrained}")
        else:
            model = nnx.jit(lambda: model_cls(config, rngs=nnx.Rngs(args.seed)))()
        if args.restore is not None:
            step = restore_model_state(args.restore, model)
            _say(lead, f"restored step {step} from {args.restore}")
        data, tensor = mesh.devices.shape
        name = args.pretrained or f"{args.model}/{args.size}"
        _say(lead, f"{name} on mesh {data}x{tensor} (data x tensor) of "
                   f"{len(jax.devices())} {jax.devices()[0].platform.upper()} device(s)"
                   f"{f' in {jax.process_count()} processes' if multi_process else ''}; "
                   f"impl {args.impl}, dtype {config.dtype}; compiling...")
        stream = _Stream(codes, text) if args.stream else None
        generator = Generator(model, batch=args.batch, prompt_len=prompt.size,
                              max_new_tokens=args.max_new_tokens,
                              temperature=args.temperature, top_k=args.top_k,
                              on_token=stream)
        rng = jax.random.key(args.seed)
        for _ in range(args.warmup):
            jax.block_until_ready(generator(prompts, rng))
        start = time.perf_counter()
        prefilled = jax.block_until_ready(generator.prefill(prompts, rng))
        prefill_s = time.perf_counter() - start
        if stream:
            stream.start(prefilled.token)
        start = time.perf_counter()
        tokens, _ = jax.block_until_ready(generator.decode(prefilled, rng))
        decode_s = time.perf_counter() - start
        if stream:
            jax.effects_barrier()  # every step's callback has run
            stream.end()
    tokens = _to_host(tokens)
    steps = args.max_new_tokens - 1
    result = {
        "model": args.model, "size": args.size, "mesh": f"{data}x{tensor}", "impl": args.impl,
        "dtype": config.dtype, "param_dtype": config.param_dtype,
        "decode_matmul": args.decode_matmul,
        # What ran, as for decode_blocks below (None: Mamba-2, or the blocks' kernel).
        "decode_attention": (model.blocks[0].attn.decode_implementation(args.batch // data)
                             if args.model == "transformer" and generator.decode_weights is None
                             else None),
        # What ran: the blocks' kernel where "auto" (or "cuda") prepared its weights.
        "decode_blocks": "layers" if generator.decode_weights is None else "cuda",
        "decode_mixer": args.decode_mixer, "batch": args.batch, "prompt_tokens": int(prompt.size),
        "new_tokens": args.max_new_tokens, "compile_s": generator.compile_s,
        "warmup_runs": args.warmup, "streamed": args.stream,
        "time_to_first_token_ms": prefill_s * 1e3,
        "per_token_ms": decode_s / steps * 1e3 if steps else None,
        "tokens_per_s": args.batch * steps / decode_s if steps else None,
        "texts": [codes.decode(row[prompt.size:]) for row in tokens],
    }
    if lead and not args.stream:
        for i, continuation in enumerate(result["texts"]):
            print(f"--- row {i}:\n{text}{continuation}")
    if lead:
        kernel = ("" if result["decode_blocks"] != "cuda"
                  else " (the blocks in one CUDA kernel)" if jax.default_backend() == "gpu"
                  else " (the one-kernel step's JAX reference: no GPU)")
        kernel += " (streamed: a host callback each step)" if args.stream else ""
        per_token = (f"{result['per_token_ms']:.3f} ms per token{kernel} over {steps} decode "
                     f"steps, {result['tokens_per_s']:,.0f} tokens/s" if steps
                     else "no decode step (--max-new-tokens 1)")
        print(f"time to first token {result['time_to_first_token_ms']:.1f} ms "
              f"({prompt.size} prompt tokens x {args.batch}); {per_token}; "
              f"after {args.warmup} untimed run(s); compiled in {generator.compile_s:.1f} s",
              flush=True)
        if args.json is not None:
            args.json.write_text(json.dumps(result, indent=1))
    return result


class _Stream:
    """Prints a row's text as the decode loop makes its tokens (the
    generator's ``on_token``), from :meth:`start` to :meth:`end` (the
    untimed runs before stay silent): each time what the tokens so far, in
    step order, decode to beyond what it printed, holding back a partial
    character."""

    def __init__(self, codes: token_codes.Tokens, prompt: str):
        self.codes, self.prompt = codes, prompt
        self.ids: dict[int, int] | None = None
        self.shown = ""
        self.lock = threading.Lock()  # callbacks may come from several threads

    def start(self, first: jax.Array) -> None:
        print(f"--- row 0:\n{self.prompt}", end="", flush=True)
        self.ids, self.shown = {}, ""
        self(_to_host(first), 0)

    def __call__(self, tokens: np.ndarray, step: int) -> None:
        with self.lock:
            if self.ids is None:
                return
            self.ids[step] = int(tokens[0])
            self._show(self._text().rstrip("\ufffd"))

    def end(self) -> None:
        with self.lock:
            self._show(self._text())
            print(flush=True)
            self.ids = None

    def _text(self) -> str:
        ready = []  # the steps from 0 without a gap
        while len(ready) in self.ids:
            ready.append(self.ids[len(ready)])
        return self.codes.decode(np.asarray(ready, np.int32))

    def _show(self, text: str) -> None:
        if text.startswith(self.shown):
            print(text[len(self.shown):], end="", flush=True)
            self.shown = text


def _start_nvshmem(heap_mb: int) -> None:
    """NVSHMEM for the decode all-reduce across processes, where it is built."""
    from .. import nvshmem

    if nvshmem.is_built() and jax.default_backend() == "gpu":
        nvshmem.initialize(heap_mb=heap_mb)


def _to_host(a: jax.Array) -> np.ndarray:
    if a.is_fully_addressable:
        return np.asarray(a)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(a, tiled=True))


def _say(lead: bool, message: str) -> None:
    if lead:
        print(message, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not distributed.is_launched():  # the launcher gives each process its devices
        ensure_cpu_devices(CPU_DEVICES)  # Before JAX starts its backends.
    try:
        run(args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"jax-flashoverlap-generate: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
