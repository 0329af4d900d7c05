"""Several generations answered as one: a completions body with a batch of prompts runs a request
per prompt, all at once, and answers with a choice per prompt.

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


async def merge_streams(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """(index, event) from each stream as it comes, until every stream has ended. An
    InvalidRequest about `prompt` in stream i is raised as one about `prompt[i]`."""
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
                raise _naming_the_prompt(event, index)
            if event is _ENDED:
                running -= 1
                continue
            yield index, event
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


def _naming_the_prompt(error: Exception, index: int) -> Exception:
    if isinstance(error, InvalidRequest) and error.field == "prompt":
        return InvalidRequest(f"prompt[{index}]", error.message)
    return error


async def finals_of(merged: AsyncIterator, count: int) -> list[Final]:
    """The Final event of each of `count` merged streams, in index order."""
    finals: list[Final | None] = [None] * count
    async with aclosing(merged):
        async for index, event in merged:
            if isinstance(event, Final):
                finals[index] = event
    return finals


def summed_usage(usages: list[dict]) -> dict:
    """OpenAI usage objects of the choices added up: the response's usage."""
    total = {name: sum(u[name] for u in usages) for name in ("prompt_tokens", "completion_tokens", "total_tokens")}
    total["prompt_tokens_details"] = {"cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)}
    return total
