"""`attnres-pp export --resume RUN --out DIR`: the newest checkpoint of a run as a Hugging Face model
folder that transformers loads with `AutoModelForCausalLM.from_pretrained(DIR)`.

A standard-residual model of the Llama recipe (rope, SwiGLU) is written as transformers' own
`LlamaForCausalLM` (with QK-norm `Qwen3ForCausalLM`; a mixture of experts that routes as they do,
`MixtralForCausalLM` or `Qwen3MoeForCausalLM`); every other model (the AttnRes variants, learned
positions, GELU, other mixtures of experts) as `AttnResForCausalLM`, whose code the folder carries
(load it with `trust_remote_code=True`). The folder is assembled beside DIR and renamed into place, so a failure
leaves nothing behind; every mistake is one `error:` line, exit 2.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from attnres_pp.out_paths import check_out_dir

DEFAULT_SHARD_SIZE = "5GB"


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "export", help="write a trained run as a Hugging Face model folder (transformers)",
        description="Write the newest checkpoint of a run as a Hugging Face model folder: config.json, "
                    "model.safetensors (sharded above --max-shard-size), generation_config.json, the run's "
                    "BPE tokenizer, and for AttnRes models the code transformers runs them with "
                    "(trust_remote_code=True).")
    parser.add_argument("--resume", metavar="RUN", required=True,
                        help="the run directory of `attnres-pp train --out RUN` (or one checkpoint folder)")
    parser.add_argument("--out", metavar="DIR", required=True, help="the folder to write (new, or empty)")
    parser.add_argument("--max-shard-size", metavar="SIZE", default=DEFAULT_SHARD_SIZE,
                        help=f"split the weights into shards of at most SIZE (default {DEFAULT_SHARD_SIZE})")
    parser.add_argument("--window", metavar="N", type=int, default=None,
                        help="AttnRes models (remote code): the attention window written as sliding_window, the "
                             "keys each token attends to, itself included, as `generate --window N` (default the "
                             "trained seq_len, generate's default)")
    parser.set_defaults(func=main)


def check_out(out: Path) -> None:
    """ValueError unless `out` is missing or an empty folder we may write beside."""
    if out.is_dir() and any(out.iterdir()):
        raise ValueError(f"--out {out} is a folder that is not empty: give a new or empty folder")
    check_out_dir(out, "--out")
    check_out_dir(out.parent, "--out")  # the folder is assembled beside DIR


def main(args: argparse.Namespace) -> int:
    try:
        lines = export(args.resume, Path(args.out), args.max_shard_size, window=args.window)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


def export(run: str, out: Path, max_shard_size: str = DEFAULT_SHARD_SIZE, *, window: int | None = None) -> list[str]:
    """Write the folder; returns the lines to print. ValueError (nothing written) for a mistake."""
    from attnres_pp.export.weights import parse_size
    from attnres_pp.generate.cli import find_checkpoint, load_checkpoint
    from attnres_pp.generate.prompts import run_tokenizer
    from attnres_pp.train.checkpoint import read_meta

    max_bytes = parse_size(max_shard_size)
    if window is not None and window < 1:
        raise ValueError(f"--window {window}: give at least 1 (the keys each token attends to, itself included)")
    check_out(out)
    step_dir = find_checkpoint(run)
    tokenizer = run_tokenizer(step_dir, read_meta(step_dir))
    try:
        import safetensors  # noqa: F401
    except ImportError:
        raise ValueError("export writes safetensors: pip install 'attnres-pp[hf]' (or: pip install safetensors)"
                         ) from None
    cfg, named = load_checkpoint(step_dir)
    staging = out.parent / f".{out.name}.export-{os.getpid()}"
    missing = [p for p in (out.parent, *out.parent.parents) if not p.exists()]
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        from attnres_pp.export.tokenizer import tokenizer_source

        source = tokenizer_source(step_dir) if tokenizer.kind != "bytes" else None
        files, what = write_folder(staging, cfg, named, max_bytes=max_bytes, tokenizer_file=source,
                                   eot_id=tokenizer.eot_id, window=window)
        if out.is_dir():
            out.rmdir()  # empty (checked): replaced by the assembled folder
        staging.rename(out)
    except BaseException as error:
        shutil.rmtree(missing[-1] if missing else staging, ignore_errors=True)  # the folders made here too
        if isinstance(error, OSError):
            raise ValueError(f"--out {out} could not be written ({error.strerror or error}): free space or "
                             "choose another folder") from None
        raise
    tok_line = ("tokenizer: the run's BPE (tokenizer.json, tokenizer_config.json)" if tokenizer.kind != "bytes"
                else "tokenizer: none written (the run reads raw bytes: token ids are the bytes 0-255)")
    shards = [f for f in files if f.startswith("model-")]
    if shards:  # one line, however many shards
        files = [f"{len(shards)} weight shards (model-*.safetensors)", *(f for f in files if f not in shards)]
    return [f"exported {step_dir} as {what} to {out}", f"files: {', '.join(files)}", tok_line]


def write_folder(out: Path, cfg, named: dict, *, max_bytes: int, tokenizer_file: Path | None = None,
                 eot_id: int | None = None, window: int | None = None) -> tuple[list[str], str]:
    """The folder's files into the existing folder `out` from a model config and its parameters by
    whole-model name: (the files' names, the class transformers loads). `tokenizer_file`: the
    run's BPE tokenizer.json (None: raw bytes, no tokenizer written). `window`: the remote code's
    attention window (None: seq_len); ValueError for a built-in class, which keeps none."""
    import json

    from attnres_pp.export.configs import copy_code, generation_config, model_config
    from attnres_pp.export.tokenizer import write_tokenizer
    from attnres_pp.export.weights import write_weights
    from attnres_pp.train.hf_llama import ARCHITECTURES
    from attnres_pp.train.hf_moe import hf_type, moe_type, to_hf

    kind = hf_type(cfg, named)
    if kind and window is not None:
        raise ValueError(f"--window: this model exports as {ARCHITECTURES[kind]}, which attends to every earlier "
                         "position (no sliding window; docs/export.md): leave --window out")
    if kind:
        tensors = to_hf(named, cfg, kind)
        what = ARCHITECTURES[kind]
    else:  # our own names; a tied head is the embedding's matrix, written once
        tensors = {n: t.detach().contiguous() for n, t in named.items()
                   if not (cfg.tie_embeddings and n == "head.lm_head.weight")}
        what = "AttnResForCausalLM (trust_remote_code=True)"
        if moe_type(cfg):  # the options are a built-in class's, the trained selection bias is not
            what = (f"AttnResForCausalLM (trust_remote_code=True: the aux-free selection bias is nonzero, which "
                    f"{ARCHITECTURES[moe_type(cfg)]} has not)")
    files = write_weights(tensors, out, max_bytes)
    eot_id = eot_id if tokenizer_file is not None else None
    for name, table in (("config.json", model_config(cfg, kind, window)), ("generation_config.json",
                                                                   generation_config(eot_id, kind))):
        (out / name).write_text(json.dumps(table, indent=2) + "\n")
        files.append(name)
    if not kind:
        files += copy_code(out)
    if tokenizer_file is not None:
        files += write_tokenizer(tokenizer_file, out, eot_id=eot_id, seq_len=cfg.seq_len)
    return files, what
