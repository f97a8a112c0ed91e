"""The gateway's one error table: HTTP status per class, the wire type from each class's ``code``."""

from __future__ import annotations

from gateway.app import ERROR_STATUS
from scheduler.errors import StateConflict


def test_every_mapped_error_has_its_own_code() -> None:
    for cls, status in ERROR_STATUS.items():
        assert isinstance(status, int) and 400 <= status < 600, cls
        assert isinstance(cls.__dict__.get("code"), str), f"{cls.__name__} declares no code"


def test_subclasses_come_before_their_bases() -> None:
    """First match wins: a class listed after one of its bases would never be reached."""
    classes = list(ERROR_STATUS)
    for i, cls in enumerate(classes):
        assert not any(issubclass(cls, base) for base in classes[:i]), cls


def test_state_conflict_is_a_409_named_by_its_code() -> None:
    assert ERROR_STATUS[StateConflict] == 409 and StateConflict.code == "state_conflict"
