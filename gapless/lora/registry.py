"""The adapters an engine or a server knows, each checked (`load_adapter`) once when first named: by id
(what the device's slots and the prefix cache key by) and by name (what a request's `model` names).
An id never means two adapters; a server also keeps names unique (`unique_names`) and hands out ids
that are never reused, so an adapter unloaded and loaded again is a new one everywhere.

Several API server processes (`--api-server-count`) share one registry through a file
(`SharedAdapterRegistry`): each change is made under a file lock and written whole, and each lookup
first rereads the file if another process changed it, so an adapter loaded or unloaded through any of
them is what every one of them serves, and ids stay unique across them."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path

from gapless.lora.adapter import LoRAError, load_adapter
from gapless.lora.request import LoRARequest
from gapless.model.config import ModelConfig


class AdapterRegistry:
    """Checked adapters by name and by id."""

    def __init__(
        self, cfg: ModelConfig, max_rank: int, unique_names: bool = False, experts: bool = True
    ) -> None:
        self.cfg, self.max_rank, self.unique_names = cfg, max_rank, unique_names
        self.experts = experts  # whether a mixture's experts may be adapted (`load_adapter`)
        self.by_name: dict[str, LoRARequest] = {}
        self.by_id: dict[int, LoRARequest] = {}
        self._last_id = 0

    def lookup(self, name: str | None) -> LoRARequest | None:
        """The adapter served as `name`, or None."""
        return self.by_name.get(name) if name is not None else None

    def served(self) -> list[LoRARequest]:
        """Every adapter served now."""
        return list(self.by_name.values())

    def add(self, lora: LoRARequest) -> LoRARequest:
        """`lora`, checked against the model (`LoRAError` naming what is wrong) unless already known; an
        id already given to another adapter is refused, and with `unique_names` a name too."""
        known = self.by_id.get(lora.lora_int_id)
        if known is not None and (known.lora_path, known.lora_name) == (lora.lora_path, lora.lora_name):
            return known
        if known is not None:
            raise LoRAError(
                f"LoRA adapter {lora.lora_name!r}: id {lora.lora_int_id} is already adapter "
                f"{known.lora_name!r} ({known.lora_path})"
            )
        if self.unique_names and lora.lora_name in self.by_name:
            raise LoRAError(f"LoRA adapter {lora.lora_name!r} is already loaded (unload it first)")
        load_adapter(lora.lora_name, lora.lora_path, self.cfg, self.max_rank, self.experts)
        self.by_name[lora.lora_name] = self.by_id[lora.lora_int_id] = lora
        self._last_id = max(self._last_id, lora.lora_int_id)
        return lora

    def add_path(self, name: str, path: str | Path, base_model_name: str | None = None) -> LoRARequest:
        """The adapter at `path` under `name`, checked, with an id no adapter ever had here."""
        return self.add(LoRARequest(name, self._last_id + 1, str(path), base_model_name))

    def remove(self, name: str) -> LoRARequest:
        """Forget adapter `name` (`LoRAError` if unknown); its id is not handed out again."""
        lora = self.by_name.pop(name, None)
        if lora is None:
            raise LoRAError(f"LoRA adapter {name!r} is not loaded")
        del self.by_id[lora.lora_int_id]
        return lora


class SharedAdapterRegistry(AdapterRegistry):
    """An `AdapterRegistry` that processes share through the JSON file `path` (a server's adapters,
    `unique_names`): ids, names and paths; the adapter that adds one checks it first."""

    def __init__(self, cfg: ModelConfig, max_rank: int, path: str | Path, experts: bool = True) -> None:
        super().__init__(cfg, max_rank, unique_names=True, experts=experts)
        self.path = Path(path)
        self._seen: tuple[int, int, int] | None = None  # (inode, mtime ns, size) of the file last read

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the registry's lock, with this process's view read from the file."""
        with open(self.path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                self.sync()
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def sync(self) -> None:
        """Reread the file when another process changed it (one stat when none did)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if key == self._seen:
            return
        state = json.loads(self.path.read_text())
        loras = [LoRARequest(a["name"], a["id"], a["path"], a.get("base")) for a in state["adapters"]]
        self.by_name = {lo.lora_name: lo for lo in loras}
        self.by_id = {lo.lora_int_id: lo for lo in loras}
        self._last_id, self._seen = state["last_id"], key

    def _write(self) -> None:
        adapters = [
            {"name": lo.lora_name, "id": lo.lora_int_id, "path": lo.lora_path, "base": lo.base_model_name}
            for lo in self.by_id.values()
        ]
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"last_id": self._last_id, "adapters": adapters}))
        os.replace(tmp, self.path)  # whole, at once: a reader sees the old file or the new one
        st = os.stat(self.path)
        self._seen = (st.st_ino, st.st_mtime_ns, st.st_size)

    def start(self, add: list[tuple[str, str, str | None]]) -> None:
        """The adapters a server starts with (name, path, base): added by the first process to start,
        which creates the file; a later one reads what is served by then."""
        with self._locked():
            if self._seen is None:
                for name, path, base in add:
                    super().add_path(name, path, base)
                self._write()

    def lookup(self, name: str | None) -> LoRARequest | None:
        self.sync()
        return super().lookup(name)

    def served(self) -> list[LoRARequest]:
        self.sync()
        return super().served()

    def add_path(self, name: str, path: str | Path, base_model_name: str | None = None) -> LoRARequest:
        with self._locked():
            lora = super().add_path(name, path, base_model_name)
            self._write()
        return lora

    def remove(self, name: str) -> LoRARequest:
        with self._locked():
            lora = super().remove(name)
            self._write()
        return lora
