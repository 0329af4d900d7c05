"""gpu_check's hand-off step: a prefill worker in this process hands off to a decode worker in
another process on the same device over staged shm (engine.staging: the cache is on the GPU,
the wire in host memory), no Ray; the tokens must equal the colocated engine's, or differ only
at ties that transformers judges. Dry run: CPU caches with staging forced."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import time

from engine.staging import FORCE_ENV

MAX_TOKENS = 24
OPTIONS = dict(block_size=16, max_num_batched_tokens=256, max_num_seqs=8, num_kv_blocks=256, dtype="float32")


def _prompts(tokenizer) -> list[list[int]]:
    texts = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def push(self,"]
    long = "".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n\n" for i in range(40))  # > 256 tokens: chunked
    return [tokenizer.encode(t) for t in texts] + [tokenizer.encode(long)]


def _decode_server(conn, model: str, options: dict, env: dict) -> None:
    """The decode worker's process: answers accept / reserve / collect over a pipe."""
    os.environ.update(env)
    from decode_worker.worker import DecodeWorker
    from engine.output import Cumulative

    worker = DecodeWorker("d0", model, options, "shm", transfer_timeout_s=60)
    outputs: dict[str, Cumulative] = {}
    finished: dict[str, list[int]] = {}
    try:
        while True:
            command, *args = conn.recv()
            if command == "stop":
                break
            try:
                if command == "accept":
                    reply = asyncio.run(worker.accept(*args))
                elif command == "reserve":
                    rid, prompt, params = args
                    outputs[rid] = Cumulative(prompt)
                    reply = asyncio.run(worker.reserve(rid, prompt, params, None, "p0"))
                elif command == "collect":
                    deadline = time.monotonic() + args[0]
                    while len(finished) < len(outputs) and time.monotonic() < deadline:
                        for out in asyncio.run(worker.poll(1.0)):
                            whole = outputs[out.request_id].add(out)
                            if whole.error is not None:
                                raise RuntimeError(f"{out.request_id}: {whole.error}")
                            if whole.finished:
                                finished[out.request_id] = whole.token_ids
                    reply = {"tokens": dict(finished), "staged": worker.staging is not None,
                             "staging_device": str(worker.staging.cache.device) if worker.staging else None}
                conn.send(("ok", reply))
            except Exception as error:
                conn.send(("error", f"{type(error).__name__}: {error}"))
    finally:
        worker.shutdown()


def run_handoff(dry_run: bool) -> dict:
    from engine import LLM, SamplingParams, demo_model_path
    from prefill_worker.worker import PrefillWorker

    model, device = str(demo_model_path()), "cpu" if dry_run else "cuda"
    env = {FORCE_ENV: "1"} if dry_run else {}
    os.environ.update(env)
    options = dict(OPTIONS, device=device)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    colocated_llm = LLM(model, **options)
    prompts = _prompts(colocated_llm.tokenizer)
    colocated = [out.token_ids for out in colocated_llm.generate(prompts, params)]
    colocated_llm.engine.close()

    context = mp.get_context("spawn")
    ours, theirs = context.Pipe()
    server = context.Process(target=_decode_server, args=(theirs, model, options, env), daemon=True)
    server.start()

    def ask(*command):
        ours.send(command)
        status, reply = ours.recv()
        if status != "ok":
            raise RuntimeError(f"decode worker: {reply}")
        return reply

    prefill = PrefillWorker("p0", model, options, "shm", transfer_timeout_s=60)
    try:
        async def go():
            await prefill.connect("d0", ask("accept", "p0", prefill.handoff_ranks()))
            rids = [f"r{i}" for i in range(len(prompts))]
            targets = [ask("reserve", rid, p, params) for rid, p in zip(rids, prompts)]
            started = time.monotonic()
            outcomes = await asyncio.gather(*(prefill.prefill(rid, p, params, t)
                                              for rid, p, t in zip(rids, prompts, targets)))
            return rids, outcomes, time.monotonic() - started

        rids, outcomes, prefill_s = asyncio.run(go())
        failed = [o.error for o in outcomes if not o.handed_off]
        if failed:
            raise RuntimeError(f"hand-offs failed: {failed[:2]}")
        collected = ask("collect", 120.0)
        split = [collected["tokens"].get(rid) for rid in rids]
        stats = prefill.stats()
    finally:
        prefill.shutdown()
        ours.send(("stop",))
        server.join(timeout=30)
    verdict = _compare(model, prompts, split, colocated)
    rows = [[f"prompt {i} ({len(p)} tokens)", "equal" if s == c else "differs", str(s[:8] if s else s)]
            for i, (p, s, c) in enumerate(zip(prompts, split, colocated))]
    mib = stats["handoff_bytes"] / 2**20
    summary = (
        f"{verdict}; {stats['handoff_count']} staged shm hand-offs "
        f"({'prefill staging ' + str(prefill.staging.cache.device) if prefill.staging else 'no staging'}, "
        f"decode staging {collected['staging_device']}), {mib:.1f} MiB in {stats['handoff_seconds_sum'] * 1e3:.0f} ms "
        f"of sends; prefill + hand-off of all {len(prompts)} {prefill_s * 1e3:.0f} ms"
    )
    ok = verdict.startswith(("equal", "ties")) and collected["staged"]
    return {"result": "PASS" if ok else "FAIL", "summary": summary,
            "tables": [{"title": f"1P1D on one {device} over staged shm vs the colocated engine (demo model, "
                                 f"float32, {MAX_TOKENS} greedy tokens)",
                        "header": ["request", "split vs colocated", "first tokens"], "rows": rows}]}


def _compare(model: str, prompts, split, colocated) -> str:
    if split == colocated:
        return f"equal: all {len(prompts)} token-identical to the colocated engine"
    if any(s is None for s in split):
        return "MISSING outputs"
    import transformers

    from scripts.gpu_check_steps import judge

    return judge(transformers.AutoModelForCausalLM.from_pretrained(model).eval(), prompts, colocated, split)
