"""The qwen3_next family: config.json -> HybridLM, and our parameter names -> HF tensor names."""

from __future__ import annotations

FAMILIES: dict = {}
