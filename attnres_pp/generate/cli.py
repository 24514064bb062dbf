"""`attnres-pp generate`: text from a checkpoint written by `attnres-pp train`, in one process or
pipelined over the same stages (docs/spec.md section 7), for one prompt or a batch of them.

    attnres-pp generate --resume RUN (--prompt TEXT [--prompt TEXT ..] | --prompt-file F | --prompts-file F)
        --max-new-tokens N [--temperature T --top-k K --seed S --prefill-chunk N --window N --stop S ..]
        [--device auto|cpu|cuda --dtype auto|fp32|bf16]
        [--stages P --virtual V --tensor-parallel T --launcher local|inprocess|ray --p2p-semantics auto|gloo|nccl
         --layer-counts .. --timeout S] [--json]

Tokens are bytes, or, for a run trained on a BPE data folder, the ids of the run's tokenizer (its
copy of tokenizer.json, checked against the sha256 the checkpoint records), which encodes the
prompts and decodes the output; `--stop` then matches the decoded text. Several prompts run as one
batch (`generate.loop`). `--json` prints one object per prompt, one per line, in prompt order:
`{"text", "tokens", "prompt_ids", "tokenizer", "prefill_s", "decode_s_per_token", ...}`; progress
goes to stderr. A mistake in
the input (no checkpoint, an empty prompt, a bad prompts file, a byte outside the vocabulary, too
long a request, a device that is not there) is one `error:` line and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from attnres_pp.cli_flags import convert_flag, number_flag
from attnres_pp.generate.config import GenerationConfig
from attnres_pp.generate.prompts import (
    decode_text,
    encode_prompt,
    read_prompts,
    run_tokenizer,
    stop_strings,
    text_stops,
)
from attnres_pp.launch.flags import add_run_flags, run_values
from attnres_pp.model_flags import add_layer_counts_flag, layer_counts_flag
from attnres_pp.pipeline.config import LAUNCHERS

GENERATE_LAUNCHERS = tuple(launcher for launcher in LAUNCHERS if launcher != "torchrun")  # torchrun: training only

# (flag, GenerationConfig or PipelineConfig field, type, help); parsed as strings, converted here so a
# bad value is one clear `error:` line.
_GEN_FLAGS = (
    ("--max-new-tokens", "max_new_tokens", int, "tokens to generate per prompt (required)"),
    ("--temperature", "temperature", float, "sampling temperature; 0 = greedy (default 1.0)"),
    ("--top-k", "top_k", int, "sample among the k most likely tokens; 0 = all (default)"),
    ("--seed", "seed", int, "seed of each sequence's sampler (default 0)"),
    ("--prefill-chunk", "prefill_chunk", int,
     "prompt tokens per prefill piece; 0 = the whole prompt in one piece (default). Pieces let the "
     "pipeline's ranks work on the prompt at once"),
    ("--window", "window", int,
     "attention window: the keys each token attends to, itself included (default the model's trained seq_len). "
     "A rotary-position model generates past its trained length, each layer's key/value cache holding the "
     "last N positions; a learned-position model stops at seq_len"),
)
# The run flags generation shares with training (`launch.flags`); --device and --dtype fill the
# GenerationConfig, the others the PipelineConfig.
_RUN_FLAGS = ("--device", "--dtype", "--stages", "--virtual", "--tensor-parallel", "--launcher", "--timeout",
              "--p2p-semantics", "--threads")
_RUN_NOTES = {
    "--dtype": "the checkpoint's fp32 weights under bf16 autocast",
    "--tensor-parallel": "each layer split over T ranks, the prefill and every decode pass without sequence "
                         "sharding; on cpu",
    "--timeout": "default 120",
    "--threads": "default 1",
    "--launcher": f"generate takes {', '.join(GENERATE_LAUNCHERS)} (default local)",
}


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate", help="generate text from a trained checkpoint (single process or pipelined)",
        description="Generate text from the newest checkpoint of a training run: prefill the prompts (several "
                    "run as one batch), then decode one token per pass with each layer's key/value cache on its "
                    "rank. Each prompt's greedy output is the one it gets alone.")
    parser.add_argument("--resume", metavar="RUN", help="the run directory (its newest complete checkpoint), or "
                                                       "one checkpoint folder RUN/checkpoints/step_N")
    parser.add_argument("--prompt", metavar="TEXT", action="append",
                        help="a prompt, as UTF-8 bytes; repeat it for a batch of prompts")
    parser.add_argument("--prompt-file", metavar="FILE", help="read one prompt from FILE: its bytes, newlines included")
    parser.add_argument("--prompts-file", metavar="FILE",
                        help="a batch of prompts: one per line, or for FILE.jsonl one {\"prompt\": ...} JSON object "
                             "per line (prompts with newlines)")
    parser.add_argument("--stop", metavar="S", action="append",
                        help="end a sequence where it first generates the string S (repeatable); S itself and "
                             "anything after it are not included in the output")
    for flag, key, _kind, help_text in _GEN_FLAGS:
        parser.add_argument(flag, metavar=key.upper(), help=help_text)
    add_run_flags(parser, _RUN_FLAGS, notes=_RUN_NOTES)
    add_layer_counts_flag(parser)
    parser.add_argument("--address", metavar="ADDR", help="--launcher ray: the cluster to join (default: "
                                                         "RAY_ADDRESS, else a private local instance)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object per prompt, one per line, in prompt order, instead of the texts")
    parser.set_defaults(func=main)


def _values(args: argparse.Namespace, flags: tuple) -> dict:
    return {key: convert_flag(flag, raw, kind) for flag, key, kind, _help in flags
            if (raw := getattr(args, flag[2:].replace("-", "_"))) is not None}


def configs_from_args(args: argparse.Namespace):
    """(GenerationConfig, PipelineConfig, threads); ValueError naming the flag to fix."""
    from attnres_pp.pipeline.config import PipelineConfig

    if args.max_new_tokens is None:
        raise ValueError("--max-new-tokens N is required: how many tokens to generate")
    # --threads sizes this command's processes, not a config field: checked here, as number_flag words it.
    given = run_values(args, tuple(flag for flag in _RUN_FLAGS if flag != "--threads"))
    threads = number_flag("--threads", args.threads, int, bound="> 0", example="--threads 1") \
        if args.threads is not None else 1
    gen_cfg = GenerationConfig(**_values(args, _GEN_FLAGS), **given.get("train", {}), stop=stop_strings(args.stop))
    pipe_values = {"launcher": "local", **given.get("pipeline", {})}
    if args.layer_counts is not None:
        pipe_values["layer_counts"] = layer_counts_flag(args)
    if args.address is not None and pipe_values["launcher"] != "ray":
        raise ValueError(f"--address is for --launcher ray, not {pipe_values['launcher']}")
    if pipe_values["launcher"] == "torchrun":  # training's launcher only (`launch.torchrun_rank_group`)
        raise ValueError("--launcher torchrun runs `attnres-pp train` only: generate with --launcher "
                         f"{', '.join(GENERATE_LAUNCHERS)}")
    return gen_cfg, PipelineConfig(**pipe_values), threads


def find_checkpoint(run: str | None) -> Path:
    """The checkpoint folder of `--resume RUN`: RUN itself if it is one, else RUN's newest complete one."""
    from attnres_pp.train.checkpoint import checkpoints_dir, latest_checkpoint

    if run is None:
        raise ValueError("--resume RUN is required: the run directory of `attnres-pp train ... --out RUN`")
    path = Path(run)
    if not path.exists():
        raise ValueError(f"--resume {run}: no such directory; give the --out directory of a training run")
    if not path.is_dir():
        raise ValueError(f"--resume {run} is a file: give the --out directory of a training run")
    if (path / "meta.json").is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise ValueError(f"--resume {run}: no complete checkpoint under {checkpoints_dir(path)} "
                         "(a run saves one at its last step unless --no-final-checkpoint)")
    return latest


