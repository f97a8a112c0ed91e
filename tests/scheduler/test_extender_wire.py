"""The extender's wire types: ExtenderArgs in both forms, bounds, and the results' encodings."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import cluster_keys
from scheduler.extender.wire import (
    ExtenderArgs,
    ExtenderWireError,
    FilterResult,
    HostPriority,
    WireLimits,
    encode_priorities,
)


def pod(model: str | None = "m1", weight: str | None = "1000", **extra: str) -> dict[str, Any]:
    annotations = {cluster_keys.ANNOTATION_FUNCTION_ID: "team/chat", **extra}
    if model is not None:
        annotations[cluster_keys.ANNOTATION_MODEL] = model
    if weight is not None:
        annotations[cluster_keys.ANNOTATION_WEIGHT_BYTES] = weight
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "chat-00001-deployment-abc",
            "namespace": "ember-fn",
            "labels": {cluster_keys.LABEL_FUNCTION: "chat", cluster_keys.LABEL_NAMESPACE: "team"},
            "annotations": annotations,
        },
        "spec": {"schedulerName": "ember-scheduler", "containers": [{"name": "worker"}]},
    }


def node(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}}, "status": {}}


def test_node_names_form_round_trips() -> None:
    args = ExtenderArgs.decode({"Pod": pod(), "NodeNames": ["a", "b", "c"]})
    assert args.node_names == ("a", "b", "c") and args.node_objects is None
    d = args.demand
    assert (d.pod, d.function_id, d.model_id, d.weight_bytes) == (
        "ember-fn/chat-00001-deployment-abc", "team/chat", "m1", 1000,
    )  # fmt: skip
    out = FilterResult(("a",), {"b": "full"}, {"c": "down"}).encode(args)
    assert out == {
        "Nodes": None,
        "NodeNames": ["a"],
        "FailedNodes": {"b": "full"},
        "FailedAndUnresolvableNodes": {"c": "down"},
        "Error": "",
    }
    json.dumps(out)  # plain JSON


def test_node_list_form_echoes_the_passed_node_objects() -> None:
    nodes = {"apiVersion": "v1", "kind": "NodeList", "items": [node("a"), node("b")]}
    args = ExtenderArgs.decode({"Pod": pod(), "Nodes": nodes, "NodeNames": None})
    assert args.node_names == ("a", "b")
    out = FilterResult(("b",)).encode(args)
    assert out["NodeNames"] is None
    assert out["Nodes"]["items"] == [node("b")] and out["Nodes"]["kind"] == "NodeList"


def test_priorities_encode_with_go_field_names() -> None:
    assert encode_priorities([HostPriority("a", 10), HostPriority("b", 0)]) == [
        {"Host": "a", "Score": 10},
        {"Host": "b", "Score": 0},
    ]


def test_a_pod_without_the_model_annotation_is_not_a_function() -> None:
    d = ExtenderArgs.decode({"Pod": pod(model=None, weight=None), "NodeNames": []}).demand
    assert d.model_id is None and d.weight_bytes == 0


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ([], "must be a JSON object"),
        ({"NodeNames": ["a"]}, "Pod must be a v1.Pod"),
        ({"Pod": {"spec": {}}, "NodeNames": ["a"]}, "no metadata"),
        ({"Pod": pod()}, "neither NodeNames nor Nodes"),
        ({"Pod": pod(), "NodeNames": "a"}, "array of strings"),
        ({"Pod": pod(), "NodeNames": ["a", 7]}, "node name"),
        ({"Pod": pod(), "NodeNames": ["a", "x" * 254]}, "node name"),
        ({"Pod": pod(), "NodeNames": ["a", "a"]}, "twice"),
        ({"Pod": pod(), "Nodes": {"items": [node("a"), node("a")]}}, "twice"),
        ({"Pod": pod(), "Nodes": {"items": [{"metadata": {}}]}}, "node name"),
        ({"Pod": pod(), "Nodes": {"items": {}}}, "must be an array"),
        ({"Pod": pod(), "Nodes": []}, "NodeList object"),
        ({"Pod": pod(weight=None), "NodeNames": []}, "decimal byte count"),
        ({"Pod": pod(weight="1_000"), "NodeNames": []}, "decimal byte count"),
        ({"Pod": pod(weight="-1"), "NodeNames": []}, "decimal byte count"),
        ({"Pod": pod(weight=" 7"), "NodeNames": []}, "decimal byte count"),
        ({"Pod": pod(weight="٣"), "NodeNames": []}, "decimal byte count"),  # a non-ASCII digit
        ({"Pod": pod(weight="9" * 17), "NodeNames": []}, "decimal byte count"),
        ({"Pod": pod(weight=str(1 << 51)), "NodeNames": []}, "implausibly large"),
        ({"Pod": pod(model=""), "NodeNames": []}, "1 to 1024 printable characters"),
        # Regressions: a lone surrogate (valid in JSON's escapes) could not be encoded in the
        # answer (500), and a '/' in a node name named another device id.
        ({"Pod": pod(model="m\ud800"), "NodeNames": []}, "printable characters"),
        ({"Pod": pod(), "NodeNames": ["a\ud800"]}, "DNS subdomain"),
        ({"Pod": pod(), "NodeNames": ["a/cpu"]}, "DNS subdomain"),
        ({"Pod": pod(), "NodeNames": ["Node_A"]}, "DNS subdomain"),
        ({"Pod": pod(), "Nodes": {"items": [node("../x")]}}, "DNS subdomain"),
        ({"Pod": pod(**{cluster_keys.ANNOTATION_FUNCTION_ID: "f\ud800"}), "NodeNames": []}, "printable"),
    ],
)
def test_malformed_args_are_refused_with_a_clear_error(document: Any, message: str) -> None:
    with pytest.raises(ExtenderWireError, match=message):
        ExtenderArgs.decode(document)


def test_counts_are_bounded() -> None:
    limits = WireLimits(max_nodes=3, max_metadata_entries=5)  # pod() has 5
    with pytest.raises(ExtenderWireError, match="4 nodes"):
        ExtenderArgs.decode({"Pod": pod(), "NodeNames": ["a", "b", "c", "d"]}, limits)
    with pytest.raises(ExtenderWireError, match="4 nodes"):
        ExtenderArgs.decode({"Pod": pod(), "Nodes": {"items": [node(n) for n in "abcd"]}}, limits)
    with pytest.raises(ExtenderWireError, match="labels and annotations"):
        ExtenderArgs.decode({"Pod": pod(x="1"), "NodeNames": []}, limits)
    ExtenderArgs.decode({"Pod": pod(), "Nodes": {"items": None}}, limits)  # Go's empty list
    with pytest.raises(ValueError):
        WireLimits(max_nodes=0)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(
    pod_doc=st.one_of(json_values, st.just(pod())),
    names=st.one_of(json_values, st.lists(st.text(max_size=5), max_size=5)),
    extra=json_values,
)
def test_any_json_decodes_or_fails_with_the_wire_error(pod_doc: Any, names: Any, extra: Any) -> None:
    for document in ({"Pod": pod_doc, "NodeNames": names}, {"Pod": pod_doc, "Nodes": extra}, extra):
        try:
            args = ExtenderArgs.decode(document)
        except ExtenderWireError:
            continue
        assert all(isinstance(n, str) and n for n in args.node_names)
        assert args.demand.weight_bytes >= 0
