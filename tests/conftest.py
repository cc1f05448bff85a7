import pytest

from kvstate.stateful.configs import machine_configs


def pytest_collection_modifyitems(config, items):
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs a CUDA device; none is present")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(params=machine_configs(), ids=lambda c: c.name)
def machine_config(request):
    return request.param
