"""Generations answered as one: a body that asks for several choices (a completions batch of
prompts, `n` samples of each) runs a request per choice, all at once.

Each request's events (router.serving: Deltas, then a Final) are merged as they come, tagged
with the request's index. An error in any of them ends the whole (the first error is raised),
and closing the merge closes every request's stream, which aborts what still runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing

from engine.sampling_params import InvalidRequest
from router.serving import Final

_ENDED = object()


async def merge_streams(streams: list[AsyncIterator], prompt_fields: list[str]) -> AsyncIterator[tuple[int, object]]:
    """(index, event) from each stream as it comes, until every stream has ended. An
    InvalidRequest about `prompt` in stream i is raised naming prompt_fields[i] instead. A lone
    stream is passed through as it is (no task, no queue: most bodies ask for one choice)."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as stream:
            try:
                async for event in stream:
                    yield 0, event
            except InvalidRequest as e:
                raise _naming_the_prompt(e, prompt_fields[0]) from None
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator) -> None:
        try:
            async with aclosing(stream):
                async for event in stream:
                    await queue.put((index, event))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            await queue.put((index, e))
        else:
            await queue.put((index, _ENDED))

    pumps = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        running = len(pumps)
        while running:
            index, event = await queue.get()
            if isinstance(event, Exception):
                raise _naming_the_prompt(event, prompt_fields[index])
            if event is _ENDED:
                running -= 1
                continue
            yield index, event
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


def _naming_the_prompt(error: Exception, field: str) -> Exception:
    if isinstance(error, InvalidRequest) and error.field == "prompt":
        return InvalidRequest(field, error.message)
    return error


async def finals_of(merged: AsyncIterator, count: int) -> list[Final]:
    """The Final event of each of `count` merged streams, in index order."""
    finals: list[Final | None] = [None] * count
    async with aclosing(merged):
        async for index, event in merged:
            if isinstance(event, Final):
                finals[index] = event
    return finals


def summed_usage(usages: list[tuple[dict, bool]]) -> dict:
    """The response's usage from its choices' (usage, whether its prompt counts): each prompt's
    tokens once however many samples it has, as vLLM counts them, and every completion token."""
    prompt = sum(u["prompt_tokens"] for u, counts in usages if counts)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u, counts in usages if counts)
    completion = sum(u["completion_tokens"] for u, _ in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
