"""`--model` as a Hugging Face Hub id: resolved to a snapshot folder in the standard cache.

A folder is used as it is. Anything else that reads as a Hub id (`org/name`) goes through
huggingface_hub.snapshot_download, which knows the cache layout
(models--org--name/snapshots/<commit>, refs/<branch>), HF_TOKEN and HF_ENDPOINT; only the files
the engine reads are fetched. The commit it resolves to is returned so that workers on other
nodes resolve exactly the same snapshot, whatever the branch points to by then.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# What engine/models and engine/tokenizer read; nothing else is downloaded.
ALLOW_PATTERNS = ["config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
                  "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
COMMIT = re.compile(r"[0-9a-f]{40}")


def offline() -> bool:
    """HF_HUB_OFFLINE as set now (huggingface_hub reads it once, at import)."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE")
    return constants.HF_HUB_OFFLINE if value is None else value.upper() in constants.ENV_VARS_TRUE_VALUES


def is_hub_id(model: str) -> bool:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(model)
    except HFValidationError:
        return False
    return True


def resolve_model(model: str, revision: str | None = None) -> tuple[str, str | None]:
    """(local folder, commit): a folder comes back unchanged with commit None; a Hub id comes
    back as its snapshot folder and the commit that snapshot is. ValueError, naming the field,
    for anything that cannot be served."""
    if Path(model).is_dir():
        if revision is not None:
            raise ValueError(f"revision: only for a Hub id; {model!r} is a local folder")
        return model, None
    if not is_hub_id(model):
        raise ValueError(f"model: {model!r} is neither a directory nor a Hugging Face Hub id (org/name)")
    folder = _snapshot(model, revision)
    commit = Path(folder).name
    if not COMMIT.fullmatch(commit):  # snapshot_download always answers .../snapshots/<commit>
        raise ValueError(f"model: {model!r} resolved to {folder}, not a snapshot folder")
    where = f"{model}@{commit[:12]} ({folder})"
    if not (Path(folder) / "config.json").is_file():
        raise ValueError(f"model: {where} has no config.json")
    if not any(Path(folder).glob("*.safetensors")):
        raise ValueError(f"model: {where} has no *.safetensors weights")
    return folder, commit


def _snapshot(model: str, revision: str | None) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    at = f"{model}@{revision or 'main'}"
    cache = os.environ.get("HF_HUB_CACHE") or None  # None: huggingface_hub's default (HF_HOME)
    is_offline = offline()
    try:
        return snapshot_download(model, revision=revision, cache_dir=cache, allow_patterns=ALLOW_PATTERNS,
                                 local_files_only=is_offline)
    except GatedRepoError as e:
        raise ValueError(f"model: {at} is gated: accept its terms on the Hub and set HF_TOKEN "
                         f"({_first_line(e)})") from None
    except RepositoryNotFoundError:
        raise ValueError(f"model: no Hub repository {model!r} (or it is private: set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ValueError(f"revision: {model!r} has no revision {revision!r}") from None
    except LocalEntryNotFoundError as e:  # includes IncompleteSnapshotError
        why = "HF_HUB_OFFLINE is set" if is_offline else "the Hub could not be reached"
        raise ValueError(f"model: {model!r} is not a directory, and the Hub id {at} is not in the cache "
                         f"{cache or '(default)'} while {why}: "
                         f"{_first_line(e)}") from None
    except HfHubHTTPError as e:
        raise ValueError(f"model: {at}: the Hub answered {_first_line(e)}") from None


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
