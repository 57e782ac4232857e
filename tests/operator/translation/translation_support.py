"""The model config.json files the translation tests read (``tests/operator/fixtures``), loaded once."""

from __future__ import annotations

import json
from pathlib import Path

FIXTURES = Path(__file__).parents[1] / "fixtures"


def model_config(name: str) -> dict:
    """``fixtures/<name>.json`` as a dict."""
    return json.loads((FIXTURES / f"{name}.json").read_text())


LLAMA = model_config("llama-3.1-8b")
DEEPSEEK = model_config("deepseek-v2-lite")
GPT_OSS = model_config("gpt-oss-20b")
GEMMA2 = model_config("gemma-2-9b")
MISTRAL = model_config("mistral-7b-v0.1")
MAMBA = model_config("mamba-130m")
