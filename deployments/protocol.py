"""OpenAI chat-completions wire format: request validation, responses, streaming chunks.

Pure Python (no Ray, no torch) so it is unit-tested directly. Bad input raises
:class:`APIError`, which the HTTP layer turns into OpenAI's error JSON with a 4xx status.
"""

from __future__ import annotations

import collections
import re
import threading
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from toolspec_core.drafters.toolcall.parse import ParsedOutput, ToolCall, parse_tool_calls
from toolspec_core.engine.limits import requested_tokens
from toolspec_core.errors import InvalidRequestError

# ---------------------------------------------------------------------------------------- errors


class APIError(Exception):
    """An error the client caused (or a server condition) in OpenAI's shape."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def from_body(cls, body: dict, status: int) -> "APIError":
        e = body.get("error", {})
        return cls(
            e.get("message", "error"), status, e.get("type", "invalid_request_error"), e.get("param"), e.get("code")
        )


_TYPE_TAGS = {
    "str",
    "int",
    "float",
    "bool",
    "none",
    "dict",
    "list",
    "is-instance",
    "constrained-float",
    "constrained-int",
}


def _loc(loc: tuple) -> str:
    """pydantic's error location as OpenAI's ``param`` (``messages[0].role``), minus the union
    branch tags pydantic inserts (``float``, ``literal[...]``, model class names)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        p = str(part)
        if p in _TYPE_TAGS or "[" in p or p[:1].isupper():
            continue
        out += ("." if out else "") + p
    return out


def request_error(exc: InvalidRequestError) -> APIError:
    """The OpenAI 400 of a refusal from the engine's checks: its message, parameter and code as they are."""
    return APIError(str(exc), 400, param=exc.param, code=exc.code)


def validation_error(exc: ValidationError) -> APIError:
    err = exc.errors()[0]
    param = _loc(err["loc"]) or None
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        msg = f"Unrecognized request argument supplied: {param}"
    else:
        msg = f"Invalid value for '{param}': {msg}" if param else msg
    return APIError(
        msg, 400, param=param, code="invalid_value" if err["type"] != "missing" else "missing_required_parameter"
    )


# ---------------------------------------------------------------------------------------- request

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class FunctionDef(_Strict):
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: StrictStr


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    name: StrictStr
    arguments: StrictStr | dict[str, Any] = "{}"


class AssistantToolCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # e.g. "refusal", "audio": ignored
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[dict[str, Any]] | None = None
    name: StrictStr | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: StrictStr | None = None


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class ToolSpecOptions(_Strict):
    remember: StrictBool = True  # False: this request's calls are never stored in the library
    # True: the response's ``toolspec`` field carries the request's ``timeline`` (wall-clock marks
    # of its way through the server) and ``early_steps`` (its first engine steps), ~3 KB
    timeline: StrictBool = False


Number = StrictFloat | StrictInt


class ChatRequest(_Strict):
    """The fields of OpenAI's chat-completions request we accept (unknown fields are rejected)."""

    model: StrictStr | None = None
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    temperature: Number | None = Field(None, ge=0, le=2)
    top_p: Number | None = Field(None, gt=0, le=1)
    top_k: StrictInt | None = Field(None, ge=0)  # vLLM-style extension
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    n: StrictInt = Field(1, ge=1, le=1)
    toolspec: ToolSpecOptions | None = None
    # accepted for compatibility, no effect on a greedy/sampled single choice:
    frequency_penalty: Number | None = Field(None, ge=-2, le=2)
    presence_penalty: Number | None = Field(None, ge=-2, le=2)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    store: StrictBool | None = None
    service_tier: StrictStr | None = None


def _check_json_schema(schema: dict, param: str, limits: Any = None) -> None:
    """A function's ``parameters`` must be a JSON-schema object (OpenAI requires type object)."""
    if schema.get("type", "object") != "object":
        raise APIError(
            f"Invalid schema for function parameters: top-level type must be 'object', got {schema.get('type')!r}",
            param=param,
            code="invalid_function_parameters",
        )
    props = schema.get("properties", {})
    if not isinstance(props, dict) or any(not isinstance(v, dict) for v in props.values()):
        raise APIError(
            "Invalid schema for function parameters: 'properties' must map names to schemas",
            param=param,
            code="invalid_function_parameters",
        )
    req = schema.get("required", [])
    if not isinstance(req, list) or any(not isinstance(r, str) for r in req):
        raise APIError(
            "Invalid schema for function parameters: 'required' must be a list of strings",
            param=param,
            code="invalid_function_parameters",
        )
    missing = [r for r in req if "properties" in schema and r not in props]
    if missing:
        raise APIError(
            f"Invalid schema for function parameters: required {missing} not in properties",
            param=param,
            code="invalid_function_parameters",
        )
    _check_schema(schema, param, "Invalid schema for function parameters", "invalid_function_parameters", limits)


