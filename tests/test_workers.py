"""The test suite's own plumbing: under pytest-xdist the tests of one algorithm run in one worker
(conftest.py groups them; pytest.ini asks for `--dist loadgroup`), so each worker compiles an
algorithm's small programs once. If grouping stops working, nothing fails but CI's time grows; it
stopped twice, silently: conftest's hook ran after xdist's had read the groups (now `tryfirst`),
and pytest 9.2 ignores the node ids xdist rewrites (pytest-xdist#1386; requirements-test.txt)."""

import os

import pytest


@pytest.mark.parametrize("name", ["ppo"])
def test_tests_of_one_algorithm_share_a_worker(name, request):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        pytest.skip("not under pytest-xdist")
    assert request.node.nodeid.endswith(f"@{name}"), (
        f"{request.node.nodeid}: xdist did not group this test (see requirements-test.txt's pytest pin)"
    )
