"""The task mix: chat questions whose answers can be checked exactly, for training a tiny model and judging it.

Each task draws examples from a seeded generator, split into "train" and "heldout" so that no held-out question is
ever a training one: operands, strings and tool arguments are assigned to a split by a hash of the question's own
values; the fact table (lib/evaluation/names.py) is fixed and held out by phrasing; retrieval draws fresh keys and
values from each split's own stream. Every example is a list of OpenAI-style messages (plus tools) and the assistant
message that answers it, so it is written in the V4 chat encoding by the same encoder the server uses.

- arithmetic: "What is 17+25?" -> "17+25: 7+5=12, 1+2+1=4, so 17+25=42" (the question, the digit steps, then the
              question and its result; sums and differences of numbers below 100, products below 13 x 13)
- counting:   how often a letter occurs in a made-up string -> "3"
- copying:    "Repeat exactly: ..." -> the same words
- facts:      the capital, language or national animal of a made-up country -> its value in the table
- retrieval:  a list of name -> code records, the asked one first and at least `gap_tokens` tokens before the
              question (so that a model whose window is shorter reaches it only through compressed attention)
- tool_call:  asked with a `tools` list, the reply is the DSML call of the right function with the right arguments

Must not know models, engines or tokenizers (retrieval takes a token counter).
"""
from __future__ import annotations

import json
import random
import zlib
from typing import Callable, NamedTuple

from lib.evaluation.names import distinct_words, fact_table, made_up_word

TASKS = ("arithmetic", "counting", "copying", "facts", "retrieval", "tool_call")
SPLITS = ("train", "heldout")
HELDOUT_SHARE = 8          # one value-hashed question in this many belongs to the held-out split


class Example(NamedTuple):
    task: str
    messages: tuple[dict, ...]       # the conversation up to the turn to generate
    tools: tuple[dict, ...] | None   # OpenAI tool schemas the request carries
    reply: dict                      # the assistant message that answers it (content, or tool_calls)


def _in_split(split: str, *values) -> bool:
    held = zlib.crc32(repr(values).encode()) % HELDOUT_SHARE == 0
    return held == (split == "heldout")


def _user(text: str) -> tuple[dict, ...]:
    return ({"role": "user", "content": text},)


def _answer(text: str) -> dict:
    return {"role": "assistant", "content": text}


ARITHMETIC = ("What is {a}{op}{b}?", "Compute {a} {op} {b}.", "{a}{op}{b}=?", "Calculate {a}{op}{b}, please.")


def worked(a: int, op: str, b: int) -> str:
    """The reply to a{op}b: the question, its digit steps, then the question and its result
    ("17+25: 7+5=12, 1+2+1=4, so 17+25=42").

    Each step is a lookup a small model can learn from other questions, so a held-out question is answered from
    steps seen in training rather than from a memorised result: a sum adds the units, then the tens with the carry; a
    difference first writes which number is larger ("47-68: 68>47, ..."), takes the smaller from it (units with the
    borrow, then tens less it) and copies the order again just before its result ("..., 68>47 so 47-68=-21"), so
    that the sign is read from tokens a few places back rather than from the order step at the window's edge; a
    product names the smaller factor first (7*8 and 8*7 share their step) and splits a factor of 10-12 into ten and
    the rest, after writing which factor is larger as a difference does ("12*11: 12>11, 11*10=110, ..."), so that
    the factor worked first is copied from just before rather than found by comparing the question's operands (a
    model that compared them took the first as the smaller in 12*11 and 11*10). The question is restated first,
    where it is a copy of the tokens just before, and the closing restatement can copy that one: from the user's
    turn past the steps, a product's operands sat more than one 32-token sliding window back and were misread (from
    the reply's start, a sum's always sit within it, a difference's in about 2 cases of 10, a product's in about 6
    of 10).
    """
    head = f"{a}{op}{b}: "
    big, small = max(a, b), min(a, b)
    order = f"{big}>{small}" if big != small else f"{a}={b}"    # a difference's and a two-digit product's first step
    if op == "+":
        units = a % 10 + b % 10
        tens = a // 10 + b // 10 + units // 10
        return f"{head}{a % 10}+{b % 10}={units}, {a // 10}+{b // 10}+{units // 10}={tens}, so {a}+{b}={a + b}"
    if op == "-":
        borrow = int(big % 10 < small % 10)
        units = f"{'1' if borrow else ''}{big % 10}-{small % 10}={big % 10 + 10 * borrow - small % 10}"
        tens = f"{big // 10}-{small // 10}-{borrow}={big // 10 - small // 10 - borrow}"
        return f"{head}{order}, {units}, {tens}, {order} so {a}-{b}={a - b}"
    if op != "*":
        raise ValueError(f"arithmetic: unknown operator {op!r} (one of + - *)")
    if big < 10:
        return f"{head}{small}*{big}={a * b}, so {a}*{b}={a * b}"
    rest = small * (big - 10)
    return (f"{head}{order}, {small}*10={small * 10}, {small}*{big - 10}={rest}, {small * 10}+{rest}={a * b}, "
            f"so {a}*{b}={a * b}")


