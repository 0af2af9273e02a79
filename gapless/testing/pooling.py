"""Pooling models for the tests: a tiny random decoder made a sentence-transformers embedding checkpoint,
and the references gapless's embeddings and scores are checked against (sentence-transformers itself,
and transformers for a causal-LM reranker's score tokens)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from gapless.testing.checkpoints import make_checkpoint

_MODES = {
    "last": "pooling_mode_lasttoken",
    "mean": "pooling_mode_mean_tokens",
    "cls": "pooling_mode_cls_token",
}


def sentence_transformers_checkpoint(
    path: str | Path, arch: str = "qwen3", pooling: str = "last", normalize: bool = True, **kw: object
) -> Path:
    """A tiny random `arch` checkpoint at `path` with the files that make it a sentence-transformers model:
    `modules.json` (Transformer at the root, Pooling, and Normalize if `normalize`), the pooling config
    (`pooling`: last, mean or cls) and `sentence_bert_config.json`."""
    root = make_checkpoint(path, arch, **kw)  # type: ignore[arg-type]  # make_checkpoint's own keywords
    hidden = json.loads((root / "config.json").read_text())["hidden_size"]
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
        )
        (root / "2_Normalize").mkdir()
    (root / "modules.json").write_text(json.dumps(modules))
    (root / "1_Pooling").mkdir()
    config = {"word_embedding_dimension": hidden, **{key: mode == pooling for mode, key in _MODES.items()}}
    config |= {"pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}
    (root / "1_Pooling" / "config.json").write_text(json.dumps(config))
    (root / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 256, "do_lower_case": False})
    )
    return root


def sentence_transformers_embeddings(path: str | Path, texts: Sequence[str]) -> torch.Tensor:
    """sentence-transformers' embeddings of `texts` ([N, H] float32), one text per batch (no padding)."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device="cpu", model_kwargs={"torch_dtype": torch.float32})
    return torch.stack([torch.as_tensor(model.encode([t], convert_to_tensor=True)[0]) for t in texts]).float()


def score_token_reference(
    path: str | Path, prompts: Sequence[str], true_id: int, false_id: int | None
) -> list[float]:
    """transformers' score of each prompt as a causal-LM reranker: the last position's logits of the true
    token (and the false one), sigmoid(true - false), as Qwen3-Reranker's model card computes it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([tok.encode(p)])
            logits = model(ids).logits[0, -1].float()
            margin = logits[true_id] - (logits[false_id] if false_id is not None else 0.0)
            out.append(float(torch.sigmoid(margin)))
    return out
