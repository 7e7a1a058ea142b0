"""SIGHUP reload in process: the live fields swapped (the key file read first, so a bad one changes
nothing), the rest ignored until restart, and the config re-read from the command line it started with."""

from __future__ import annotations

from types import SimpleNamespace


from trnd.config import ConfigError, ServeConfig, load_config
from trnd.daemon import lifecycle


def test_reload_swaps_limits_and_api_key_and_ignores_the_rest(tmp_path, monkeypatch):
    from starlette.testclient import TestClient

    from trnd.api.server import build_app

    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    key = tmp_path / "key"
    key.write_text("old-key\n")
    cfg = load_config(ServeConfig, None, {"api_key_file": str(key), "max_n": 4, "port": 8000})
    loop = SimpleNamespace(max_requests=cfg.api.max_requests)
    app = build_app(loop, cfg, "m")
    new = {}
    life = lifecycle.Lifecycle("serve", cfg, reload_source=lambda: load_config(ServeConfig, None, new))
    life.state, life.loop, life.phase = app.state.trnd, loop, "running"
    client = TestClient(app)

    def status(k: str) -> int:
        return client.get("/no-such-path", headers={"Authorization": f"Bearer {k}"}).status_code

    assert (status("old-key"), status("new-key")) == (404, 401)
    key.write_text("new-key\n")
    new.update(api_key_file=str(key), max_n=2, max_requests=7, port=9000, log_level="info")
    assert life.reload()
    st = app.state.trnd
    assert st.cfg.api.max_n == 2 and loop.max_requests == 7 and life.cfg.api.max_n == 2
    assert st.cfg.http.port == 8000 and life.cfg.http.port == 8000  # needs a restart: ignored
    assert (status("old-key"), status("new-key")) == (401, 404)
    new.update(max_n=3, api_key_file=str(tmp_path / "missing"))
    assert not life.reload()  # the key file is gone: nothing changes, not even max_n
    assert st.cfg.api.max_n == 2 and status("new-key") == 404

    def bad():
        raise ConfigError("x.toml: Expected `int` - at `$.max_n`")
    life.reload_source = bad
    assert not life.reload() and st.cfg.api.max_n == 2


def test_argv_source_rereads_the_file_with_the_same_flags(tmp_path):
    f = tmp_path / "serve.toml"
    f.write_text("max_n = 3\nport = 8001\n")
    from trnd.cli import argv_source
    from trnd.config import load_serve_config

    source = argv_source("serve", load_serve_config, ["serve", "--config", str(f), "--port", "8002"])
    f.write_text("max_n = 5\nport = 8001\n")
    cfg = source()
    assert (cfg.api.max_n, cfg.http.port) == (5, 8002)
    assert argv_source("serve", load_serve_config, ["-m", "pytest"]) is None