def _arithmetic_split(split: str, a: int, op: str, b: int) -> bool:
    # A product of two digits is a times-table entry: it is a step of other questions, not worked from steps, so a
    # held-out one could only be guessed; every such question is a training one.
    if op == "*" and a < 10 and b < 10:
        return split == "train"
    # A product is worked with the same steps as its mirror b*a (`worked` puts the smaller operand first), and some
    # steps (10*0, 11*2) appear in no other question: a held-out product's mirror is a training question, so a
    # square (its own mirror) is a training one.
    if op == "*":
        return (_in_split("heldout", a, op, b) and not _in_split("heldout", b, op, a)) == (split == "heldout")
    return _in_split(split, a, op, b)


def _example(split: str, rng: random.Random, a: int, op: str, b: int) -> Example | None:
    if not _arithmetic_split(split, a, op, b):
        return None
    return Example("arithmetic", _user(rng.choice(ARITHMETIC).format(a=a, op=op, b=b)), None,
                   _answer(worked(a, op, b)))


def arithmetic(rng: random.Random, split: str) -> Example:
    while True:
        op = rng.choice("+-*")
        hi = 13 if op == "*" else 100
        ex = _example(split, rng, rng.randrange(hi), op, rng.randrange(hi))
        if ex is not None:
            return ex


