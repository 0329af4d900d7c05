"""lm-eval's loglikelihood through the split: its local-completions client (token-id prompts,
echo, logprobs 1, max_tokens 1; at batch size 5 several prompts a request) against a live
1 prefill + 1 decode server runs the repository's tiny task (bench/eval), and every sample's
loglikelihood and greediness equal transformers' on the same checkpoint and the same
context/continuation split."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from tests.oracle import hf_logits
from tests.test_api_support import MODEL_NAME, backend, idle_backend, server  # noqa: F401

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is a test dependency: pip install -e '.[test]'")
REPO = Path(__file__).resolve().parent.parent
TASK = "splitserve_tiny_loglikelihood"


def _task_folder(tmp_path: Path) -> Path:
    task = yaml.safe_load((REPO / "bench" / "eval" / "tiny_loglikelihood.yaml").read_text())
    task["dataset_kwargs"]["data_files"]["test"] = str(REPO / "bench" / "eval" / "tiny_loglikelihood.jsonl")
    (tmp_path / "task.yaml").write_text(yaml.safe_dump(task))
    return tmp_path


def test_lm_eval_loglikelihoods_through_the_split_equal_transformers(server, idle_backend, api_model_path,
                                                                     model_factory, tmp_path, monkeypatch):
    from lm_eval.tasks import TaskManager

    batch_size = 5  # the task's 6 samples go as a request of 5 prompts, then one of a single prompt

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = (f"model={MODEL_NAME},base_url=http://127.0.0.1:{server.http_port}/v1/completions,"
            f"tokenizer_backend=huggingface,tokenizer={api_model_path},tokenized_requests=True,"
            "num_concurrent=1,max_retries=1")
    out = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=[TASK],
                                  task_manager=TaskManager(include_path=str(_task_folder(tmp_path))),
                                  log_samples=True, batch_size=batch_size)
    samples = out["samples"][TASK]
    assert len(samples) == 6
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(api_model_path))
    _, hf = model_factory("jamba")  # the API model's weights
    for sample in samples:
        (context, continuation), = sample["arguments"]
        whole = tokenizer(context + continuation, add_special_tokens=False).input_ids  # lm-eval's split
        n = len(tokenizer(context, add_special_tokens=False).input_ids)
        logprobs = torch.log_softmax(hf_logits(hf, whole).double(), dim=-1)
        rows = logprobs[n - 1:len(whole) - 1]
        expected = float(rows.gather(1, torch.tensor(whole[n:])[:, None]).sum())
        greedy = bool((rows.argmax(-1) == torch.tensor(whole[n:])).all())
        (got, got_greedy), = sample["filtered_resps"]  # one (loglikelihood, is_greedy) per sample
        assert abs(got - expected) <= 1e-4 * (len(whole) - n), (context, continuation, got, expected)
        assert got_greedy == greedy
    assert "acc,none" in out["results"][TASK]
