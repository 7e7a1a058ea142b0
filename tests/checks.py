"""Checks the API tests share."""

from __future__ import annotations

import httpx


def assert_error(r: httpx.Response, status: int, param=..., code=...) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"] and "Traceback" not in err["message"]
    if param is not ...:
        assert err["param"] == param, err
    if code is not ...:
        assert err["code"] == code, err
    return err
