"""`dsv4gen eval`'s work: the held-out task mix through the engine (batched and chunked as a server runs it), exact
match per task, and DSpark's acceptance per draft position.

Every request is greedy, so a run with DSpark must give the same replies as one without (verification is lossless):
`compare` says whether it did. Must not know HTTP or the command line.
"""
from __future__ import annotations

import time
from typing import NamedTuple

from lib.engine.sampling import SamplingParams
from lib.evaluation.scoring import is_correct
from lib.evaluation.tasks import Example, examples
from lib.text.chat_encoding import encode_messages
from lib.text.tokenizer import EOS

GAP_WINDOWS = 8           # retrieval: sliding windows between the asked record and the question (the bar)
SLACK_TOKENS = 8          # generated beyond the answer's own length before a reply counts as not ending


class Outcome(NamedTuple):
    example: Example
    reply: str             # generated text, markup kept, end of sentence left out
    correct: bool


class SuiteRun(NamedTuple):
    outcomes: tuple[Outcome, ...]
    drafted: tuple[int, ...]     # per draft position: rounds that verified it
    accepted: tuple[int, ...]    # per draft position: of those, the accepted ones
    seconds: float
    tokens: int                  # generated tokens

    def accuracy(self) -> dict[str, dict]:
        """Per task: examples, exact matches and their share."""
        out = {}
        for task in dict.fromkeys(o.example.task for o in self.outcomes):
            done = [o for o in self.outcomes if o.example.task == task]
            right = sum(o.correct for o in done)
            out[task] = {"examples": len(done), "correct": right, "accuracy": right / len(done)}
        return out

    def speculation(self) -> dict | None:
        if not any(self.drafted):
            return None
        rounds = self.drafted[0]
        return {"rounds": rounds, "accepted_per_position": [a / d if d else None for a, d in zip(self.accepted, self.drafted)],
                "drafted": list(self.drafted), "accepted": list(self.accepted),
                "mean_accepted_per_round": sum(self.accepted) / rounds if rounds else 0.0}


def prompt_text(example: Example) -> str:
    return encode_messages(list(example.messages), tools=list(example.tools) if example.tools else None)


def reply_text(example: Example) -> str:
    """The assistant turn the example expects, as the chat encoding writes it (its end of sentence included)."""
    full = encode_messages([*example.messages, example.reply], tools=list(example.tools) if example.tools else None,
                           add_generation_prompt=False)
    prompt = prompt_text(example)
    if not full.startswith(prompt):
        raise AssertionError(f"{example.task}: the encoded answer does not extend the encoded prompt")
    return full[len(prompt):]


def heldout(tasks: tuple[str, ...], per_task: int, seed: int, *, gap_tokens: int, count_tokens) -> list[Example]:
    """The held-out questions of `tasks`, `per_task` of each."""
    return [ex for task in tasks for ex in examples(task, "heldout", per_task, seed, gap_tokens=gap_tokens,
                                                    count_tokens=count_tokens)]


def heldout_for(cfg, tokenizer, tasks: tuple[str, ...], per_task: int, seed: int = 0,
                gap_windows: int = GAP_WINDOWS) -> list[Example]:
    """`heldout` for a model: retrieval's gap is `gap_windows` of its sliding windows, counted in its tokenizer's
    tokens (`cfg`: the model's config)."""
    return heldout(tasks, per_task, seed, gap_tokens=gap_windows * cfg.sliding_window,
                   count_tokens=lambda s: len(tokenizer.encode(s)))


def run(engine, tokenizer, exs: list[Example], progress=None) -> SuiteRun:
    """Every example through `engine` at once (its scheduler batches and chunks them), greedy, and scored."""
    drafted0, accepted0 = list(engine.drafted), list(engine.accepted)
    ids = {}
    for i, ex in enumerate(exs):
        answer = len(tokenizer.encode(reply_text(ex)))
        params = SamplingParams(max_tokens=answer + SLACK_TOKENS, temperature=0.0, keep_markup=True)
        ids[engine.add_request(tokenizer.encode(prompt_text(ex)), params, request_id=f"eval-{i}")] = i
    generated: dict[str, list[int]] = {rid: [] for rid in ids}
    started = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            if out.error:
                raise RuntimeError(f"eval request {out.request_id} failed: {out.error}")
            generated[out.request_id] += out.new_tokens
            if out.finished and progress is not None:
                progress.update(1)
    seconds = time.perf_counter() - started
    outcomes = []
    for rid, i in ids.items():
        tokens = [t for t in generated[rid] if t != tokenizer.eos_id]
        reply = tokenizer.decode(tokens)
        outcomes.append(Outcome(exs[i], reply, is_correct(exs[i], reply)))
        engine.release(rid)
    return SuiteRun(tuple(outcomes), tuple(d - d0 for d, d0 in zip(engine.drafted, drafted0)),
                    tuple(a - a0 for a, a0 in zip(engine.accepted, accepted0)), seconds,
                    sum(len(g) for g in generated.values()))


def samples(runs: dict[str, SuiteRun]) -> list[dict]:
    """One record per run and question (what `dsv4gen eval --log-samples` writes, a line each): the question as the
    user asked it, the reply the example expects and the one generated, both as the chat encoding writes them
    (markup kept, end of sentence left out), and whether it counted as correct."""
    out = []
    for name, r in runs.items():
        for i, o in enumerate(r.outcomes):
            ex = o.example
            out.append({"run": name, "task": ex.task, "index": i, "question": ex.messages[-1]["content"],
                        "tools": [t["function"]["name"] for t in ex.tools or ()],
                        "expected": reply_text(ex).removesuffix(EOS),
                        "reply": o.reply, "correct": o.correct})
    return out


def report(runs: dict[str, SuiteRun], **about) -> dict:
    """The JSON `dsv4gen eval` prints: per run (with and without DSpark) accuracy per task and acceptance, and
    whether the runs' replies are the same."""
    out = {**about, "runs": {}}
    for name, r in runs.items():
        out["runs"][name] = {"accuracy": r.accuracy(), "speculation": r.speculation(), "seconds": round(r.seconds, 2),
                             "generated_tokens": r.tokens,
                             "tokens_per_second": round(r.tokens / r.seconds, 1) if r.seconds else None}
    if len(runs) > 1:
        replies = [[o.reply for o in r.outcomes] for r in runs.values()]
        out["identical_replies"] = all(rep == replies[0] for rep in replies[1:])
    return out


