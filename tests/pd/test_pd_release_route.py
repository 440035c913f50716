"""``POST /kv_transfer/release`` (runtime-plugin-pd) answers any body it cannot use with a 400 in
OpenAI's error shape, never a 5xx."""

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from runtime_pd.routes import RELEASE_PATH, add_release_route


@pytest.fixture(scope="module")
def client():
    app = FastAPI()
    add_release_route(app)
    return TestClient(app)


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe", b"[1, 2]", b'"text"', b"{}",
                                     b'{"kv_transfer_params": 3}', b'{"kv_transfer_params": {"remote_port": "x"}}'])
def test_a_body_it_cannot_use_is_a_400(client, content):
    answer = client.post(RELEASE_PATH, content=content, headers={"content-type": "application/json"})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "kv_transfer_params" and "kv_transfer_params" in error["message"]
