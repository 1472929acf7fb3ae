"""What every route handler shares: the engine bridge, tokenizer, metrics, the served name, limits.

Must not know HTTP framing (serve/app.py) or response formats (serve/wire.py).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from lib.text.chat_encoding import encode_messages
from lib.text.tokenizer import Tokenizer
from serve.async_engine import AsyncEngine, RequestHandle
from serve.errors import BadRequest, NotFound
from serve.metrics import ServerMetrics
from serve.wire import TokenText


@dataclass
class ServerContext:
    engine: AsyncEngine
    tokenizer: Tokenizer
    metrics: ServerMetrics
    model_name: str
    max_model_len: int
    vocab_size: int
    defaults: dict = field(default_factory=dict)     # generation_config.json sampling defaults + vocab_size
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    text: TokenText = None

    def __post_init__(self):
        self.text = TokenText(self.tokenizer)
        self.defaults = {**self.defaults, "vocab_size": self.vocab_size}

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise NotFound(f"The model `{name}` does not exist; this server serves `{self.model_name}`",
                           param="model")

    def encode_text(self, text: str, where: str = "prompt") -> list[int]:
        if not text:
            raise BadRequest(f"{where} is empty: at least one token is needed", param=where)
        return self.tokenizer.encode(text)

    def encode_chat(self, messages: list, *, thinking: bool, tools=None, reasoning_effort=None,
                    add_generation_prompt: bool = True) -> list[int]:
        """The V4 chat encoding (DSV4-REFERENCE §6) of OpenAI messages, as token ids."""
        if not messages:
            raise BadRequest("messages is empty: at least one message is needed", param="messages")
        try:
            text = encode_messages(messages, thinking=thinking, tools=tools, reasoning_effort=reasoning_effort,
                                   add_generation_prompt=add_generation_prompt)
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise BadRequest(f"messages: {err}", param="messages") from None
        return self.tokenizer.encode(text)

    def default_max_tokens(self, prompt_len: int) -> int:
        """No max_tokens given: whatever the context leaves (at least 1, so an overlong prompt still
        gets the engine's length error naming both numbers)."""
        return max(self.max_model_len - prompt_len, 1)

    async def submit_all(self, prompts: list[list[int]], params_list: list) -> list[RequestHandle]:
        """Submit every prompt; if one is refused, the ones already in are aborted."""
        handles = []
        try:
            for prompt, params in zip(prompts, params_list):
                handles.append(await self.engine.submit(prompt, params))
                self.metrics.on_submit(len(prompt))
        except ValueError as err:
            for h in handles:
                h.abort()
            raise BadRequest(str(err)) from None
        except BaseException:
            for h in handles:
                h.abort()
            raise
        return handles


def generation_defaults(model_dir: Path) -> dict:
    """temperature / top_p from the checkpoint's generation_config.json (OpenAI's default is 1.0)."""
    file = Path(model_dir) / "generation_config.json"
    if not file.is_file():
        return {}
    config = json.loads(file.read_text(encoding="utf-8"))
    return {k: float(config[k]) for k in ("temperature", "top_p") if isinstance(config.get(k), (int, float))}
