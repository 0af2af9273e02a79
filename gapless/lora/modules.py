"""`--lora-modules`: vLLM's syntax for the adapters a server starts with, `name=path` or the JSON form
`{"name": ..., "path": ..., "base_model_name": ...}`, each word one adapter."""

from __future__ import annotations

import json
from typing import NamedTuple

from gapless.lora.registry import AdapterRegistry, SharedAdapterRegistry
from gapless.model.config import ModelConfig


class LoRAModule(NamedTuple):
    """An adapter named on the command line."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(words: list[str]) -> list[LoRAModule]:
    """The adapters `words` name; ValueError naming a malformed word or a name given twice."""
    out: list[LoRAModule] = []
    for word in words:
        if word.lstrip().startswith("{"):
            try:
                obj = json.loads(word)
            except json.JSONDecodeError as e:
                raise ValueError(f"--lora-modules {word!r}: not valid JSON ({e})") from None
            if (
                not isinstance(obj, dict)
                or not isinstance(obj.get("name"), str)
                or not isinstance(obj.get("path"), str)
            ):
                raise ValueError(f"--lora-modules {word!r}: the JSON form needs string fields name and path")
            base = obj.get("base_model_name")
            module = LoRAModule(obj["name"], obj["path"], base if isinstance(base, str) else None)
        else:
            name, sep, path = word.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {word!r}: expected name=path or a JSON object")
            module = LoRAModule(name, path)
        if any(m.name == module.name for m in out):
            raise ValueError(f"--lora-modules: the name {module.name!r} is given twice")
        out.append(module)
    return out


def served_adapters(
    words: list[str] | None, cfg: ModelConfig, max_rank: int, shared: str | None = None, experts: bool = True
) -> AdapterRegistry:
    """A server's adapters at start-up: those `--lora-modules` names, each checked against the model
    (ValueError naming a bad word or a bad adapter); more are loaded and unloaded while it serves.
    `shared`: the file through which several API server processes serve the same adapters; `experts`:
    whether a mixture's experts may be adapted."""
    modules = parse_lora_modules(words or [])
    if shared is not None:
        common = SharedAdapterRegistry(cfg, max_rank, shared, experts)
        common.start([(m.name, m.path, m.base_model_name) for m in modules])
        return common
    registry = AdapterRegistry(cfg, max_rank, unique_names=True, experts=experts)
    for m in modules:
        registry.add_path(m.name, m.path, m.base_model_name)
    return registry
