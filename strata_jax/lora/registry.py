"""The adapters a server holds (pure Python): names, device slots, and who uses them.

Every loaded adapter owns a device slot for as long as it is loaded (``max_loras`` of
them), so a step never waits for an adapter to be swapped in and the scheduler never has
to bound the adapters of a batch: any mix of loaded adapters fits one step.  Names are
what users call adapters; the slot and the cache follow the content identity, so loading
the same folder under a second name shares the first one's slot (and its KV).

Thread-safety: the engine thread mutates it (``add``/``remove``); the faces read it
(``resolve``, ``listing``) under the lock.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from strata_jax.api import InvalidRequestError
from strata_jax.lora.peft_adapter import LoraAdapter


class AdapterNotFoundError(InvalidRequestError):
    """A request or an unload names an adapter that is not loaded."""


class AdapterConflictError(InvalidRequestError):
    """A load that cannot be done now: the name is taken, or every slot is held."""


class AdapterInUseError(InvalidRequestError):
    """An unload of an adapter whose requests are still running: refused, never waited for."""


@dataclass(frozen=True)
class LoadedAdapter:
    adapter: LoraAdapter
    slot: int

    @property
    def identity(self) -> str:
        return self.adapter.identity


class AdapterRegistry:
    """``max_loras`` slots; ``add`` -> the slot to write (None: its content already holds one)."""

    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self._by_name: dict[str, LoadedAdapter] = {}
        self._lock = threading.Lock()

    def add(self, adapter: LoraAdapter) -> tuple[LoadedAdapter, bool]:
        """Register ``adapter``; returns its entry and whether its slot must be written."""
        with self._lock:
            if adapter.name in self._by_name:
                raise AdapterConflictError(f"a LoRA adapter named {adapter.name!r} is already loaded")
            same = next((e for e in self._by_name.values() if e.identity == adapter.identity), None)
            if same is not None:
                entry = LoadedAdapter(adapter, same.slot)
                self._by_name[adapter.name] = entry
                return entry, False
            held = {e.slot for e in self._by_name.values()}
            free = next((s for s in range(self.max_loras) if s not in held), None)
            if free is None:
                raise AdapterConflictError(
                    f"all {self.max_loras} LoRA slots are held (max_loras); unload an adapter first"
                )
            entry = LoadedAdapter(adapter, free)
            self._by_name[adapter.name] = entry
            return entry, True

    def remove(self, name: str) -> int | None:
        """Forget ``name``; returns its slot when no other name holds the same content (to clear)."""
        with self._lock:
            entry = self._by_name.pop(name, None)
            if entry is None:
                raise AdapterNotFoundError(f"no LoRA adapter named {name!r} is loaded")
            shared = any(e.slot == entry.slot for e in self._by_name.values())
            return None if shared else entry.slot

    def resolve(self, name: str) -> LoadedAdapter:
        with self._lock:
            entry = self._by_name.get(name)
        if entry is None:
            raise AdapterNotFoundError(f"no LoRA adapter named {name!r} is loaded")
        return entry

    def with_identity(self, identity: str) -> LoadedAdapter | None:
        """A loaded adapter of this content (its slot now), or None."""
        with self._lock:
            return next((e for e in self._by_name.values() if e.identity == identity), None)

    def listing(self) -> list[LoadedAdapter]:
        with self._lock:
            return list(self._by_name.values())

    def name_of(self, identity: str) -> str | None:
        """A name the adapter of ``identity`` is loaded under (KV events), or None."""
        with self._lock:
            return next((n for n, e in self._by_name.items() if e.identity == identity), None)
