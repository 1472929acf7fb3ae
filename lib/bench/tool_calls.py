"""`python -m lib.bench.tool_calls`: held-out tool-call prompts sent through the real `openai` client to the server,
counted the way an application sees them: a reply counts when `message.tool_calls` holds exactly one call, of the
expected function, whose `arguments` parse to the expected JSON values.

`dsv4gen eval` scores the same questions from the engine's text with the server's DSML parser; this is the whole
path a client takes (chat template, tools in the request, parsing into `tool_calls`, the wire format). Greedy, with
the server's defaults otherwise (DSpark where the checkpoint has it). Needs `openai` (the `test` extra).
"""
from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lib.evaluation.scoring import expected_call
from lib.evaluation.suite import SLACK_TOKENS, reply_text
from lib.evaluation.tasks import Example, examples
from lib.text.tokenizer import Tokenizer

NAME = "deepseek-v4-tiny"


def _verdict(example: Example, message) -> tuple[bool, bool]:
    """(the reply carried exactly one parsed tool call, that call is the expected one)."""
    calls = message.tool_calls or []
    if len(calls) != 1:
        return False, False
    try:
        got = (calls[0].function.name, json.loads(calls[0].function.arguments))
    except json.JSONDecodeError:
        return True, False
    return True, got == expected_call(example)


def measure(model: Path, n: int, seed: int = 0, concurrency: int = 8) -> dict:
    """Serve `model` in this process, ask `n` held-out tool-call questions at `concurrency` at a time."""
    import openai

    from serve.cli import prepare, run_in_thread

    tokenizer = Tokenizer.from_dir(model)
    exs = examples("tool_call", "heldout", n, seed)
    prepared = prepare(["--model", str(model), "--port", "0", "--served-model-name", NAME], out=sys.stderr)
    server, thread = run_in_thread(prepared)
    client = openai.OpenAI(base_url=prepared.url + "/v1", api_key="unused", max_retries=0, timeout=600)

    def ask(example: Example) -> tuple[bool, bool]:
        reply = client.chat.completions.create(
            model=NAME, messages=list(example.messages), tools=list(example.tools), temperature=0,
            max_tokens=len(tokenizer.encode(reply_text(example))) + SLACK_TOKENS)
        return _verdict(example, reply.choices[0].message)

    try:
        with ThreadPoolExecutor(concurrency) as pool:
            verdicts = list(pool.map(ask, exs))
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    parsed, right = sum(p for p, _ in verdicts), sum(r for _, r in verdicts)
    return {"model": str(model), "prompts": n, "seed": seed, "parsed_tool_calls": parsed,
            "right_name_and_arguments": right, "accuracy": right / n if n else 0.0,
            "right_per_prompt": [r for _, r in verdicts]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lib.bench.tool_calls", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="checkpoint directory (one written by dsv4gen train-tiny)")
    p.add_argument("--prompts", type=int, default=50, help="held-out tool-call questions (default 50)")
    p.add_argument("--seed", type=int, default=0, help="which held-out questions (default 0)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    args = p.parse_args(argv)
    if args.prompts < 1 or args.concurrency < 1:
        p.error("--prompts and --concurrency must be at least 1")
    result = measure(Path(args.model), args.prompts, args.seed, args.concurrency)
    print(json.dumps(result, indent=2))
    print(f"{result['right_name_and_arguments']}/{args.prompts} tool-call prompts answered with the right call "
          f"through the openai client ({result['accuracy']:.0%}; {result['parsed_tool_calls']} parsed as one call)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