def schema_size(schema, max_depth: int, max_nodes: int) -> tuple[int, int]:
    """(deepest nesting, number of JSON values) of a decoded JSON value, walked without recursion
    and stopped as soon as either passes its limit."""
    depth, nodes, stack = 0, 0, [(schema, 1)]
    while stack:
        node, d = stack.pop()
        nodes += 1
        depth = max(depth, d)
        if nodes > max_nodes or depth > max_depth:
            break
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((c, d + 1) for c in children)
    return depth, nodes


def _check_schema(schema: dict, param: str, what: str, code: str = "invalid_value", limits: Any = None) -> None:
    """A valid JSON schema (draft 2020-12) within the size limits, or a 400 saying what is wrong.
    The size is checked first, iteratively, so no schema reaches a recursive validator too deep."""
    from .config import RequestLimits

    limits = limits or RequestLimits()
    depth, nodes = schema_size(schema, limits.schema_depth, limits.schema_nodes)
    if depth > limits.schema_depth or nodes > limits.schema_nodes:
        raise APIError(
            f"{what}: the schema nests deeper than {limits.schema_depth} levels (limits.schema_depth) "
            f"or has more than {limits.schema_nodes} values (limits.schema_nodes)",
            param=param,
            code="schema_too_large",
        )
    problem = schema_problem(schema)
    if problem is not None:
        raise APIError(f"{what}: {problem}", param=param, code=code)


def schema_problem(schema: dict) -> str | None:
    """Why ``schema`` is not a valid JSON schema (draft 2020-12), None when it is. Checking a
    schema against the metaschema costs about a millisecond a tool (1.13 ms a dev-set schema, and
    no less with one validator reused: jsonschema resolves the metaschema's dynamic references at
    every level; ``benchmarks/results/measurements/schema-check-cpu-epyc-fe07c4d.json``), on the request's way to its first token.
    Most tools' schemas use a handful of keywords whose rules are simple: :func:`plainly_valid`
    accepts those in one walk. Any other goes to the metaschema check, whose answer is kept per
    schema, keyed by a digest of its JSON text (the text holds every key, value and order the
    check reads; an agent sends the same tools with every request). A schema no JSON text can
    hold is checked as it is."""
    import hashlib
    import json

    if plainly_valid(schema):
        return None
    try:
        text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        return _schema_problem(schema)
    key = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=32).digest()
    with _SCHEMA_LOCK:
        if key in _SCHEMA_CHECKS:
            _SCHEMA_CHECKS.move_to_end(key)
            return _SCHEMA_CHECKS[key]
    problem = _schema_problem(schema)
    with _SCHEMA_LOCK:
        _SCHEMA_CHECKS[key] = problem
        while len(_SCHEMA_CHECKS) > SCHEMA_CHECKS_KEPT:
            _SCHEMA_CHECKS.popitem(last=False)
    return problem


# JSON Schema 2020-12's simple types, and the keywords its metaschema gives rules (every vocabulary,
# and the deprecated ones it still describes): any other keyword may hold any value
SIMPLE_TYPES = frozenset({"array", "boolean", "integer", "null", "number", "object", "string"})
METASCHEMA_KEYWORDS = frozenset(
    "$id $schema $ref $anchor $dynamicRef $dynamicAnchor $vocabulary $comment $defs prefixItems items contains "
    "additionalProperties properties patternProperties dependentSchemas propertyNames if then else allOf anyOf "
    "oneOf not unevaluatedItems unevaluatedProperties type const enum multipleOf maximum exclusiveMaximum minimum "
    "exclusiveMinimum maxLength minLength pattern maxItems minItems uniqueItems maxContains minContains "
    "maxProperties minProperties required dependentRequired title description default deprecated readOnly "
    "writeOnly examples format contentEncoding contentMediaType contentSchema definitions dependencies "
    "$recursiveAnchor $recursiveRef".split()
)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _count(v) -> bool:  # nonNegativeInteger, as a Python int (a float such as 2.0 goes to the full check)
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _strings(v) -> bool:  # stringArray: unique strings
    return isinstance(v, list) and all(isinstance(x, str) for x in v) and len(set(v)) == len(v)