def arithmetic_edges(rng: random.Random, split: str) -> Example:
    """A sum or difference of the kinds a uniform draw rarely gives and a small model gets wrong: a one-digit
    operand, two operands with the same tens (a difference's sign rests on the units), an operand that is a whole
    ten (0 included). Training draws some arithmetic from here; the held-out split is the same as `arithmetic`'s."""
    while True:
        op, kind = rng.choice("+-"), rng.randrange(3)
        a = rng.randrange(100)
        units = rng.randrange(10)
        b = (units, a // 10 * 10 + units, 10 * units)[kind]
        if rng.random() < 0.5:
            a, b = b, a
        ex = _example(split, rng, a, op, b)
        if ex is not None:
            return ex


def counting(rng: random.Random, split: str) -> Example:
    while True:
        letters = rng.sample("abcdeklmnoprst", 4)
        text = "".join(rng.choice(letters) for _ in range(rng.randint(5, 12)))
        letter = rng.choice(letters)
        if _in_split(split, text, letter):
            question = f"How many times does the letter {letter} appear in {text}?"
            return Example("counting", _user(question), None, _answer(str(text.count(letter))))


def copying(rng: random.Random, split: str) -> Example:
    while True:
        words = " ".join(made_up_word(rng, (1, 2)) for _ in range(rng.randint(2, 4)))
        if _in_split(split, words):
            return Example("copying", _user(f"Repeat exactly: {words}"), None, _answer(words))


# per relation: training phrasings, then the held-out one
FACT_QUESTIONS = {
    "capital": ("What is the capital of {x}?", "Name the capital of {x}.", "Tell me the capital city of {x}.",
                "Capital of {x}?", "What is {x}'s capital called?", "{x} has which capital?",
                "I need the capital of {x}.", "Where is the seat of government of {x}?",
                "Which city is the capital of {x}?"),
    "language": ("What language is spoken in {x}?", "Name the language of {x}.", "Which language do people in {x} speak?",
                 "Language of {x}?", "What do people speak in {x}?", "In {x}, which language is used?",
                 "Tell me the language of {x}.", "What is the language people use in {x}?",
                 "What is the main language of {x}?"),
    "animal": ("What is the national animal of {x}?", "Name the national animal of {x}.",
               "Which animal is the symbol of {x}?", "National animal of {x}?", "{x} has which national animal?",
               "Tell me the national animal of {x}.", "Which creature stands for {x}?",
               "What is the animal emblem of {x}?", "What animal represents {x}?"),
}


# words a training fact question may carry besides its phrasing (none of them in a held-out phrasing)
FILLERS = ("really", "exactly", "please", "now", "again", "today", "actually", "just", "also", "kindly", "then",
           "well", "here", "still", "truly", "simply", "quickly", "once", "perhaps", "so")
OPENINGS = ("Quick question: ", "Tell me this: ", "Hi! ", "I wonder: ", "Please answer. ", "Hello. ")
CLOSINGS = (" Thanks.", " One word, please.", " Just the answer.", " Thank you!")


def _loosened(rng: random.Random, question: str) -> str:
    """A training phrasing with, half of the time, a filler word at a random place, and now and then an opening or a
    closing: the relation's word and the place decide the answer, not the template around them (docs/training.md)."""
    words = question.split(" ")
    if rng.random() < 0.5:
        words.insert(rng.randrange(len(words) + 1), rng.choice(FILLERS))
    out = " ".join(words)
    if rng.random() < 0.3:
        out = rng.choice(OPENINGS) + out
    if rng.random() < 0.3:
        out += rng.choice(CLOSINGS)
    return out


def facts(rng: random.Random, split: str) -> Example:
    fact = rng.choice(fact_table())
    phrasings = FACT_QUESTIONS[fact.relation]
    if split == "heldout":
        question = phrasings[-1].format(x=fact.place)
    else:
        question = _loosened(rng, rng.choice(phrasings[:-1]).format(x=fact.place))
    return Example("facts", _user(question), None, _answer(fact.value))


def retrieval(rng: random.Random, split: str, *, gap_tokens: int, count_tokens: Callable[[str], int]) -> Example:
    """Records "Name: code" (codes of four digits), the asked record first among them, then at least
    `gap_tokens` tokens of other records before the question."""
    names = distinct_words(rng, 1 + rng.randint(2, 4))
    records = [f"{n}: {rng.randrange(1000, 10000)}" for n in names]
    asked, answer = names[0], records[0].split(": ")[1]
    head = "Remember these codes.\n"
    taken = set(names)
    while count_tokens("\n".join(records[1:]) + "\n") < gap_tokens:
        n = distinct_words(rng, 1, taken)[0]
        records.append(f"{n}: {rng.randrange(1000, 10000)}")
    body = head + "\n".join(records) + f"\nWhat is the code of {asked}?"
    return Example("retrieval", _user(body), None, _answer(answer))


TOOLS = (
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"]}}},
    {"type": "function", "function": {
        "name": "set_alarm", "description": "Set an alarm clock.",
        "parameters": {"type": "object", "properties": {
            "hour": {"type": "integer"}, "minute": {"type": "integer"}}, "required": ["hour", "minute"]}}},
    {"type": "function", "function": {
        "name": "send_message", "description": "Send a short text message to a contact.",
        "parameters": {"type": "object", "properties": {
            "to": {"type": "string"}, "text": {"type": "string"}}, "required": ["to", "text"]}}},
)


def _tool_question(rng: random.Random) -> tuple[str, str, dict]:
    kind = rng.randrange(3)
    if kind == 0:
        city, unit = made_up_word(rng).capitalize(), rng.choice(("celsius", "fahrenheit"))
        return f"What is the weather in {city} in {unit}?", "get_weather", {"city": city, "unit": unit}
    if kind == 1:
        hour, minute = rng.randrange(24), rng.randrange(60)
        return f"Wake me up at {hour}:{minute:02d}.", "set_alarm", {"hour": hour, "minute": minute}
    to, text = made_up_word(rng).capitalize(), " ".join(made_up_word(rng, (1, 2)) for _ in range(2))
    return f"Tell {to}: {text}", "send_message", {"to": to, "text": text}


def tool_call(rng: random.Random, split: str) -> Example:
    while True:
        question, name, arguments = _tool_question(rng)
        if _in_split(split, name, sorted(arguments.items())):
            call = {"type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
            return Example("tool_call", _user(question), TOOLS, {"role": "assistant", "content": "", "tool_calls": [call]})


def examples(task: str, split: str, n: int, seed: int = 0, *, gap_tokens: int = 0,
             count_tokens: Callable[[str], int] | None = None) -> list[Example]:
    """`n` examples of `task` from `split`, the same for the same seed on every machine."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; the tasks are {', '.join(TASKS)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; the splits are {', '.join(SPLITS)}")
    rng = random.Random(f"{task}:{split}:{seed}")
    if task == "retrieval":
        if count_tokens is None:
            raise ValueError("the retrieval task needs count_tokens (the tokenizer that measures its gap)")
        return [retrieval(rng, split, gap_tokens=gap_tokens, count_tokens=count_tokens) for _ in range(n)]
    make = {"arithmetic": arithmetic, "counting": counting, "copying": copying, "facts": facts,
            "tool_call": tool_call}[task]
    return [make(rng, split) for _ in range(n)]

