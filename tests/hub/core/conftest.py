"""The rig fixture of the core's event-sequence tests: `rig(**kw)` makes a `Rig`, closed after the
test."""

import pytest

from .rig import Rig


@pytest.fixture
def rig():
    made: list[Rig] = []

    def make(**kw) -> Rig:
        made.append(Rig(**kw))
        return made[-1]
    yield make
    for r in made:
        r.close()
