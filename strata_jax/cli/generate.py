"""``strata-jax generate``: one prompt in, a completion out."""

from __future__ import annotations

import argparse
import json
import sys

from strata_jax.api import InvalidRequestError, SamplingParams


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="tiny", help="'tiny' (embedded random default), a local Hugging Face folder or a .gguf file"
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text (tokenized with the model's tokenizer)")
    source.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    parser.add_argument("--max-tokens", type=int, default=32, help="number of tokens to generate (default 32)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0 = off)")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed for reproducible output")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="weights/KV dtype (default: float32 on CPU, bfloat16 on GPU)",
    )
    add_tp_argument(parser)
    parser.add_argument("--json", action="store_true", help='print only {"token_ids": [...], "text": "..."} on stdout')


def add_tp_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel size: split the model and KV pool over this many devices (default 1; "
        "must divide the attention heads, KV heads and intermediate size; see docs/runtime.md)",
    )


def parse_prompt_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise InvalidRequestError(f"--prompt-ids must be comma-separated integers, got {text!r}") from exc
    if not ids:
        raise InvalidRequestError("--prompt-ids is empty")
    return ids


def run_generate(args: argparse.Namespace) -> int:
    from strata_jax.engine import Engine, EngineConfig

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
        )
        prompt: str | list[int] = parse_prompt_ids(args.prompt_ids) if args.prompt_ids is not None else args.prompt
    except InvalidRequestError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        engine = Engine(
            EngineConfig(model=args.model, dtype=args.dtype, tp=args.tp, warmup=False, show_progress=not args.json)
        )
    except InvalidRequestError as exc:  # e.g. --tp above the device count or not dividing the heads
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        out = engine.generate([prompt], params)[0]
    except InvalidRequestError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        engine.shutdown()
    if args.json:
        print(json.dumps({"token_ids": out.token_ids, "text": out.text}))
    else:
        print(out.text)
        print(
            f"[{len(out.token_ids)} tokens, finish={out.finish_reason}, "
            f"time to first token {out.ttft_s * 1e3:.0f} ms incl. compilation]",
            file=sys.stderr,
        )
    return 0
