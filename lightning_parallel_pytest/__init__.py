"""pytest plugin of lightning_parallel (registered as a ``pytest11`` entry point): the ``assert_layouts_match`` fixture.

It lives outside the ``lightning_parallel`` package so that loading it -- pytest loads every
installed plugin at start-up -- imports nothing: torch and Lightning are imported only when a
test asks for the fixture.
"""

import pytest


@pytest.fixture
def assert_layouts_match():
    """Compare a model under several layouts with the first; fail with the per-step table unless all match.

    Call it as :func:`lightning_parallel.testing.assert_layouts_match` (module factory, data module
    factory, ``[(strategy, devices), ...]``, ``steps``, ``tolerance``); ``.cases({name: Case(...)},
    layouts)`` compares several model set-ups with one launch per layout.
    """
    from lightning_parallel.testing.assertions import LayoutAssertions

    return LayoutAssertions()
