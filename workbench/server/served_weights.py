"""The weights a compatible API's `model` field names, pinned on the engine, and the list `/models` gives.

A request names its weights as hosted Tinker's compatible APIs take them:

* the base model (its alias, its folder or its hub id): adapters off;
* a checkpoint's `tinker://<run>/sampler_weights/<name>` path (or a state checkpoint's
  `tinker://<run>/weights/<name>`): that adapter, loaded once and kept while it is among the
  `CHECKPOINT_PINS_KEPT` most recently used;
* `"<base>;<path>"`: the same checkpoint, with the base it was trained on named too (checked);
* a model on the engine by its id (the notebook session's `sess.model_id`, a Tinker client's model):
  its policy's current weights, pinned for the one request, so it samples the weights that the
  operations queued before it leave, while training goes on.

`ServedWeights.identify` is the one place a name is read (`resolve` pins what it names); a server with several base models
would choose the engine there too.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from workbench.engine.interface import SamplerPin
from workbench.engine.local.engine import Engine
from workbench.futures import APIFuture
from workbench.server.errors import RequestError
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


class ServedWeights:
    """Resolves `model` names to pinned weights, keeping the base model's pin and recent checkpoints'."""

    def __init__(self, service: TinkerService):
        self.service = service
        self._base_pin: APIFuture[SamplerPin] | None = None
        self._checkpoints: OrderedDict[str, APIFuture[SamplerPin]] = OrderedDict()

    @property
    def engine(self) -> Engine:
        return self.service.engine

    def identify(self, name: object) -> tuple[str, str]:
        """What `name` names, checked without pinning anything: `("base", name)`, `("checkpoint",
        tinker path)` or `("model", model id)`. RequestError 404 for a name this server does not serve
        (a checkpoint that is not there included), 400 for one that is not a model name at all."""
        if not isinstance(name, str) or not name:
            raise RequestError(
                "model must be a non-empty string: a base model, a tinker:// path or a model id"
            )
        base, _, path = name.rpartition(";") if ";" in name else ("", "", name)
        if base:
            try:
                self.service.check_base_model(base, "model")
            except RequestError as error:
                raise RequestError(error.message, 404) from None
        if path.startswith(TINKER_SCHEME):
            run_id, _, checkpoint_id = path[len(TINKER_SCHEME) :].partition("/")
            address = self.service.checkpoint_address(run_id, checkpoint_id)
            self.service.checkpoint_folder(address)  # 404 for a checkpoint that is not there
            return "checkpoint", address.tinker_path
        if base:
            raise RequestError(f"model {name!r}: after '<base>;' comes a tinker:// checkpoint path", 404)
        if path in self.engine.model_ids():
            return "model", path
        try:
            self.service.check_base_model(path, "model")
        except RequestError:
            raise RequestError(
                f"model {name!r} is not served here: name the base model {self.service.base_model!r}, a "
                "model on this server or a tinker:// checkpoint path (GET /models lists them)",
                404,
            ) from None
        return "base", path

    def resolve(self, name: object) -> Weights:
        """The weights `name` names (`identify`), pinned."""
        kind, path = self.identify(name)
        assert isinstance(name, str)
        if kind == "checkpoint":
            return Weights(name, self.engine, self._checkpoint_pin(path), per_request=False)
        if kind == "model":
            return Weights(name, self.engine, self.engine.pin_sampler(path), per_request=True)
        if self._base_pin is None:
            self._base_pin = self.engine.pin_sampler(None)
        return Weights(name, self.engine, self._base_pin, per_request=False)

    def _checkpoint_pin(self, path: str) -> APIFuture[SamplerPin]:
        pin = self._checkpoints.get(path)
        if pin is not None and not (pin.done() and pin.future().exception() is not None):
            self._checkpoints.move_to_end(path)
            return pin
        pin = self.engine.pin_sampler_checkpoint(path)
        self._checkpoints[path] = pin
        while len(self._checkpoints) > CHECKPOINT_PINS_KEPT:
            _, oldest = self._checkpoints.popitem(last=False)
            self.engine.release_sampler(oldest)  # after the requests already queued on it
        return pin

    def listing(self) -> list[dict[str, object]]:
        """`/models`: the base model, the models on the engine, and every sampler checkpoint of the runs
        this server knows (OpenAI's model objects, with `root` naming the base)."""
        now = int(time.time())
        base = self.service.base_model
        names = [base, *self.engine.model_ids()]
        names += [
            f"{TINKER_SCHEME}{run['training_run_id']}/{checkpoint['checkpoint_id']}"
            for run in self.service.training_runs(limit=1_000, offset=0)["training_runs"]
            for checkpoint in self.service.checkpoints(run["training_run_id"])["checkpoints"]
            if checkpoint["checkpoint_type"] == "sampler"
        ]
        return [
            {"id": name, "object": "model", "created": now, "owned_by": "workbench", "root": base}
            for name in dict.fromkeys(names)
        ]

    def release_all(self) -> None:
        """Release every pin kept (the server stops)."""
        for pin in self._checkpoints.values():
            self.engine.release_sampler(pin)
        self._checkpoints.clear()
        if self._base_pin is not None:
            self.engine.release_sampler(self._base_pin)
            self._base_pin = None