def _type(v) -> bool:
    if isinstance(v, str):
        return v in SIMPLE_TYPES
    return (
        isinstance(v, list)
        and bool(v)
        and all(isinstance(x, str) and x in SIMPLE_TYPES for x in v)
        and len(set(v)) == len(v)
    )


# keyword -> (rule for its value, how its value holds subschemas: None, "one", "map", "list")
_PLAIN_RULES = {
    "type": (_type, None),
    "properties": (lambda v: isinstance(v, dict), "map"),
    "items": (lambda v: isinstance(v, (dict, bool)), "one"),
    "additionalProperties": (lambda v: isinstance(v, (dict, bool)), "one"),
    "anyOf": (lambda v: isinstance(v, list) and bool(v), "list"),
    "oneOf": (lambda v: isinstance(v, list) and bool(v), "list"),
    "allOf": (lambda v: isinstance(v, list) and bool(v), "list"),
    "required": (_strings, None),
    "enum": (lambda v: isinstance(v, list), None),
    "const": (lambda v: True, None),
    "default": (lambda v: True, None),
    "examples": (lambda v: isinstance(v, list), None),
    "title": (lambda v: isinstance(v, str), None),
    "description": (lambda v: isinstance(v, str), None),
    "format": (lambda v: isinstance(v, str), None),
    "$comment": (lambda v: isinstance(v, str), None),
    "deprecated": (lambda v: isinstance(v, bool), None),
    "readOnly": (lambda v: isinstance(v, bool), None),
    "writeOnly": (lambda v: isinstance(v, bool), None),
    "uniqueItems": (lambda v: isinstance(v, bool), None),
    "minimum": (_number, None),
    "maximum": (_number, None),
    "exclusiveMinimum": (_number, None),
    "exclusiveMaximum": (_number, None),
    "multipleOf": (lambda v: _number(v) and v > 0, None),
    **{k: (_count, None) for k in ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")},
}


def plainly_valid(schema) -> bool:
    """True when ``schema`` is a valid JSON schema (draft 2020-12) by simple rules alone: every
    keyword the metaschema gives rules is one of the common ones in ``_PLAIN_RULES`` (types,
    properties, items, required, enum, bounds, annotations, anyOf / oneOf / allOf) with a value
    its rule accepts, and every subschema is so too; other keywords may hold anything, as the
    metaschema allows. False means only "not shown here": the metaschema check decides (a
    ``pattern``, a ``$ref``, a float count, a bad value...). Walked without recursion; a schema
    past the size limits was refused before."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict):
            return False
        for key, value in node.items():
            rule = _PLAIN_RULES.get(key)
            if rule is None:
                if key in METASCHEMA_KEYWORDS:
                    return False
                continue
            ok, holds = rule
            if not ok(value):
                return False
            if holds == "one":
                stack.append(value)
            elif holds == "map":
                stack.extend(value.values())
            elif holds == "list":
                stack.extend(value)
    return True


SCHEMA_CHECKS_KEPT = 4096  # schemas whose check is kept (32-byte keys; the least recently used goes)
_SCHEMA_CHECKS: collections.OrderedDict[bytes, str | None] = collections.OrderedDict()
_SCHEMA_LOCK = threading.Lock()


def _schema_problem(schema: dict) -> str | None:
    try:
        from jsonschema import Draft202012Validator
        from jsonschema.exceptions import SchemaError
    except ImportError:
        return None
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        return exc.message
    return None


def parse_request(body: Any, served_model: str, max_tokens_limit: int, limits: Any = None) -> ChatRequest:
    """Validate a decoded JSON body; raises :class:`APIError` (4xx) for anything malformed or over
    ``limits`` (a ``RequestLimits``; None: its defaults)."""
    from .config import RequestLimits

    limits = limits or RequestLimits()
    if not isinstance(body, dict):
        raise APIError("The request body must be a JSON object.", code="invalid_json")
    try:
        req = ChatRequest.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None
    if req.model not in (None, "", served_model):
        raise APIError(f"The model '{req.model}' does not exist", 404, param="model", code="model_not_found")
    for field, n, most in (
        ("messages", len(req.messages), limits.messages),
        ("tools", len(req.tools or []), limits.tools),
    ):
        if n > most:
            raise APIError(
                f"Invalid '{field}': {n} given, this server takes at most {most} (limits.{field})",
                param=field,
                code="too_many_" + field,
            )
    for i, m in enumerate(req.messages):
        for j, part in enumerate(m.content if isinstance(m.content, list) else []):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(
                    f"Invalid 'messages[{i}].content[{j}]': only text parts ({{'type': 'text', 'text': str}}) are supported",
                    param=f"messages[{i}].content[{j}]",
                    code="invalid_value",
                )
    names: list[str] = []
    for i, tool in enumerate(req.tools or []):
        name = tool.function.name
        if not _NAME.match(name):
            raise APIError(
                f"Invalid 'tools[{i}].function.name': must match ^[a-zA-Z0-9_-]{{1,64}}$",
                param=f"tools[{i}].function.name",
                code="invalid_value",
            )
        if name in names:
            raise APIError(f"Duplicate tool name {name!r}", param=f"tools[{i}].function.name", code="invalid_value")
        names.append(name)
        if tool.function.parameters is not None:
            _check_json_schema(tool.function.parameters, f"tools[{i}].function.parameters", limits)
    choice = req.tool_choice
    if choice is not None and choice not in ("none", "auto") and not names:
        raise APIError("tool_choice requires tools to be specified", param="tool_choice", code="invalid_value")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise APIError(
            f"tool_choice names function {choice.function.name!r}, which is not in tools",
            param="tool_choice",
            code="invalid_value",
        )
    try:  # the range of the asked output length: toolspec_core.engine.limits owns every token limit
        requested_tokens(req.max_tokens, req.max_completion_tokens, max_tokens_limit)
    except InvalidRequestError as exc:
        raise request_error(exc) from None
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > limits.stop or any(not s for s in stops):
        raise APIError(
            f"'stop' takes up to {limits.stop} non-empty strings (limits.stop)", param="stop", code="invalid_value"
        )
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(
            "Invalid 'top_logprobs': 'logprobs' must be set to true when 'top_logprobs' is used",
            param="top_logprobs",
            code="invalid_value",
        )
    response_schema(req, limits)  # validated here, read again (unchecked) by the job
    return req


def response_schema(req: ChatRequest, limits: Any = None, check: bool = True) -> dict | None:
    """The JSON schema ``response_format`` asks the answer to follow (``json_object``: any object;
    None for text); raises :class:`APIError` for a malformed one (``check``: its schema too)."""
    rf = req.response_format
    if rf is None:
        return None
    kind = rf.get("type")
    extra = set(rf) - {"type", "json_schema"}
    if kind == "text" and not extra and "json_schema" not in rf:
        return None
    if kind == "json_object" and not extra and "json_schema" not in rf:
        return {"type": "object"}
    if kind != "json_schema" or extra:
        raise APIError(
            f"Invalid 'response_format': type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
            param="response_format",
            code="invalid_value",
        )
    js = rf.get("json_schema")
    param = "response_format.json_schema"
    if not isinstance(js, dict) or set(js) - {"name", "description", "schema", "strict"}:
        raise APIError(
            "Invalid 'response_format.json_schema': an object with name, description, schema, strict",
            param=param,
            code="invalid_value",
        )
    if not isinstance(js.get("name"), str) or not _NAME.match(js["name"]):
        raise APIError(
            "Invalid 'response_format.json_schema.name': must match ^[a-zA-Z0-9_-]{1,64}$",
            param=param + ".name",
            code="invalid_value",
        )
    if not isinstance(js.get("strict", False), bool) or not isinstance(js.get("description", ""), str):
        raise APIError("Invalid 'response_format.json_schema': wrong types", param=param, code="invalid_value")
    schema = js.get("schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise APIError("Invalid 'response_format.json_schema.schema': must be an object", param=param + ".schema")
    if check:
        _check_schema(schema, param + ".schema", "Invalid JSON schema for response_format", limits=limits)
    return schema


def chosen_tool(req: ChatRequest) -> str | dict:
    """The request's ``tool_choice`` as the engine reads it: "none" | "auto" | "required" |
    ``{"type": "function", "function": {"name": ...}}``; unset: "auto" with tools, else "none"."""
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice):
        return {"type": "function", "function": {"name": choice.function.name}}
    if choice is None:
        return "auto" if req.tools else "none"
    return choice


def offers_tools(req: ChatRequest) -> bool:
    """Whether the model is shown the request's tools (not with ``tool_choice`` "none")."""
    return bool(req.tools) and chosen_tool(req) != "none"


def stop_strings(req: ChatRequest) -> tuple[str, ...]:
    return (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())


TAGS = "tags"  # parse mode: only <tool_call> blocks are calls (the answer is structured JSON)


def parse_mode(req: ChatRequest) -> bool | str:
    """Whether calls are parsed from the output: False, True (every layout), or :data:`TAGS` when
    a structured answer is the other choice (a JSON answer is not a bare call)."""
    if not offers_tools(req):
        return False
    if chosen_tool(req) == "auto" and response_schema(req, check=False) is not None:
        return TAGS
    return True


# ---------------------------------------------------------------------------------------- responses


def completion_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex[:24]


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def tool_call_dict(call: ToolCall, cid: str | None = None) -> dict:
    return {
        "id": cid or call_id(),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments_json()},
    }


