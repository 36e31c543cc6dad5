import pytest

from replica.request import Request, SamplingParams


@pytest.fixture
def make_request():
    def make(request_id: str, prompt: list[int], max_tokens: int = 16, **kwargs) -> Request:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=kwargs.pop("ignore_eos", False))
        return Request(request_id, prompt, params, **kwargs)
    return make
