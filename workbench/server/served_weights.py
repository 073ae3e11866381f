"""The weights a compatible API's `model` field names, pinned on the engine, and the list `/models` gives.

A request names its weights as hosted Tinker's compatible APIs take them:

* the base model (its alias, its folder or its hub id): adapters off;
* a checkpoint's `tinker://<model>/sampler_weights/<name>` path (or a state checkpoint's
  `tinker://<model>/weights/<name>`): that adapter, loaded once and kept while it is among the
  `CHECKPOINT_PINS_KEPT` most recently used;
* `"<base>;<path>"`: the same checkpoint, with the base it was trained on named too (checked);
* a model on the engine by its id (the notebook session's `sess.model_id`, a Tinker client's model):
  its policy's current weights, pinned for the one request, so it samples the weights that the
  operations queued before it leave, while training goes on.

`ServedWeights.identify` is the one place a name is read, and where the base model's engine is chosen
on a server of several base models (`resolve` pins what it names).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Awaitable
from dataclasses import dataclass

from workbench.engine.interface import SamplerPin
from workbench.engine.local.engine import Engine
from workbench.futures import APIFuture
from workbench.server.errors import RequestError
from workbench.server.model_listings import ModelListings
from workbench.server.service import TinkerService
from workbench.storage.model_folders import TINKER_SCHEME

CHECKPOINT_PINS_KEPT = 4
"""Checkpoints kept loaded for the compatible APIs; the least recently used one beyond is released."""


@dataclass(frozen=True)
class Weights:
    """What a request samples: the engine, the pinned weights, and whether the pin is the request's
    own (released when it finishes) or shared (kept for later requests)."""

    name: str
    engine: Engine
    pin: APIFuture[SamplerPin]
    per_request: bool

    def done(self) -> None:
        """The request finished: release a pin that was its own."""
        if self.per_request:
            self.engine.release_sampler(self.pin)


@dataclass(frozen=True)
class Named:
    """What a `model` name names, found without pinning anything: `kind` is `"base"`, `"checkpoint"`
    (`path` its tinker:// path) or `"model"` (`path` its id); `engine` is the base model's engine."""

    kind: str
    path: str
    engine: Engine


class ServedWeights:
    """Resolves `model` names to pinned weights on their base model's engine, keeping each base model's
    pin and recent checkpoints'.

    Args:
        service: The service whose engines and models are named.
        listings: Its listings, which find the checkpoints named.
    """

    def __init__(self, service: TinkerService, listings: ModelListings):
        self.service = service
        self.listings = listings
        self._base_pins: dict[Engine, APIFuture[SamplerPin]] = {}
        self._checkpoints: OrderedDict[str, tuple[Engine, APIFuture[SamplerPin]]] = OrderedDict()

    async def identify(self, name: object) -> Named:
        """What `name` names, and on which base model's engine (a base the server allows is loaded on
        first use, as for a Tinker client). RequestError 404 for a name this server does not serve (a
        checkpoint that is not there included), 400 for one that is not a model name at all."""
        if not isinstance(name, str) or not name:
            raise RequestError(
                "model must be a non-empty string: a base model, a tinker:// path or a model id"
            )
        base, _, path = name.rpartition(";") if ";" in name else ("", "", name)
        if path.startswith(TINKER_SCHEME):
            model_id, _, checkpoint_id = path[len(TINKER_SCHEME) :].partition("/")
            address = self.listings.checkpoint_address(model_id, checkpoint_id)
            self.listings.checkpoint_folder(address)  # 404 for a checkpoint that is not there
            engine = await self._not_served_is_404(
                self.service.engine_for_checkpoint(address.tinker_path, base or None, "model")
            )
            return Named("checkpoint", address.tinker_path, engine)
        if base:
            raise RequestError(f"model {name!r}: after '<base>;' comes a tinker:// checkpoint path", 404)
        engine = self.service.engine_of_model(path)
        if engine is not None:
            return Named("model", path, engine)
        try:
            engine = await self.service.engine_for(path, "model")
        except RequestError:
            raise RequestError(
                f"model {name!r} is not served here: name a base model ({', '.join(map(repr, self.service.served_names()))}), "
                "a model on this server or a tinker:// checkpoint path (GET /models lists them)",
                404,
            ) from None
        return Named("base", path, engine)

    @staticmethod
    async def _not_served_is_404(finding: Awaitable[Engine]) -> Engine:
        try:
            return await finding
        except RequestError as error:
            raise RequestError(error.message, 404) from None

    async def resolve(self, name: object) -> Weights:
        """The weights `name` names (`identify`), pinned."""
        named = await self.identify(name)
        assert isinstance(name, str)
        engine = named.engine
        if named.kind == "checkpoint":
            return Weights(name, engine, self._checkpoint_pin(engine, named.path), per_request=False)
        if named.kind == "model":
            return Weights(name, engine, engine.pin_sampler(named.path), per_request=True)
        pin = self._base_pins.get(engine)
        if pin is None:
            pin = self._base_pins[engine] = engine.pin_sampler(None)
        return Weights(name, engine, pin, per_request=False)

    def _checkpoint_pin(self, engine: Engine, path: str) -> APIFuture[SamplerPin]:
        kept = self._checkpoints.get(path)
        if (
            kept is not None
            and kept[0] is engine
            and not (kept[1].done() and kept[1].future().exception() is not None)
        ):
            self._checkpoints.move_to_end(path)
            return kept[1]
        pin = engine.pin_sampler_checkpoint(path)
        self._checkpoints[path] = (engine, pin)
        while len(self._checkpoints) > CHECKPOINT_PINS_KEPT:
            _, (oldest_engine, oldest) = self._checkpoints.popitem(last=False)
            oldest_engine.release_sampler(oldest)  # after the requests already queued on it
        return pin

    def listing(self) -> list[dict[str, object]]:
        """`/models`: each base model served, the models on their engines, and every sampler checkpoint
        of the models this server knows (OpenAI's model objects, with `root` naming the base)."""
        now = int(time.time())
        roots: dict[str, str] = {}
        for engine in self.service.engines():
            base = engine.config.base_model
            roots.setdefault(base, base)
            for model_id in engine.model_ids():
                roots.setdefault(model_id, base)
        for base in self.service.served_names():
            roots.setdefault(base, base)
        for model in self.listings.training_runs(limit=1_000, offset=0)["training_runs"]:
            base = str(model.get("base_model") or self.service.engine.config.base_model)
            for checkpoint in self.listings.checkpoints(model["training_run_id"])["checkpoints"]:
                if checkpoint["checkpoint_type"] == "sampler":
                    roots.setdefault(
                        f"{TINKER_SCHEME}{model['training_run_id']}/{checkpoint['checkpoint_id']}", base
                    )
        return [
            {"id": name, "object": "model", "created": now, "owned_by": "workbench", "root": root}
            for name, root in roots.items()
        ]

    def release_all(self) -> None:
        """Release every pin kept (the server stops)."""
        for engine, pin in self._checkpoints.values():
            engine.release_sampler(pin)
        self._checkpoints.clear()
        for engine, pin in self._base_pins.items():
            engine.release_sampler(pin)
        self._base_pins.clear()
