"""Fixtures for the learner tests: the tiny model, built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
from echo2.loading import load_causal_lm


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from learner.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="session")
def tiny(tiny_dir: Path):
    """(model, tokenizer) loaded from the tiny folder, in eval mode, float32."""
    import torch
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    model = load_causal_lm(tiny_dir, dtype=torch.float32)
    model.eval()
    return model, AutoTokenizer.from_pretrained(tiny_dir)
