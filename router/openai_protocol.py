"""OpenAI request bodies -> (prompt, SamplingParams), and the response objects back.

Bodies are checked field by field so bad input is always an InvalidRequest naming the field
(HTTP 400), never a crash further in (HTTP 500).
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass, replace

from engine.prompts import check_max_tokens
from engine.sampling_params import InvalidRequest, SamplingParams, describe
from router.backend import ModelInfo
from router.chat_template import chat_prompt_ids, checkpoint_template
from router.tools import ToolPlan, from_extension, from_response_format, tool_plan
from router.serving import Usage

# OpenAI fields and engine extensions (as vLLM spells them) passed to SamplingParams as they are
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "seed", "presence_penalty",
                   "frequency_penalty", "stop", "top_k", "min_p", "repetition_penalty",
                   "stop_token_ids", "ignore_eos", "skip_special_tokens")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_N = 128  # choices per prompt (`n`); each is a request of its own
# field -> values that mean "not used"; anything else is refused rather than silently ignored
UNSUPPORTED = {"best_of": (None, 1), "suffix": (None, ""), "logit_bias": (None, {}), "functions": (None, [])}


class ModelNotFound(Exception):
    """`model` names a model this server does not serve: HTTP 404."""


@dataclass
class ParsedRequest:
    prompt: str | list[int]
    params: SamplingParams
    stream: bool
    include_usage_chunk: bool  # stream_options.include_usage: a last chunk with usage only
    logprobs: int | None  # None: none; n: the chosen token's and the top n
    return_token_ids: bool  # extension: token ids next to the text
    tools: ToolPlan | None = None  # chat with tools: how to constrain and read tool calls
    echo: bool = False  # completions: the prompt before the completion (text and logprobs)
    score_only: bool = False  # completions max_tokens 0 with echo: run one token, return none of it
    prompt_logprobs: int | None = None  # vLLM's extension: the prompt's logprobs in its own shape
    # Where a body asks for several choices (several prompts, `n`), a request each:
    choice_index: int = 0  # its choice's `index` (prompt i's sample j: i * n + j, as vLLM numbers them)
    counts_prompt: bool = True  # its prompt's tokens count in the usage (once a prompt, not once a sample)
    prompt_field: str = "prompt"  # what an error about its prompt names ("prompt[2]" in a batch)


def _structured(body, tools: ToolPlan | None = None) -> dict:
    """SamplingParams.structured_output from response_format, structured_outputs or tool_choice."""
    given = [name for name in ("response_format", "structured_outputs")
             if body.get(name) not in (None, {"type": "text"})]
    forced = tools is not None and tools.mode in ("required", "named")
    if len(given) > 1 or (given and forced):
        raise InvalidRequest(given[-1], "only one of response_format, structured_outputs and a "
                             "required or named tool_choice may constrain the output")
    spec = from_response_format(body.get("response_format")) or from_extension(body.get("structured_outputs"))
    if forced:
        parallel = _flag(body, "parallel_tool_calls") if body.get("parallel_tool_calls") is not None else True
        spec = tools.structured(parallel)
    return {"structured_output": spec} if spec is not None else {}


def _check_common(body, info: ModelInfo) -> None:
    if not isinstance(body, dict):
        raise InvalidRequest("body", f"must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest("model", f"must be a string, got {type(model).__name__}")
    if model is not None and model != info.model_name:
        raise ModelNotFound(f"the model {describe(model)} does not exist; this server serves "
                            f"{info.model_name!r}")
    for name, allowed in UNSUPPORTED.items():
        if body.get(name) not in allowed:
            raise InvalidRequest(name, f"not supported: only {json.dumps(allowed[-1])} is, "
                                 f"got {describe(body.get(name))}")


def _flag(body, name: str, label: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidRequest(label or name, f"must be a boolean, got {type(value).__name__}")
    return value


@contextmanager
def _renamed(names: dict[str, str]):
    """Errors about an engine field name the request field the caller actually sent."""
    try:
        yield
    except InvalidRequest as e:
        if e.field not in names:
            raise
        raise InvalidRequest(names[e.field], e.message) from None


def _sampling(body, **overrides) -> SamplingParams:
    kwargs = {name: body[name] for name in SAMPLING_FIELDS if body.get(name) is not None}
    kwargs.update(overrides)
    return SamplingParams(**kwargs)


def _stream_options(body, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise InvalidRequest("stream_options", f"must be an object, got {type(options).__name__}")
    include_usage = _flag(options, "include_usage", "stream_options.include_usage")
    return stream and include_usage


def completion_prompts(value) -> list[tuple[str, str | list[int]]]:
    """(field, prompt) of each of a completions body's prompts: one (a string or token ids), or
    a batch of them (a list of strings or of token-id lists, as lm-eval's local-completions
    sends with batch_size > 1), each named `prompt[i]` where there are several."""
    if isinstance(value, list) and any(isinstance(p, (str, list)) for p in value):
        fields = [f"prompt[{i}]" for i in range(len(value))] if len(value) > 1 else ["prompt"]
        return [(field, _one_prompt(p, field)) for field, p in zip(fields, value)]
    return [("prompt", _one_prompt(value, "prompt"))]


def _one_prompt(prompt, field: str) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt  # token ids; the front door checks them against the vocabulary
    raise InvalidRequest(field, f"must be a string or a list of token ids, got {describe(prompt, 40)}")


def parse_completion(body, info: ModelInfo) -> list[ParsedRequest]:
    """One ParsedRequest per prompt of the body (a batch answers with a choice per prompt)."""
    _check_common(body, info)
    if "prompt" not in body:
        raise InvalidRequest("prompt", "required")
    prompts = completion_prompts(body["prompt"])
    logprobs = body.get("logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)):
        raise InvalidRequest("logprobs", "must be an integer (how many top tokens to return)")
    stream = _flag(body, "stream")
    echo = _flag(body, "echo")
    score_only = body.get("max_tokens") == 0 and not isinstance(body.get("max_tokens"), bool)
    if score_only:  # scoring the prompt: one token runs (the prefill samples it) and is not returned
        if not echo:
            raise InvalidRequest("max_tokens", "0 returns nothing but the prompt: it needs echo: true")
        body = {**body, "max_tokens": 1}
    defaults = {} if body.get("max_tokens") is not None else {"max_tokens": COMPLETIONS_DEFAULT_MAX_TOKENS}
    if body.get("tools") not in (None, []):
        raise InvalidRequest("tools", "not supported on /v1/completions; use /v1/chat/completions")
    prompt_logprobs = _prompt_logprobs(body)
    scored = [n for n in (logprobs if echo else None, prompt_logprobs) if n is not None]
    params = _sampling(body, logprobs=logprobs, prompt_logprobs=max(scored) if scored else None,
                       **defaults, **_structured(body))
    include_usage, return_token_ids = _stream_options(body, stream), _flag(body, "return_token_ids")
    return _samples([ParsedRequest(prompt, params, stream, include_usage, params.logprobs, return_token_ids,
                                   echo=echo, score_only=score_only, prompt_logprobs=prompt_logprobs,
                                   prompt_field=field)
                     for field, prompt in prompts], _n(body))


def _n(body) -> int:
    value = body.get("n")
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_N:
        raise InvalidRequest("n", f"must be an integer from 1 to {MAX_N}, got {describe(value)}")
    return value


def _samples(requests: list[ParsedRequest], n: int) -> list[ParsedRequest]:
    """`n` requests for each prompt's request: the choice of prompt i's sample j is i * n + j, and a
    seeded body's sample j draws with seed + j (vLLM's rule), so the samples differ and each
    is reproducible alone."""
    out = []
    for i, parsed in enumerate(requests):
        for j in range(n):
            params = parsed.params
            if j and params.seed is not None:
                params = replace(params, seed=(params.seed + j) % 2**63)
            out.append(replace(parsed, params=params, choice_index=i * n + j, counts_prompt=j == 0))
    return out


def _prompt_logprobs(body) -> int | None:
    """vLLM's prompt_logprobs extension: how many top tokens at each prompt position."""
    value = body.get("prompt_logprobs")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise InvalidRequest("prompt_logprobs", "must be an integer (how many top tokens to return)")
    return value


