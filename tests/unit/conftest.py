"""Unit tier: loader worker processes end with the test that started them."""

import sys

import pytest


@pytest.fixture(autouse=True)
def _loader_workers_end_with_their_test():
    yield
    data = sys.modules.get("eagle3_ray.train.data")  # only where a test loaded it: importing it costs seconds
    if data is not None:
        data.shut_down_loaders()
