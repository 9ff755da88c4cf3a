"""OpenAI request bodies (the fields kvcache honours), error bodies and ApiError."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

from kvcache.engine.params import MAX_LOGPROBS, SamplingParams

MAX_N = 16


class ApiError(Exception):
    """An OpenAI error reply: HTTP ``status`` and the body ``error_body`` builds."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.body = status, error_body(message, type_, param, code)


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: Optional[StrictInt] = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(default=0, ge=-1)  # vLLM's: 0 or -1 is off
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)  # vLLM's: 0 is off
    n: StrictInt = Field(default=1, ge=1, le=MAX_N)
    stop: Optional[Union[StrictStr, list[StrictStr]]] = None
    seed: Optional[StrictInt] = None
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    # kvcache: higher is admitted first under --policy priority; only admin keys may set it
    priority: StrictInt = Field(default=0, ge=-(2**31), le=2**31 - 1)
    ignore_eos: bool = False  # kvcache (vLLM's name): generate max_tokens whatever the model says

    def sampling(self, default_max: int) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(max_tokens=self.max_tokens or default_max, temperature=self.temperature,
                              top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, seed=self.seed, stop=stop, n=self.n, ignore_eos=self.ignore_eos,
                              logprobs=self.logprob_count())

    def logprob_count(self) -> int | None:
        """How many alternatives per token to report (None: no log-probabilities)."""
        return None


class CompletionRequest(_Common):
    prompt: Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]
    max_tokens: Optional[StrictInt] = Field(default=16, ge=1)  # OpenAI's default for completions
    echo: StrictBool = False
    logprobs: Optional[StrictInt] = Field(default=None, ge=0, le=MAX_LOGPROBS)  # alternatives per token

    def logprob_count(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    """A content part; kvcache reads text parts only."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: StrictStr


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[StrictStr, list[TextPart], None] = None

    @model_validator(mode="before")
    @classmethod
    def _parts(cls, data: Any) -> Any:
        """One clear line for a content part that is not text, or whose text is not a string."""
        parts = data.get("content") if isinstance(data, dict) else None
        if isinstance(parts, list):
            for i, p in enumerate(parts):
                if not isinstance(p, dict) or p.get("type") != "text":
                    kind = p.get("type") if isinstance(p, dict) else type(p).__name__
                    raise ValueError(f"content part {i} is of type {kind!r}; kvcache reads text parts only")
                if not isinstance(p.get("text"), str):
                    raise ValueError(f"content part {i}: 'text' must be a string, got {type(p.get('text')).__name__}")
        return data

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[StrictInt] = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: Optional[StrictInt] = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> "ChatRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


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