def parse_chat(body, info: ModelInfo, tokenizer) -> list[ParsedRequest]:
    """A ParsedRequest per choice (`n`)."""
    _check_common(body, info)
    max_tokens_name = "max_tokens"
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is not None:
        body, max_tokens_name = {**body, "max_tokens": body["max_completion_tokens"]}, "max_completion_tokens"
    tools = tool_plan(body.get("tools"), body.get("tool_choice"), checkpoint_template(tokenizer))
    ids = chat_prompt_ids(tokenizer, body.get("messages"), body.get("tools") or None)
    if len(ids) >= info.max_model_len:
        raise InvalidRequest("messages", f"{len(ids)} tokens once templated; the context holds "
                             f"{info.max_model_len} and at least one must be generated")
    logprobs = None
    if _flag(body, "logprobs"):
        logprobs = 0 if body.get("top_logprobs") is None else body["top_logprobs"]
    elif body.get("top_logprobs") is not None:
        raise InvalidRequest("top_logprobs", "needs logprobs: true")
    stream = _flag(body, "stream")
    # No max_tokens: up to the end of the context, as OpenAI does.
    defaults = {} if body.get("max_tokens") is not None else {"max_tokens": info.max_model_len - len(ids)}
    prompt_logprobs = _prompt_logprobs(body)
    with _renamed({"max_tokens": max_tokens_name, "logprobs": "top_logprobs"}):
        params = _sampling(body, logprobs=logprobs, prompt_logprobs=prompt_logprobs, **defaults,
                           **_structured(body, tools))
        check_max_tokens(len(ids), params.max_tokens, info.max_model_len)
    return _samples([ParsedRequest(ids, params, stream, _stream_options(body, stream), params.logprobs,
                                   _flag(body, "return_token_ids"), tools, prompt_logprobs=prompt_logprobs,
                                   prompt_field="messages")], _n(body))


