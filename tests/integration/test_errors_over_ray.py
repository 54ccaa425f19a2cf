"""Every failure of the taxonomy (rlhf_core/errors.py) raised inside a Ray worker reaches the driver through
`waits.gather` as itself: its class, message, attributes and `retryable`, as Prefect's retry policy reads them."""

from __future__ import annotations

import pytest
import ray

from rlhf_core.driver.waits import gather
from rlhf_core.errors import RLHFError
from tests.unit.test_errors import TAXONOMY


@pytest.fixture(scope="module")
def local_ray():
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


@ray.remote(num_cpus=0)
def _raise(error: BaseException) -> None:
    raise error


def test_each_failure_crosses_ray_as_itself(local_ray):
    refs = [_raise.remote(error) for error, _, _ in TAXONOMY]
    for ref, (error, retryable, exit_code) in zip(refs, TAXONOMY):
        with pytest.raises(RLHFError) as caught:
            gather(ref)
        assert type(caught.value) is type(error), caught.value
        assert str(caught.value) == str(error) and vars(caught.value) == vars(error)
        assert caught.value.retryable is retryable and caught.value.exit_code == exit_code
