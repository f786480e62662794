"""The `pdserve` command line: one entry point, one sub-command per job."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

from pdserve.engine.arg_utils import EngineArgs

logger = logging.getLogger("pdserve")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default (but a required flag's)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.required:
            return action.help
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """pdserve's parsers, its sub-commands' included: --help shows the defaults."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def cmd_make_model(args: argparse.Namespace) -> int:
    from pdserve.make_model import make_model

    make_model(args.arch, args.preset, args.out, seed=args.seed, device=args.device)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from pdserve.engine.models import gguf

    gguf.model_dir(args.model)  # a bad --model is refused before the engine (torch) loads
    from pdserve.engine import LLM, SamplingParams

    llm = LLM.from_engine_args(EngineArgs.from_cli_args(args))
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        max_tokens=args.max_tokens,
        seed=args.sampling_seed,
        repetition_penalty=args.repetition_penalty,
        stop=tuple(args.stop or ()),
        ignore_eos=args.ignore_eos,
    )
    prompts = args.prompts
    if args.chat:
        tok = llm.get_tokenizer()
        # the rendered template already holds bos: encode it without adding special tokens
        prompts = [
            tok.encode(
                tok.apply_chat_template(
                    [{"role": "user", "content": p}], add_generation_prompt=True
                ),
                add_special_tokens=False,
            )
            for p in prompts
        ]
    outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    for prompt, out in zip(args.prompts, outputs, strict=True):
        completion = out.outputs[0]
        if args.json:
            record = {
                "prompt": prompt,
                "text": completion.text,
                "token_ids": completion.token_ids,
                "finish_reason": completion.finish_reason,
                "num_cached_tokens": out.num_cached_tokens,
            }
            sys.stdout.write(json.dumps(record) + "\n")
        else:
            sys.stdout.write(f"{prompt}{completion.text}\n")
    return 0


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line. With command (a sub-command's name, or "" for none), only that
    sub-command's flags are built and only its modules imported (the others get their name and
    help), so a gateway process never imports torch and `pdserve --help` answers at once."""
    parser = ArgumentParser(
        prog="pdserve", description="LLM inference and serving with disaggregated prefill/decode."
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        help="logging level (DEBUG, INFO, WARNING); `serve` passes it to every process it starts",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    mm = sub.add_parser(
        "make-model",
        help="write a small random HF-format model + tokenizer",
        description="Write a Hugging Face-format model directory with seeded random weights and "
        "a byte-level BPE tokenizer trained locally (no downloads).",
    )
    mm.add_argument(
        "--arch",
        default="llama",
        choices=["llama", "qwen2", "qwen3", "mistral"],
        help="model family",
    )
    mm.add_argument(
        "--preset",
        default="tiny",
        choices=["tiny", "small", "bench", "gpu-1b"],
        help="size: tiny ~2-5M params (tests), small ~20-40M, bench ~100-150M, "
        "gpu-1b ~0.8-1B (for a GPU: hidden 2048, 16 layers, 32/8 heads)",
    )
    mm.add_argument("--out", required=True, help="output directory")
    mm.add_argument(
        "--seed", type=int, default=0, help="weights seed (same seed and device, same bytes)"
    )
    mm.add_argument(
        "--device",
        default="cpu",
        help="where the random weights are drawn: cpu, cuda or cuda:N (fast for gpu-1b)",
    )
    mm.set_defaults(func=cmd_make_model)

    gen = sub.add_parser(
        "generate",
        help="generate offline from prompts",
        description="Run the engine offline on the given prompts and write the completions.",
    )
    EngineArgs.add_cli_args(gen)
    gen.add_argument("prompts", nargs="+", help="prompt texts")
    gen.add_argument("--max-tokens", type=int, default=32, help="most tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = all)")
    gen.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p * max prob")
    gen.add_argument("--repetition-penalty", type=float, default=1.0, help="HF-style penalty")
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past eos")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.add_argument("--json", action="store_true", help="write one JSON record per prompt")
    gen.set_defaults(func=cmd_generate)
    _add_service_commands(sub, command)
    from pdserve import bench

    bench.add_parser(sub)
    return parser


ROLES = {
    "prefill": ("pdserve.prefill_node.main", "run a prefill node (computes prompts, pushes KV)"),
    "decode": ("pdserve.decode_node.main", "run a decode node (admits requests, streams tokens)"),
    "gateway": (
        "pdserve.gateway.main",
        "run the gateway alone (OpenAI REST + gRPC) against nodes",
    ),
    "serve": ("pdserve.serve", "run the whole stack on this machine: gateway + prefill + decode"),
}
"""The long-running roles: each module owns its flags (add_arguments) and its life (run)."""


def _add_service_commands(sub: argparse._SubParsersAction, command: str | None) -> None:
    """The roles' sub-commands: every one's flags, or (command given) only command's; a node
    module imports torch, which the gateway and serve's supervisor never need."""
    import importlib

    for name, (module_name, text) in ROLES.items():
        if command is not None and name != command:
            sub.add_parser(name, help=text)
            continue
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=text, description=module.__doc__)
        module.add_arguments(p)
        p.set_defaults(func=module.run)


def _command_of(argv: Sequence[str]) -> str | None:
    """The sub-command argv names (its first word that is not an option or --log-level's
    value), or None (no command: the parser says what is missing)."""
    words = iter(argv)
    for word in words:
        if word == "--log-level":
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    parser = build_parser(_command_of(argv) or "")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return args.func(args)
    except ValueError as exc:
        logger.error("%s", exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