# ---------------------------------------------------------------- responses

def usage_dict(usage: Usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def token_text(tokenizer, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict | None], offset: int = 0) -> dict:
    """The legacy completions shape: parallel lists, one entry per token (None for the first
    token of an echoed prompt, which follows nothing)."""
    tokens, values, tops, offsets = [], [], [], []
    for token_id, lp in zip(token_ids, logprobs):
        text = token_text(tokenizer, token_id)
        tokens.append(text)
        values.append(lp["token"] if lp is not None else None)
        tops.append({token_text(tokenizer, t): v for t, v in lp.get("top", [])} if lp is not None else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def vllm_prompt_logprobs(tokenizer, prompt_ids: list[int], entries: list[dict | None]) -> list[dict | None]:
    """vLLM's prompt_logprobs shape: per prompt token None (the first) or {token id: {logprob,
    rank, decoded_token}} for the prompt's own token and the top n there."""
    out = []
    for token_id, lp in zip(prompt_ids, entries):
        if lp is None:
            out.append(None)
            continue
        ranked = {token_id: (lp["token"], lp["rank"])}
        for rank, (t, v) in enumerate(lp.get("top", []), start=1):
            ranked.setdefault(t, (v, rank))
        out.append({str(t): {"logprob": v, "rank": r, "decoded_token": token_text(tokenizer, t)}
                    for t, (v, r) in ranked.items()})
    return out


def chat_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict]) -> dict:
    def entry(token_id, value):
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

    content = [{**entry(t, lp["token"]), "top_logprobs": [entry(i, v) for i, v in lp.get("top", [])]}
               for t, lp in zip(token_ids, logprobs)]
    return {"content": content, "refusal": None}

