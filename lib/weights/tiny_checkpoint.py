"""`dsv4gen make-tiny`: small random DeepSeek-V4 checkpoints in exactly the official format.

Weights are drawn per logical tensor of the spec's tensor table (same order, one seeded
generator), then encoded by the tensor's storage format (FP8 + E8M0 block scales, packed MXFP4,
BF16/F32/I64), so the loader, codecs and every backend see what a real checkpoint holds. The
embedded tiny checkpoint is this with the `tiny` preset, cached on first use; `PRESETS` adds
override sets of that variant: for checks the tiny widths serve but its window and ratios do not (`tiny-long`), and
for training (`trained`).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

import torch
from tqdm import tqdm

from lib.quant import reference_formats as formats
from lib.weights.checkpoint import summary
from lib.weights.checkpoint_writer import write_checkpoint
from spec.config import ModelConfig
from spec.tables import SPEC_DIR, Logical, expand
from spec.variants import variant_config

TINY_VARIANT = "tiny"
TINY_SEED = 0
MAX_BYTES = 1 << 30            # make-tiny's limit on the checkpoint it writes
TRAINING_RECORD = "training.json"     # beside the weights of every checkpoint `dsv4gen train-tiny` writes
# Beside the shipped checkpoint's weights: the training.json of a later from-scratch run of the same command (its own
# weights not shipped), the evidence that the command reproduces the shipped accuracy and in how long.
REPRODUCTION_RECORD = "reproduction.json"
# Bump when the initialisation below changes, so cached embedded checkpoints are rebuilt.
MAKER_VERSION = 4

# Named override sets of the `tiny` variant (`dsv4gen make-tiny --preset`, `embedded_tiny(preset=)`).
# `tiny-long`: Flash's window 128 and compress ratios 4 / 128 at the tiny widths, no drafter, room
# for 64K positions: long-context conformance (lib/porting/conformance_context.py), where CSA must
# choose among thousands of entries and HCA attend to more than one block of them. index_topk 64
# makes the selected entries a real share of each attention (the tiny preset's 4 would not).
# `trained`: what `dsv4gen train-tiny` trains: window 32, so that a tool call's first argument, copied from the request
# 18 to 27 tokens back under the task tokenizer (lib/training/corpus.py, tests/training/test_train_tiny.py), is within
# the window (16 would leave it to compressed entries only).
PRESETS: dict[str, dict] = {
    "tiny": {},
    "trained": {"sliding_window": 32},
    "tiny-long": {"sliding_window": 128, "compress_ratios": [0, 0, 4, 128, 4, 128], "index_topk": 64,
                  "max_position_embeddings": 65536, "dspark_block_size": None, "dspark_noise_token_id": None,
                  "dspark_target_layer_ids": None, "dspark_markov_rank": None},
}


def _init(t: Logical, cfg: ModelConfig, gen: torch.Generator) -> torch.Tensor:
    """A fp32 value for one logical tensor, scaled so activations stay O(1) through the layers."""
    shape, key, cls = t.shape, t.key, t.entry.tensor_class

    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std + mean

    fan_in = shape[-1]
    if cls == "hash_table":
        # each token routes to num_experts_per_tok distinct experts
        rows = [torch.randperm(cfg.n_routed_experts, generator=gen)[: shape[1]] for _ in range(shape[0])]
        return torch.stack(rows).float()
    if cls == "norm":
        return normal(0.1, 1.0)
    if cls == "embedding":
        return normal(1.0)
    if cls == "head":
        # Heavy-tailed row norms (log-normal) make a few tokens stand out, so next-token margins
        # are large relative to quantisation error and teacher-forced top-1 checks are decisive.
        norms = torch.exp(0.75 * torch.randn(shape[0], 1, generator=gen))
        return normal(0.5 / fan_in ** 0.5) * norms
    if cls == "hc":
        if key.endswith("_scale"):
            return normal(0.1, 1.0)
        if key.endswith("_base"):
            return normal(0.5)
        return normal(1.0 / fan_in ** 0.5)
    if cls == "attn_sink":
        return normal(1.0)
    if cls == "router" and key.endswith(".bias"):
        return normal(0.5)          # a selection bias spread wide enough that top-k ties are rare
    if cls == "compressor_ape":
        return normal(0.5)
    if cls == "routed_expert" and key.endswith(".w2.weight"):
        # routed experts add to, rather than dominate, the residual stream (as in trained models),
        # so one layer's quantisation noise perturbs the logits instead of replacing them
        return normal(0.5 / fan_in ** 0.5)
    return normal(1.0 / fan_in ** 0.5)


def tiny_tensors(cfg: ModelConfig, seed: int, progress: bool = False) -> dict[str, torch.Tensor]:
    """Every stored tensor of a checkpoint with this config, keyed by official name."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for t in tqdm(expand(cfg), desc="making weights", unit="tensor", disable=not progress, leave=False):
        stored = formats.encode(t.format, _init(t, cfg, gen), cfg)
        for part in t.parts:
            out[part.key] = stored[part.role]
    return out


