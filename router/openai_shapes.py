"""How the OpenAI endpoints write an answer: a whole response's choices, or stream chunks, from
the generation events of router.serving (Delta, Final). One shape per request: a body that asks
for several choices (several prompts, `n`) runs a request per choice, each shape writing its
choice under its index."""

from __future__ import annotations

import time

from router import openai_protocol as oa
from router.serving import Delta, Final


class _Shape:
    """How one endpoint writes its answer: whole, or as stream chunks."""

    def __init__(self, parsed: oa.ParsedRequest, tokenizer):
        self.parsed, self.tokenizer = parsed, tokenizer
        self.index = parsed.choice_index
        self.created = int(time.time())

    def first_chunk_choice(self) -> dict | None:
        return None

    def usage(self, final: Final) -> dict:
        return oa.usage_dict(final.usage)

    def response_fields(self, final: Final) -> dict:
        """Fields of the whole response beside its choices."""
        return {}

    def streamed(self, delta: Delta) -> dict | None:
        """The choice a Delta streams; None while there is nothing to show (text held back, or
        buffered)."""
        piece = self.chunk(delta)
        if piece is not None and (delta.text or piece.get("text") or self.parsed.return_token_ids
                                  or self.parsed.logprobs is not None):
            return piece
        return None


class CompletionShape(_Shape):
    object_name, chunk_object_name, id_prefix = "text_completion", "text_completion", "cmpl"

    def __init__(self, parsed: oa.ParsedRequest, tokenizer):
        super().__init__(parsed, tokenizer)
        self.text_offset = 0
        self.echoed = False

    def _logprobs(self, token_ids, logprobs):
        if self.parsed.logprobs is None:
            return None
        out = oa.completion_logprobs(self.tokenizer, token_ids, logprobs, self.text_offset)
        self.text_offset += sum(len(t) for t in out["tokens"])
        return out

    def _choice(self, text, token_ids, logprobs, finish_reason, prompt=None) -> dict:
        """prompt: (ids, entries) of the prompt, echoed before the completion (text and logprobs)."""
        if self.parsed.score_only:  # max_tokens 0: the one token that ran is not the caller's
            text, token_ids, logprobs = "", [], []
        prompt_field = None
        if prompt is not None:
            ids, entries = prompt
            if self.parsed.echo:
                text = self._prompt_text(ids) + text
                token_ids, logprobs = list(ids) + list(token_ids), list(entries or [None] * len(ids)) + list(logprobs)
            if self.parsed.prompt_logprobs is not None and entries is not None:
                prompt_field = oa.vllm_prompt_logprobs(self.tokenizer, ids, entries)
        choice = {"index": self.index, "text": text, "logprobs": self._logprobs(token_ids, logprobs),
                  "finish_reason": finish_reason}
        if self.parsed.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_field
        if self.parsed.return_token_ids:
            choice["token_ids"] = token_ids
        return choice

    def _prompt_text(self, ids: list[int]) -> str:
        if isinstance(self.parsed.prompt, str):
            return self.parsed.prompt
        return self.tokenizer.decode(ids, skip_special_tokens=False) if self.tokenizer is not None else ""

    def _prompt_once(self, ids, entries):
        if self.echoed or not (self.parsed.echo or self.parsed.prompt_logprobs is not None):
            return None
        self.echoed = True
        return ids, entries

    def full(self, final: Final) -> dict:
        return self._choice(final.text, final.token_ids, final.logprobs,
                            "length" if self.parsed.score_only else final.finish_reason,
                            self._prompt_once(final.prompt_token_ids, final.prompt_logprobs))

    def chunk(self, delta: Delta) -> dict:
        ids = delta.prompt_token_ids
        if ids is None:  # no prompt logprobs asked for: the ids as sent (a text prompt echoes as sent)
            ids = self.parsed.prompt if isinstance(self.parsed.prompt, list) else []
        return self._choice(delta.text, delta.token_ids, delta.logprobs, None,
                            self._prompt_once(ids, delta.prompt_logprobs))

    def usage(self, final: Final) -> dict:
        usage = oa.usage_dict(final.usage)
        if self.parsed.score_only:
            usage.update(completion_tokens=0, total_tokens=usage["prompt_tokens"])
        return usage

    def last_chunk(self, final: Final) -> dict:
        return self._choice("", [], [], final.finish_reason)


class ChatShape(_Shape):
    object_name, chunk_object_name, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def _choice(self, key, content, token_ids, logprobs, finish_reason) -> dict:
        message = {"role": "assistant", "content": content} if key == "message" else (
            {"content": content} if content or token_ids else {})
        lp = oa.chat_logprobs(self.tokenizer, token_ids, logprobs) if (
            self.parsed.logprobs is not None and token_ids) else None
        choice = {"index": self.index, key: message, "logprobs": lp, "finish_reason": finish_reason}
        if self.parsed.return_token_ids:
            choice["token_ids"] = token_ids
        return choice

    def first_chunk_choice(self) -> dict:
        return {"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    @property
    def buffered(self) -> bool:
        """With tools in play the text is only read for tool calls once whole: one last chunk."""
        return self.parsed.tools is not None and self.parsed.tools.mode != "none"

    def _with_tool_calls(self, key, final: Final, token_ids, logprobs) -> dict:
        calls, content = [], final.text
        if self.parsed.tools is not None and final.finish_reason == "stop":
            calls, content = self.parsed.tools.calls(final.text)
        if not calls:
            return self._choice(key, final.text, token_ids, logprobs, final.finish_reason)
        choice = self._choice(key, content, token_ids, logprobs, "tool_calls")
        choice[key]["tool_calls"] = [dict(c, index=i) if key == "delta" else c for i, c in enumerate(calls)]
        if key == "delta" and content is None:
            choice[key].pop("content", None)
        return choice

    def full(self, final: Final) -> dict:
        return self._with_tool_calls("message", final, final.token_ids, final.logprobs)

    def response_fields(self, final: Final) -> dict:
        if self.parsed.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": oa.vllm_prompt_logprobs(self.tokenizer, final.prompt_token_ids,
                                                            final.prompt_logprobs or [])}

    def chunk(self, delta: Delta) -> dict | None:
        if self.buffered:
            return None
        return self._choice("delta", delta.text, delta.token_ids, delta.logprobs, None)

    def last_chunk(self, final: Final) -> dict:
        if self.buffered:
            return self._with_tool_calls("delta", final, final.token_ids, final.logprobs)
        return self._choice("delta", "", [], [], final.finish_reason)