def split_output(text: str, parse: bool | str) -> ParsedOutput:
    """Content and calls of a response (``parse``: :func:`parse_mode`); a call cut off by the
    token limit or a stop string is reported with the arguments written so far, as OpenAI does."""
    if not parse:
        return ParsedOutput(text, [])
    return parse_tool_calls(text, partial=True, tags_only=parse == TAGS)


def finish_reason(engine_reason: str, has_calls: bool) -> str:
    if engine_reason == "length":
        return "length"
    return "tool_calls" if has_calls else "stop"


def stats_extra(stats: dict, extra: dict | None = None) -> dict:
    """The ``toolspec`` field: MAT, drafted/accepted tokens, per-state acceptance, timings."""
    drafted, accepted = stats.get("label_drafted", {}), stats.get("label_accepted", {})
    per_state = {
        lab: {"drafted": n, "accepted": accepted.get(lab, 0), "rate": accepted.get(lab, 0) / n if n else 0.0}
        for lab, n in sorted(drafted.items())
    }
    out = {
        "mat": stats.get("mat", 1.0),
        "drafted_tokens": stats.get("drafted_tokens", 0),
        "accepted_tokens": stats.get("accepted_tokens", 0),
        "forwards": stats.get("forwards", 0),
        "forced_tokens": stats.get("forced_tokens", 0),  # emitted by the tool_choice grammar, unverified
        "acceptance": per_state,
        "prefill_s": stats.get("prefill_s", 0.0),
        "decode_s": stats.get("decode_s", 0.0),
    }
    out.update(extra or {})
    return out