def side_files(cfg: ModelConfig, tokenizer=None) -> dict[str, str]:
    """config.json, generation_config.json and the tokenizer files (`tokenizer`: a tokenizers backend; default
    the tiny tokenizer of cfg.vocab_size ids)."""
    from lib.text.tokenizer import build_tiny_tokenizer, tokenizer_files

    tok = tokenizer or build_tiny_tokenizer(cfg.vocab_size)
    files = {"config.json": json.dumps(cfg.config_json(), indent=2) + "\n",
             "generation_config.json": json.dumps({"bos_token_id": cfg.bos_token_id,
                                                   "eos_token_id": cfg.eos_token_id, "do_sample": True,
                                                   "temperature": 1.0, "top_p": 1.0}, indent=2) + "\n"}
    files.update(tokenizer_files(tok, model_max_length=cfg.max_position_embeddings))
    return files


def make_tiny(out: Path | str, seed: int = TINY_SEED, overrides: dict | None = None, shards: int = 4,
              overwrite: bool = False, progress: bool = False, preset: str = "tiny",
              variant: str = TINY_VARIANT) -> Path:
    """A random checkpoint of `variant` (default `tiny`) with `preset`'s overrides, then `overrides`."""
    if preset not in PRESETS:
        raise ValueError(f"unknown tiny preset '{preset}' (accepted: {', '.join(PRESETS)})")
    if PRESETS[preset] and variant != TINY_VARIANT:
        # a preset restates keys of the tiny variant's schedule; on another variant it would mix two
        raise ValueError(f"preset '{preset}' overrides the '{TINY_VARIANT}' variant, not '{variant}'")
    cfg = variant_config(variant, {**PRESETS[preset], **(overrides or {})})
    size = summary(cfg)["all"]["bytes"]
    if size > MAX_BYTES:
        # every tensor is drawn in memory first: a real-size variant would exhaust it hours later
        raise ValueError(f"variant '{variant}' makes a {size:,}-byte checkpoint; make-tiny writes at most "
                         f"{MAX_BYTES:,} (pick a tiny variant, e.g. tiny or pro-tiny)")
    out = Path(out)
    # refuse cheap-to-detect problems before spending time on the weights
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out}: already exists and is not empty (pass --force to replace it)")
    files = side_files(cfg)                       # builds the tokenizer: rejects a too-small vocab_size
    return write_checkpoint(out, tiny_tensors(cfg, seed, progress), files, shards=shards, overwrite=overwrite)


def cache_root() -> Path:
    return Path(os.environ.get("DSV4GEN_CACHE", Path.home() / ".cache" / "dsv4gen"))


def maker_hash(key: str) -> str:
    """A short hash of `key` and of everything a made checkpoint's bytes depend on (every spec source: the
    tensor table, the variants and the code that expands them; the maker, tokenizer and codecs; the maker
    version), so a spec change names a new cached checkpoint instead of reusing a stale one."""
    h = hashlib.sha256(f"{MAKER_VERSION}:{key}".encode())
    lib_dir = Path(__file__).resolve().parents[1]
    spec_sources = sorted(p for pattern in ("*.py", "*.yaml") for p in SPEC_DIR.rglob(pattern))
    lib_sources = ("weights/tiny_checkpoint.py", "text/tokenizer.py", "quant/bit_codecs.py",
                   "quant/reference_formats.py")
    sources = [(f"spec/{p.relative_to(SPEC_DIR).as_posix()}", p) for p in spec_sources]
    sources += [(f"lib/{name}", lib_dir / name) for name in lib_sources]
    for name, source in sources:
        h.update(name.encode())
        h.update(source.read_bytes())
    return h.hexdigest()[:16]


def trained_on_task_mix(path) -> bool:
    """Whether `dsv4gen train-tiny` wrote the checkpoint at `path` (its record lies beside the weights)."""
    return (Path(path) / TRAINING_RECORD).exists()


def embedded_tiny(out=None, preset: str = "tiny") -> Path:
    """The embedded tiny checkpoint (of `preset`): made deterministically on first use (saying so on
    `out`, a text stream, default stderr: it takes a while), then reused silently."""
    if preset not in PRESETS:
        raise ValueError(f"unknown tiny preset '{preset}' (accepted: {', '.join(PRESETS)})")
    key = str(TINY_SEED) if preset == "tiny" else f"{preset}:{TINY_SEED}"
    path = cache_root() / f"{preset}-{maker_hash(key)}"
    if not (path / "config.json").exists():
        import sys
        import time

        out = out or sys.stderr
        print(f"making the embedded tiny checkpoint in {path} (first use) ...", file=out, flush=True)
        start = time.monotonic()
        make = make_tiny if preset == "tiny" else functools.partial(make_tiny, preset=preset)
        make(path, overwrite=True)
        print(f"made the embedded tiny checkpoint: done in {time.monotonic() - start:.1f} s", file=out, flush=True)
    return path


# The trained tiny checkpoint shipped with the package: what `dsv4gen train-tiny --out DIR --seed 0` writes (its
# training.json holds the command, seed, time and held-out accuracy), so first use serves it without training.
SHIPPED_TRAINED = Path(__file__).resolve().parent / "trained_tiny"


def shipped_trained() -> Path:
    """The shipped trained tiny checkpoint's directory (what `python -m serve` and `dsv4gen eval` use by default)."""
    if not (SHIPPED_TRAINED / "config.json").exists() or not trained_on_task_mix(SHIPPED_TRAINED):
        raise FileNotFoundError(f"the shipped trained checkpoint is missing from {SHIPPED_TRAINED} (an install without "
                                "package data?): pass --model DIR, or write it with `dsv4gen train-tiny --out DIR "
                                "--seed 0`")
    return SHIPPED_TRAINED
