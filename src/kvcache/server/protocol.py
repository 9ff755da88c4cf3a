"""OpenAI request bodies (the fields kvcache honours), error bodies and ApiError."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator, model_validator

from kvcache.engine.grammar import Constraint
from kvcache.engine.params import MAX_LOGPROBS, SamplingParams
from kvcache.errors import InvalidParams

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
    logit_bias: Optional[dict[str, float]] = None  # OpenAI's: token id (as a string) -> bias in [-100, 100]
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)  # vLLM's: 1 is off
    min_tokens: StrictInt = Field(default=0, ge=0)  # vLLM's: EOS and stop_token_ids held back until then
    stop_token_ids: Optional[list[StrictInt]] = None  # vLLM's
    # structured outputs: OpenAI's response_format, or vLLM's guided_* (one of them)
    response_format: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[dict[str, Any], StrictStr]] = None
    guided_regex: Optional[StrictStr] = None
    guided_choice: Optional[list[StrictStr]] = None
    guided_grammar: Optional[StrictStr] = None
    # speculative decoding: OpenAI's predicted outputs, and prompt lookup (kvcache: proposed tokens per forward;
    # absent: the server's --prompt-lookup; 0: off for this request)
    prediction: Optional[dict[str, Any]] = None
    prompt_lookup: Optional[StrictInt] = Field(default=None, ge=0, le=32)

    def prediction_text(self) -> str | None:
        """The text of ``prediction`` ({"type": "content", "content": text or text parts})."""
        pred = self.prediction
        if pred is None:
            return None
        if pred.get("type") != "content":
            raise ApiError(400, f"prediction.type must be 'content', got {pred.get('type')!r}", param="prediction.type")
        content = pred.get("content")
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                             and isinstance(p.get("text"), str) for p in content):
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(400, "prediction.content must be a string or a list of text parts",
                           param="prediction.content")
        return content

    def sampling(self, default_max: int, constraint: Constraint | None = None,
                 prediction: list[int] | None = None) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        try:
            return SamplingParams(
                max_tokens=self.max_tokens or default_max, temperature=self.temperature, top_p=self.top_p,
                top_k=self.top_k, min_p=self.min_p, seed=self.seed, stop=stop, n=self.n, ignore_eos=self.ignore_eos,
                logprobs=self.logprob_count(), logit_bias=self.logit_bias or {},
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty, min_tokens=self.min_tokens,
                stop_token_ids=tuple(self.stop_token_ids or ()), constraint=constraint or self.constraint(),
                prompt_lookup=self.prompt_lookup, prediction=tuple(prediction or ()))
        except InvalidParams as e:
            raise ApiError(400, str(e), param=_param_of(str(e))) from None

    def constraint_field(self) -> str | None:
        """The parameter that asked for the structured output (None: none did)."""
        for name in ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            value = getattr(self, name, None)
            if value is not None and not (name == "response_format" and value.get("type") == "text"):
                return name
        return None

    def constraint(self) -> Constraint | None:
        """The structured output asked for: at most one of response_format (json_object or
        json_schema) and guided_json / guided_regex / guided_choice / guided_grammar."""
        asked = {k: v for k, v in (("response_format", self._response_format()), ("guided_json", self.guided_json),
                                   ("guided_regex", self.guided_regex), ("guided_choice", self.guided_choice),
                                   ("guided_grammar", self.guided_grammar)) if v is not None}
        if len(asked) > 1:
            raise ApiError(400, f"{' and '.join(asked)} both constrain the output: give one of them",
                           param=list(asked)[1])
        if not asked:
            return None
        (name, value), = asked.items()
        try:
            if name == "response_format":
                return value  # type: ignore[no-any-return]
            if name == "guided_json":
                return Constraint.json_schema(_checked_schema(value, name))
            if name == "guided_regex":
                return Constraint.regex(value)
            if name == "guided_choice":
                return Constraint.choice(value)
            return Constraint.grammar(value)
        except InvalidParams as e:
            raise ApiError(400, f"{name}: {e}", param=name) from None

    def _response_format(self) -> Constraint | None:
        rf = self.response_format
        if rf is None:
            return None
        kind = rf.get("type")
        if kind not in RESPONSE_FORMAT_KEYS:
            raise ApiError(400, f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                           param="response_format.type")
        _only_keys(rf, RESPONSE_FORMAT_KEYS[kind], "response_format", f"with type {kind!r}")
        if kind == "text":
            return None
        if kind == "json_object":
            if "schema" not in rf:
                return Constraint.json_object()
            # llama.cpp's server (and instructor's JSON_SCHEMA mode) put a schema beside json_object
            try:
                return Constraint.json_schema(_checked_schema(rf["schema"], "response_format.schema"))
            except InvalidParams as e:
                raise ApiError(400, f"response_format.schema: {e}", param="response_format.schema") from None
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise ApiError(400, "response_format.json_schema must be an object with a 'schema'",
                           param="response_format.json_schema")
        _only_keys(js, JSON_SCHEMA_KEYS, "response_format.json_schema", "")
        schema = js.get("schema", {})  # OpenAI's default: any JSON
        try:
            return Constraint.json_schema(_checked_schema(schema, "response_format.json_schema.schema"))
        except InvalidParams as e:
            raise ApiError(400, f"response_format.json_schema.schema: {e}",
                           param="response_format.json_schema.schema") from None

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
    tool_calls: Optional[list[dict[str, Any]]] = None  # an assistant's calls (checked in server/tools.py)
    tool_call_id: Optional[StrictStr] = None  # a tool message: the call it answers
    name: Optional[StrictStr] = None
    reasoning_content: Optional[StrictStr] = None  # an assistant's reasoning, given back (server/reasoning.py)

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

    def as_dict(self) -> dict[str, Any]:
        """The message as the chat template and the tool renderer read it."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls is not None:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        if self.reasoning_content is not None and self.role == "assistant":
            out["reasoning_content"] = self.reasoning_content
        return out