def load_checkpoint(step_dir: Path):
    """(ModelConfig, parameters by whole-model name) of a checkpoint folder; ValueError if unreadable."""
    from torch.distributed.checkpoint.api import CheckpointException

    from attnres_pp.model import ModelConfig
    from attnres_pp.train.checkpoint import read_meta
    from attnres_pp.train.shards import read_parameters

    try:
        model_cfg = ModelConfig.from_dict(read_meta(step_dir)["config"]["model"])
        with warnings.catch_warnings():  # a damaged file makes torch.load warn before it fails: one line only
            warnings.simplefilter("ignore")
            return model_cfg, read_parameters(step_dir)
    except ValueError:
        raise
    # A damaged file fails in torch.load, pickle, zipfile or json in many ways; DCP wraps its readers'
    # failures in CheckpointException, a BaseException.
    except (Exception, CheckpointException) as error:
        detail = (str(error).strip().splitlines() or [""])[-1]  # DCP's text embeds a whole traceback
        raise ValueError(f"checkpoint {step_dir} cannot be read ({type(error).__name__}: {detail}); "
                         "give another one with --resume") from None


def _fits(model_cfg, prompts: list[list[int]], max_new_tokens: int) -> None:
    from attnres_pp.generate.loop import check_fits

    for number, ids in enumerate(prompts, start=1):
        try:
            check_fits(model_cfg, len(ids), max_new_tokens)
        except ValueError as error:
            raise ValueError(f"prompt {number}: {error}" if len(prompts) > 1 else str(error)) from None


@dataclass(frozen=True)
class _Request:
    """What `main` generates: the checkpoint, its model and tokenizer, the prompts as ids, and the run
    decided (`gen_cfg` and `pipe` as given, `device` and `precision` as the launch layer decides)."""

    step_dir: Path
    model_cfg: object
    named: dict
    tokenizer: object
    ids: list
    gen_cfg: GenerationConfig
    pipe: object
    threads: int
    device: str
    precision: str


