"""The engine's LoRA adapters by name, as SGLang's tokenizer side keeps them (srt/lora/lora_registry.py in 0.5.5).

Each load gets a fresh id (SGLang: a uuid per LoRARef): a name unloaded and loaded again with other weights is
another adapter, whose KV the prefix cache never mixes with the old one's. Requests acquire the adapters they name
(all looked up before any is counted) and release them when they finish; an unload first unregisters the name (new
requests naming it fail at once) and then waits until no request in flight uses it, never aborting one
(lora_registry.py:170-187, tokenizer_communicator_mixin.py:538-578)."""

from __future__ import annotations

import asyncio
import collections
import itertools

import msgspec


class AdapterRef(msgspec.Struct, frozen=True, kw_only=True):
    """One loaded adapter."""

    name: str  # what requests name it by (SGLang's lora_name; the /generate field is called lora_path)
    path: str  # the PEFT directory it was read from (resolved under the engine's weights root)
    id: int  # unique per load: the KV cache's namespace
    pinned: bool = False  # SGLang: never evicted from the GPU pool (accepted; the reference engine has no pool)


class AdapterError(ValueError):
    """A load, unload or request that SGLang answers with 400 (the message is SGLang's wording)."""


NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."  # tokenizer_communicator_mixin.py:488


class AdapterRegistry:
    """Loaded adapters and how many requests in flight use each (event-loop only)."""

    def __init__(self, max_loaded: int | None = None) -> None:
        self.max_loaded = max_loaded
        self._by_name: dict[str, AdapterRef] = {}
        self._in_use: collections.Counter[int] = collections.Counter()
        self._released = asyncio.Event()
        self._ids = itertools.count(1)
        self.lock = asyncio.Lock()  # SGLang's lora_update_lock: loads and unloads one at a time, generation unaffected

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def __len__(self) -> int:
        return len(self._by_name)

    def loaded(self) -> dict[str, str]:
        """name -> path of every loaded adapter (the `loaded_adapters` of SGLang's replies)."""
        return {ref.name: ref.path for ref in self._by_name.values()}

    def refs(self) -> list[AdapterRef]:
        return list(self._by_name.values())

    def check_room(self, name: str, path: str) -> None:
        if self.max_loaded is not None and len(self._by_name) >= self.max_loaded:
            raise AdapterError(  # tokenizer_communicator_mixin.py:504-514
                f"Cannot load LoRA adapter {name} at path {path}. Maximum number of loaded LoRA adapters is "
                f"{self.max_loaded}. Please unload some LoRA adapters before loading new ones."
            )
        if name in self._by_name:
            raise AdapterError(f"Failed to load LoRA adapter {name} because it is already loaded")  # lora_manager:172

    def new_ref(self, name: str, path: str, pinned: bool = False) -> AdapterRef:
        return AdapterRef(name=name, path=path, id=next(self._ids), pinned=pinned)

    def register(self, ref: AdapterRef) -> None:
        self.check_room(ref.name, ref.path)
        self._by_name[ref.name] = ref

    def unregister(self, name: str) -> AdapterRef:
        ref = self._by_name.pop(name, None)
        if ref is None:  # lora_registry.py:101-106
            raise AdapterError(f"LoRA with name {name} does not exist. Loaded LoRAs: {self._by_name.keys()}")
        return ref

    def acquire(self, names: list[str | None]) -> list[AdapterRef | None]:
        """The adapters `names` name (None or "" = the base model), each counted as in use once per name; every
        name is looked up before any is counted (lora_registry.py:117-145)."""
        missing = next((n for n in names if n and n not in self._by_name), None)
        if missing is not None:  # the first one, in the request's order
            raise AdapterError(
                f"The following requested LoRA adapters are not loaded: {missing}\n"
                f"Loaded adapters: {self._by_name.keys()}."
            )
        refs = [self._by_name[n] if n else None for n in names]
        for ref in refs:
            if ref is not None:
                self._in_use[ref.id] += 1
        return refs

    def release(self, ref: AdapterRef | None) -> None:
        if ref is None:
            return
        self._in_use[ref.id] -= 1
        if self._in_use[ref.id] <= 0:
            del self._in_use[ref.id]
            self._released.set()
            self._released = asyncio.Event()

    def in_use(self, ref: AdapterRef) -> int:
        return self._in_use.get(ref.id, 0)

    async def wait_unused(self, ref: AdapterRef) -> None:
        """Until no request in flight uses `ref` (an unload waits here: in-flight requests finish on it)."""
        while self._in_use.get(ref.id, 0) > 0:
            await self._released.wait()


__all__ = ["NOT_ENABLED", "AdapterError", "AdapterRef", "AdapterRegistry"]