# template variables kvcache sets itself, which chat_template_kwargs may not override
RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                                     "pad_token", "unk_token", "raise_exception", "strftime_now"})


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[StrictInt] = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: Optional[StrictInt] = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: Optional[list[Any]] = None  # checked in server/tools.py
    tool_choice: Optional[Union[StrictStr, dict[str, Any]]] = None
    parallel_tool_calls: Optional[StrictBool] = None
    # vLLM's and llama.cpp's: more variables for the chat template ({"enable_thinking": false} for Qwen3)
    chat_template_kwargs: Optional[dict[str, Any]] = None
    # llama.cpp's: "none" leaves a reasoning model's thinking in content; "auto" (or "deepseek") splits it off
    reasoning_format: Optional[Literal["none", "auto", "deepseek"]] = None

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> "ChatRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        """Plain values under names the template does not take from kvcache itself."""
        if v is None:
            return v
        for key, value in v.items():
            if key in RESERVED_TEMPLATE_NAMES:
                raise ValueError(f"chat_template_kwargs: {key!r} is set by kvcache itself (use the request's own fields)")
            if not key.isidentifier():
                raise ValueError(f"chat_template_kwargs: {key!r} is not a template variable name")
            if not isinstance(value, (str, int, float, bool, type(None))):
                raise ValueError(f"chat_template_kwargs: {key!r} must be a string, number, boolean or null")
        return v

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def _checked_schema(schema: Any, where: str) -> Any:
    """A JSON schema the jsonschema library accepts (400 naming the first problem otherwise)."""
    import json

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ApiError(400, f"{where} is not valid JSON: {e.msg} at character {e.pos}", param=where) from None
    if not isinstance(schema, (dict, bool)):
        raise ApiError(400, f"{where} must be a JSON object, got {type(schema).__name__}", param=where)
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except RecursionError:
        raise ApiError(400, f"{where} is nested too deeply", param=where) from None
    except jsonschema.SchemaError as e:
        path = "/".join(str(p) for p in e.path)
        raise ApiError(400, f"{where} is not a valid JSON Schema: {e.message}" + (f" (at {path})" if path else ""),
                       param=where) from None
    return schema


# the keys of response_format kvcache reads, by type; any other is refused by name, never dropped
RESPONSE_FORMAT_KEYS = {"text": ("type",), "json_object": ("type", "schema"), "json_schema": ("type", "json_schema")}
JSON_SCHEMA_KEYS = ("name", "schema", "strict", "description")


def _only_keys(value: dict, allowed: tuple[str, ...], where: str, note: str) -> None:
    extra = [k for k in value if k not in allowed]
    if extra:
        raise ApiError(400, f"{where}.{extra[0]} is not a field of {where}{' ' + note if note else ''} "
                            f"(it has {', '.join(allowed)})", param=f"{where}.{extra[0]}")


def _param_of(message: str) -> str | None:
    """The parameter a SamplingParams error names (its first word), for the error body."""
    word = message.split(" ", 1)[0].rstrip(":")
    return word if word.replace("_", "").isalpha() else None


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached: int,
          prediction: tuple[int, int] | None = None) -> dict[str, Any]:
    """OpenAI's usage; ``prediction``: (accepted, rejected) prediction tokens, when one was sent."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens,
           "prompt_tokens_details": {"cached_tokens": cached}}
    if prediction is not None:
        out["completion_tokens_details"] = {"accepted_prediction_tokens": prediction[0],
                                            "rejected_prediction_tokens": prediction[1]}
    return out