def _request(args: argparse.Namespace) -> _Request:
    """Every check before a rank starts; ValueError (one `error:` line) naming what to fix."""
    from attnres_pp.generate.engines import check_tensor_parallel_generation, decide_generation
    from attnres_pp.generate.worker import pipeline_partition
    from attnres_pp.train.checkpoint import read_meta

    gen_cfg, pipe, threads = configs_from_args(args)
    # The Ray launcher decides against the cluster's GPUs once it has joined it.
    resolved = None if pipe.launcher == "ray" else decide_generation(gen_cfg.device, gen_cfg.dtype, pipe)
    device, precision = (gen_cfg.device, gen_cfg.dtype) if resolved is None else (resolved.device, resolved.dtype)
    if device == "cuda" and pipe.launcher == "local" and pipe.n_chunks > 1:
        pipe.resolved_p2p("nccl")  # --p2p-semantics gloo over nccl fails here, not in a rank
    step_dir = find_checkpoint(args.resume)
    prompts = read_prompts(args)
    tokenizer = run_tokenizer(step_dir, read_meta(step_dir))
    if tokenizer.kind != "bytes":
        text_stops(gen_cfg.stop)
    model_cfg, named = load_checkpoint(step_dir)
    which = (lambda n: f"prompt {n}: ") if len(prompts) > 1 else (lambda n: "")
    ids = [encode_prompt(prompt, tokenizer, model_cfg.vocab_size, which(n)) for n, prompt in enumerate(prompts, 1)]
    _fits(model_cfg, ids, gen_cfg.max_new_tokens)
    pipeline_partition(model_cfg, pipe)  # a split that does not fit the model fails here, in one line
    check_tensor_parallel_generation(model_cfg, pipe, device)
    return _Request(step_dir, model_cfg, named, tokenizer, ids, gen_cfg, pipe, threads, device, precision)


def main(args: argparse.Namespace) -> int:
    from attnres_pp.generate.loop import generate_batch

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        request = _request(args)
        import torch

        from attnres_pp.generate.engines import make_generator
        from attnres_pp.launch.resolve import single_process

        torch.set_num_threads(request.threads)
        pipe, model_cfg, ids = request.pipe, request.model_cfg, request.ids
        tp = f" T={pipe.tensor_parallel}" if pipe.tensor_parallel > 1 else ""
        where = "one process" if single_process(pipe) else f"P={pipe.stages} V={pipe.virtual}{tp} ({pipe.launcher})"
        progress(f"generate: {request.step_dir} ({model_cfg.residual}, {model_cfg.n_layers} layers, "
                 f"d={model_cfg.d_model}) on {where}, {request.device} {request.precision}")
        started = time.perf_counter()
        generator = make_generator(model_cfg, pipe, request.named, threads=request.threads, address=args.address,
                                   device=request.device, precision=request.precision,
                                   window=request.gen_cfg.window)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except RuntimeError as error:  # a rank that failed to start
        print(f"error: {error}", file=sys.stderr)
        return 1
    decode = None if request.tokenizer.kind == "bytes" else request.tokenizer.decode
    try:
        lengths = sorted({len(prompt) for prompt in ids})
        size = f"prompt {lengths[0]} tokens" if len(ids) == 1 else \
            f"{len(ids)} prompts of {lengths[0]}..{lengths[-1]} tokens"
        progress(f"  ready in {time.perf_counter() - started:.1f} s; {size}, {request.gen_cfg.max_new_tokens} new")
        results = generate_batch(generator, ids, request.gen_cfg, progress, decode)
    except KeyboardInterrupt:
        print("interrupted: stopping the workers", file=sys.stderr)
        return 130
    except RuntimeError as error:  # a lost or failed rank
        print(f"error: {error}", file=sys.stderr)
        return 1
    finally:
        generator.close()
    _report(request, results, decode, progress, as_json=args.json)
    return 0


def _report(request: _Request, results: list, decode, progress, *, as_json: bool) -> None:
    """Each prompt's timings on stderr, then its text (or, `as_json`, one JSON object) on stdout."""
    ids, pipe = request.ids, request.pipe
    for number, (prompt, result) in enumerate(zip(ids, results, strict=True), start=1):
        label = f"  prompt {number}:" if len(ids) > 1 else " "
        stopped = f"; stopped at {result.stopped_at!r}" if result.stopped_at is not None else ""
        progress(f"{label} prefill {len(prompt)} tokens in {1e3 * result.prefill_s:.1f} ms; "
                 f"{len(result.decode_s)} more tokens at {1e3 * result.decode_s_per_token:.2f} ms/token{stopped}")
    for prompt, result in zip(ids, results, strict=True):
        if decode is None:
            text = decode_text(result.tokens)
        else:
            text = result.text if result.text is not None else decode(result.tokens)
        if as_json:
            print(json.dumps({"text": text, "tokens": result.tokens, "prompt_ids": prompt,
                              "tokenizer": request.tokenizer.kind, "prefill_s": result.prefill_s,
                              "decode_s_per_token": result.decode_s_per_token, "prompt_tokens": len(prompt),
                              "checkpoint": str(request.step_dir), "stages": pipe.stages, "virtual": pipe.virtual,
                              "tensor_parallel": pipe.tensor_parallel, "launcher": pipe.launcher}))
        else:
            print(text)
