"""`bench/common/proxy.py`: the NIXL proxy's rewrite of a request for P."""

from __future__ import annotations

import pytest

from rapidkv.bench.common.proxy import prefill_body


@pytest.mark.unit
def test_the_nixl_proxy_asks_p_for_one_token_and_a_remote_decode() -> None:
    body = {
        "prompt": [1, 2],
        "max_tokens": 16,
        "stream": True,
        "min_tokens": 16,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
    }
    p = prefill_body(body)
    assert p["max_tokens"] == 1 and p["stream"] is False
    assert "min_tokens" not in p and "stream_options" not in p
    assert p["kv_transfer_params"]["do_remote_decode"] is True
    assert p["prompt"] == [1, 2] and body["max_tokens"] == 16  # the client's body is untouched
