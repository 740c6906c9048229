"""Unit tier: loader worker processes end with the test that started them."""

import pytest


@pytest.fixture(autouse=True)
def _loader_workers_end_with_their_test():
    yield
    from eagle3_ray.train import data

    data.shut_down_loaders()
