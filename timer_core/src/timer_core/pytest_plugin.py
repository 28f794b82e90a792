"""Timer's pytest plugin, loaded by pytest through the ``pytest11`` entry point.

It registers :mod:`timer_core.testing` for pytest's assertion rewriting before any test
module imports it, so a conformance test failing against a host's own adapter shows the
values it compared, with no ``conftest.py``. pytest rewrites only test modules, conftests
and registered packages; an installed package is none of these until registered.
"""

import pytest

# Before timer_core.testing is first imported: that is why this module is outside it.
pytest.register_assert_rewrite("timer_core.testing")
