"""Chat messages -> prompt token ids, with the checkpoint's Jinja chat template when it has one.

Templates come from a downloaded checkpoint, so they run in Jinja's immutable sandbox.
"""

from __future__ import annotations

import functools
from datetime import datetime

from engine.sampling_params import InvalidRequest, describe, is_unicode

# Used when tokenizer_config.json has no chat_template: readable, and clear about whose turn it is.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
ROLES = ("system", "developer", "user", "assistant", "tool")


class TemplateRefused(Exception):
    """raise_exception() called by a template: the messages break its rules."""


def _raise_exception(message):
    raise TemplateRefused(message)


@functools.lru_cache(maxsize=8)
def _compile(source: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def checkpoint_template(tokenizer) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, list):  # several named templates: take the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def normalize_messages(messages) -> list[dict]:
    """OpenAI chat messages -> [{"role", "content": str}]; text parts are joined."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages", "must be a non-empty list of {role, content} objects")
    result = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidRequest(where, "must be an object with role and content")
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise InvalidRequest(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {describe(role)}")
        content = message.get("content")
        if content is None and role != "assistant":  # only an assistant turn may be empty (OpenAI)
            raise InvalidRequest(f"{where}.content", "required: a string or a list of text parts")
        if content is None:
            content = ""
        elif isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise InvalidRequest(f"{where}.content[{j}]",
                                         "only {type: text, text: ...} parts are supported")
                parts.append(part["text"])
            content = "".join(parts)
        elif not isinstance(content, str):
            raise InvalidRequest(f"{where}.content", "must be a string or a list of text parts, "
                                 f"got {type(content).__name__}")
        if not is_unicode(content):
            raise InvalidRequest(f"{where}.content", "not valid Unicode (a lone surrogate)")
        entry = {"role": role, "content": content}
        for key in ("tool_calls", "tool_call_id"):  # tool-use turns, for templates that render them
            if isinstance(message.get(key), (list, str)):
                entry[key] = message[key]
        if isinstance(message.get("name"), str):
            if not is_unicode(message["name"]):
                raise InvalidRequest(f"{where}.name", "not valid Unicode (a lone surrogate)")
            entry["name"] = message["name"]
        result.append(entry)
    return result


def chat_prompt_ids(tokenizer, messages, tools: list | None = None) -> list[int]:
    """Render with the checkpoint's template (or the default) and tokenize."""
    if tokenizer is None:
        raise InvalidRequest("messages", "this model has no tokenizer.json; use /v1/completions "
                             "with token ids")
    messages = normalize_messages(messages)
    template = checkpoint_template(tokenizer)
    try:
        text = _compile(template or DEFAULT_CHAT_TEMPLATE).render(
            messages=messages, tools=tools, add_generation_prompt=True, bos_token=tokenizer.bos_token or "",
            eos_token=tokenizer.eos_token or "")
    except TemplateRefused as e:
        raise InvalidRequest("messages", f"the model's chat template refused them: {e}") from None
    except Exception as e:  # a broken template is the checkpoint's fault, reported all the same
        raise InvalidRequest("messages", f"the chat template failed: {type(e).__name__}: {e}") from None
    # A checkpoint's template writes its own special tokens (BOS); the default one does not.
    return tokenizer.encode(text, add_special_tokens=template is None)