def usage(result) -> dict:
    """OpenAI's usage object of a finished request (a ``Done`` event); ``cached_tokens``: prompt
    tokens whose KV came from the prefix cache."""
    p, c = result.prompt_tokens, result.completion_tokens
    cached = (result.extra or {}).get("prefix_cached_tokens", 0)
    return {
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": p + c,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def choice_logprobs(entries: list | None) -> dict | None:
    """OpenAI's ``choices[].logprobs``: every output token's entry (a call's tokens too)."""
    return None if entries is None else {"content": entries, "refusal": None}


def chat_completion(result, parse: bool, model: str, cid: str | None = None, created: int | None = None) -> dict:
    """A full (non-streaming) response from the finished request (a ``Done`` event)."""
    parsed = split_output(result.text, parse)
    message: dict[str, Any] = {
        "role": "assistant",
        "content": parsed.content if parsed.calls else (parsed.content or ""),
    }
    if parsed.calls:
        message["tool_calls"] = [tool_call_dict(c) for c in parsed.calls]
    return {
        "id": cid or completion_id(),
        "object": "chat.completion",
        "created": created or int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": choice_logprobs(result.logprobs),
                "finish_reason": finish_reason(result.finish_reason, bool(parsed.calls)),
            }
        ],
        "usage": usage(result),
        "toolspec": stats_extra(result.stats, result.extra),
    }
