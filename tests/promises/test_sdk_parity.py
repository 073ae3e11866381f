"""Every public method of the `tinker` SDK's clients and futures exists on ours and takes the same
arguments: same names, kinds and defaults, in the same order (ours may add keyword arguments with
defaults after them). The deliberate gaps are listed here with their reasons, and in docs/tinker-parity.md."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import tinker

import workbench as wb

PAIRS = [
    (tinker.ServiceClient, wb.ServiceClient),
    (tinker.TrainingClient, wb.TrainingClient),
    (tinker.SamplingClient, wb.SamplingClient),
    (tinker.RestClient, wb.RestClient),
    (tinker.APIFuture, wb.APIFuture),
]

# Methods of the SDK that ours deliberately lacks, and why. docs/tinker-parity.md lists them.
GAPS: dict[str, str] = {
    "ServiceClient.holder": "the SDK's HTTP connection holder; nothing is connected to",
    "ServiceClient.create_custom_loss": "server-side custom losses (alpha, traced with torch.fx); "
    "forward_backward_custom with a plain function does the same in-process",
    "ServiceClient.copy_weights": "copies weights between Tinker projects; there are no projects",
    "TrainingClient.__init__": "built over the SDK's HTTP holder; ours over an Engine",
    "SamplingClient.__init__": "built over the SDK's HTTP holder; ours over an Engine and a pin",
    "SamplingClient.create": "the SDK's internal constructor over its HTTP holder",
    "SamplingClient.get_sampler_handle": "hands a sampler to another process; ours samples in this "
    "process's memory",
    "SamplingClient.from_sampler_handle": "as get_sampler_handle",
    "SamplingClient.__reduce__": "pickling a sampler for another process, as get_sampler_handle",
    "RestClient.__init__": "the SDK's takes its HTTP holder; ours the engines whose live runs it sees",
    "RestClient.copy_weights": "as ServiceClient.copy_weights",
    "RestClient.copy_weights_async": "as ServiceClient.copy_weights",
    "RestClient.get_sampler": "sampler sessions of the Tinker service",
    "RestClient.get_sampler_async": "as get_sampler",
    "RestClient.publish_checkpoint_from_tinker_path": "sharing checkpoints between Tinker accounts",
    "RestClient.publish_checkpoint_from_tinker_path_async": "as publish",
    "RestClient.unpublish_checkpoint_from_tinker_path": "as publish",
    "RestClient.unpublish_checkpoint_from_tinker_path_async": "as publish",
    "RestClient.set_checkpoint_ttl_from_tinker_path": "a checkpoint's expiry is one of its verified "
    "files; set it when saving (ttl_seconds)",
    "RestClient.set_checkpoint_ttl_from_tinker_path_async": "as set_checkpoint_ttl_from_tinker_path",
}
# Account, session, project, billing and audit methods of the Tinker service: there are none locally.
SERVICE_ACCOUNT_METHODS = {
    "assign_session_project",
    "export_session_trace",
    "get_audit_log",
    "get_billing_usage",
    "get_current_checkpoint_storage_usage",
    "get_session",
    "list_sessions",
    "search_sessions",
    "whoami",
}
for _name in SERVICE_ACCOUNT_METHODS:
    for _variant in (_name, f"{_name}_async"):
        if hasattr(tinker.RestClient, _variant):
            GAPS[f"RestClient.{_variant}"] = "accounts, sessions, projects and billing of the Tinker service"

DUNDERS = {"__init__", "__await__", "__enter__", "__exit__", "__reduce__"}


def _public(cls: type) -> dict[str, object]:
    return {
        name: member
        for name, member in inspect.getmembers(cls)
        if (not name.startswith("_") or name in DUNDERS)
        and (callable(member) or isinstance(member, property))
        and not (name == "__reduce__" and member is object.__reduce__)
        and not (name == "__init__" and member is object.__init__)
    }


def _methods() -> list[tuple[str, object, object | None]]:
    rows = []
    for sdk_class, our_class in PAIRS:
        ours = _public(our_class)
        for name, member in sorted(_public(sdk_class).items()):
            rows.append((f"{sdk_class.__name__}.{name}", member, ours.get(name)))
    return rows


def _parameters(function: object) -> list[inspect.Parameter]:
    return list(inspect.signature(function).parameters.values())  # type: ignore[arg-type]


@pytest.mark.parametrize(("name", "sdk", "ours"), _methods(), ids=[row[0] for row in _methods()])
def test_every_sdk_method_takes_the_same_arguments(name: str, sdk: object, ours: object | None) -> None:
    if name in GAPS:
        return
    assert ours is not None, f"{name} is missing (and not a listed gap)"
    if isinstance(sdk, property) or isinstance(ours, property):
        assert isinstance(sdk, property) == isinstance(ours, property), name
        return
    sdk_is_async = inspect.iscoroutinefunction(inspect.unwrap(sdk))  # under the SDK's decorators
    assert sdk_is_async == inspect.iscoroutinefunction(ours), (
        f"{name}: the SDK's is {'' if sdk_is_async else 'not '}async"
    )
    sdk_parameters = _parameters(sdk)
    our_parameters = _parameters(ours)
    for position, expected in enumerate(sdk_parameters):
        if expected.kind is inspect.Parameter.VAR_KEYWORD:
            assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in our_parameters), name
            continue
        actual = our_parameters[position] if position < len(our_parameters) else None
        assert actual is not None and actual.name == expected.name, (
            f"{name}: parameter {position} is {expected.name!r} in the SDK, {getattr(actual, 'name', None)!r} here"
        )
        assert actual.kind == expected.kind, (
            f"{name}({expected.name}): {expected.kind} in the SDK, {actual.kind} here"
        )
        assert actual.default == expected.default, (
            f"{name}({expected.name}): default {expected.default!r} in the SDK, {actual.default!r} here"
        )
    for extra in our_parameters[len(sdk_parameters) :]:
        assert extra.default is not inspect.Parameter.empty or extra.kind in (
            inspect.Parameter.VAR_KEYWORD,
            inspect.Parameter.VAR_POSITIONAL,
        ), f"{name}: our extra parameter {extra.name!r} needs a default"


def test_the_gaps_are_real_sdk_methods_and_listed_in_the_docs() -> None:
    sdk_names = {row[0] for row in _methods()}
    assert set(GAPS) <= sdk_names, sorted(set(GAPS) - sdk_names)
    page = (Path(__file__).resolve().parents[2] / "docs" / "tinker-parity.md").read_text()
    section = re.search(r"\nDeliberate gaps.*?\n\n(.*?)(\n\n|$)", page, re.S)
    assert section is not None, "docs/tinker-parity.md has no 'Deliberate gaps' table"
    # each gap by name (its `_async` twin goes with it)
    missing = [
        name for name in GAPS if name.split(".")[1].strip("_").removesuffix("_async") not in section.group(1)
    ]
    assert not missing, f"docs/tinker-parity.md's gaps table does not list {missing}"
