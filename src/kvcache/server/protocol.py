"""OpenAI request bodies (the fields kvcache honours) and error bodies."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from kvcache.engine.params import SamplingParams

MAX_N = 16


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: Optional[StrictInt] = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: StrictInt = Field(default=1, ge=1, le=MAX_N)
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[StrictInt] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    # kvcache: higher is admitted first under --policy priority; only admin keys may set it
    priority: StrictInt = Field(default=0, ge=-(2**31), le=2**31 - 1)
    ignore_eos: bool = False  # kvcache (vLLM's name): generate max_tokens whatever the model says

    def sampling(self, default_max: int) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(max_tokens=self.max_tokens or default_max, temperature=self.temperature,
                              top_p=self.top_p, seed=self.seed, stop=stop, n=self.n, ignore_eos=self.ignore_eos)


class CompletionRequest(_Common):
    prompt: Union[str, list[str], list[StrictInt], list[list[StrictInt]]]
    max_tokens: Optional[StrictInt] = Field(default=16, ge=1)  # OpenAI's default for completions
    echo: bool = False


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[dict[str, Any]], None] = None

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: keep the text ones
            return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")
        return self.content or ""


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[StrictInt] = Field(default=None, ge=1)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}
