"""Role configs from typed parts (trnd/config.py): flat TOML and flags filed into parts, errors that name
the flat field, a setting a role or mode cannot apply refused by construction, one set of engine rules."""

from __future__ import annotations

import msgspec
import pytest

from trnd.config import (AdminPort, ConfigError, DecodeConfig, LocalConfig, PrefillConfig, RouterConfig, ServeConfig,
                         StoreConfig, flat, keys, load_config, load_serve_config, parts_of, replace)
from trnd.engine.build import EngineConfig

ROLES = [ServeConfig, LocalConfig, DecodeConfig, PrefillConfig, RouterConfig, StoreConfig]


@pytest.mark.parametrize("cls", ROLES)
def test_every_flat_name_belongs_to_one_place(cls):
    seen: dict[str, str] = {}
    for name in cls.__struct_fields__:
        part = parts_of(cls).get(name)
        for k in (part.__struct_fields__ if part is not None else (name,)):
            assert k not in seen, f"{cls.__name__}: {k} in {seen[k]} and {name}"
            seen[k] = name
    assert set(seen) == keys(cls)


def test_flat_keys_land_in_their_parts_and_round_trip(tmp_path):
    f = tmp_path / "decode.toml"
    f.write_text('dtype = "float32"\nport = 9001\nhost_cache_gb = 0.5\nprefill = ["h:1"]\nmax_n = 4\n')
    cfg = load_config(DecodeConfig, f, {"tp": 2})
    assert (cfg.engine.dtype, cfg.engine.tp, cfg.http.port, cfg.tiers.host_cache_gb, cfg.api.max_n, cfg.prefill) == (
        "float32", 2, 9001, 0.5, 4, ["h:1"])
    assert load_config(DecodeConfig, None, flat(cfg)) == cfg
    changed = replace(cfg, {"max_n": 2, "api_key": "k", "log_level": "debug"})
    assert (changed.api.max_n, changed.http.api_key, changed.log_level, changed.http.port) == (2, "k", "debug", 9001)


def test_a_partial_part_keeps_the_roles_own_defaults():
    """The store's admin port and drain differ from prefill's: setting its host keeps them."""
    store = load_config(StoreConfig, None, {"host": "0.0.0.0"})
    assert store.http == AdminPort(host="0.0.0.0", admin_port=8301, drain_timeout_s=2.0)
    assert load_config(PrefillConfig, None, {"host": "0.0.0.0"}).http.admin_port == 8101


@pytest.mark.parametrize("given,match", [
    ({"dtype": "fp16"}, r"dtype = 'fp16' is not one of auto, bfloat16, float32, float16 - at `\$.dtype`"),
    ({"tp": 0}, r"Expected `int` >= 1 - at `\$.tp`"),
    ({"port": 70000}, r"<= 65535 - at `\$.port`"),
    ({"log_level": "loud"}, r"log_level = 'loud' is not one of debug, info, warning, error"),
    ({"static": True, "tp": 2}, r"static runs one rank: tp = 2 must be 1 - at `\$.static`"),
    ({"tp": 2, "ep": 4}, r"ep = 4 does not divide tp = 2: .* - at `\$.ep`"),
    ({"compile_decode": True, "kv_cache_dtype": "fp8_e4m3"}, r"compile_decode does not go with kv_cache_dtype"),
    ({"no_such_thing": 1}, r"unknown field `no_such_thing`"),
])
def test_errors_are_one_line_naming_the_flat_field(given, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_config(DecodeConfig, None, given)
    assert "\n" not in str(e.value) and ".engine." not in str(e.value) and ".http." not in str(e.value)


def test_log_level_is_case_blind():
    assert load_config(RouterConfig, None, {"log_level": "WARNING"}).log_level == "warning"


@pytest.mark.parametrize("given,field", [
    ({"aggregated": True, "num_prefill": 2}, "num_prefill"),  # a local deployment's
    ({"aggregated": True, "point": "8k"}, "point"),
    ({"aggregated": True, "compile_cache": "/x"}, "compile_cache"),  # a point's graphs
    ({"page_size": 32}, "page_size"),  # the point fixes a local deployment's shapes
    ({"max_batch": 8}, "max_batch"),
    ({"max_model_len": 9000}, "max_model_len"),  # past the point's max_context (8192)
])
def test_trnd_serve_refuses_what_its_mode_cannot_apply(given, field):
    with pytest.raises(ConfigError, match=rf"^{field}.* - at `\$.{field}`$"):
        load_serve_config(None, given)


def test_trnd_serve_picks_its_config_by_mode():
    assert isinstance(load_serve_config(None, {}), LocalConfig)
    agg = load_serve_config(None, {"aggregated": True, "page_size": 32, "static": True})
    assert isinstance(agg, ServeConfig) and agg.shapes.page_size == 32 and agg.engine.static


def test_roles_offer_only_what_they_apply():
    assert "num_prefill" not in keys(DecodeConfig) and "max_n" not in keys(PrefillConfig)
    assert "dtype" not in keys(RouterConfig) and "targets" not in keys(DecodeConfig)
    with pytest.raises(ConfigError, match="compile_decode.*prefill server runs none"):
        load_config(PrefillConfig, None, {"compile_decode": True})


def test_the_engine_and_the_role_configs_share_one_set_of_rules():
    with pytest.raises(ConfigError, match="static runs one rank") as role:
        load_config(PrefillConfig, None, {"static": True, "tp": 2})
    with pytest.raises(ValueError, match="static runs one rank") as engine:
        EngineConfig(model="m", static=True, tp=2)
    assert str(engine.value) in str(role.value)


def test_engine_config_from_a_role_takes_its_parts():
    from trnd.points import get_point

    cfg = load_config(DecodeConfig, None, {"dtype": "float32", "host_cache_gb": 0.25, "compile_cache": "/c"})
    ec = EngineConfig.from_role("/m", cfg.engine, cfg.tiers, role="decode", point=get_point("8k"), num_pages=99)
    assert (ec.dtype, ec.host_cache_gb, ec.static, ec.point, ec.num_pages, ec.page_size) == (
        "float32", 0.25, True, "8k", 99, get_point("8k").page_size)
    agg = load_serve_config(None, {"aggregated": True, "page_size": 32})
    ec = EngineConfig.from_role("/m", agg.engine, agg.tiers, role="serve", shapes=agg.shapes)
    assert ec.page_size == 32 and ec.point is None
    assert msgspec.structs.asdict(agg.tiers)["store"] is not ec.store  # copied, not shared


def test_the_l3_backend_is_a_tier_and_reaches_the_engine():
    from trnd.points import get_point

    cfg = load_config(DecodeConfig, None, {"remote": {"backend": "mooncake", "master": "10.0.0.1:50051"}})
    assert cfg.tiers.remote.backend == "mooncake" and flat(cfg)["remote"] is cfg.tiers.remote
    ec = EngineConfig.from_role("/m", cfg.engine, cfg.tiers, role="decode", point=get_point("8k"))
    assert ec.remote.master == "10.0.0.1:50051"
    with pytest.raises(ConfigError, match=r"Invalid enum value 'redis'.* - at `\$.remote.backend`"):
        load_config(PrefillConfig, None, {"remote": {"backend": "redis"}})


def test_a_local_deployment_hands_its_children_the_l3_backend_kv_events_and_speculation(tmp_path):
    """trnd serve's children read the same [remote] table and speculative_config (the decode-point contract);
    each publishes its own KV events (ephemeral endpoints), and with several decode servers the local router
    routes on them."""
    from trnd.roles.local import role_configs

    cfg = load_serve_config(None, {"remote": {"backend": "mooncake", "segment_gb": 0.5}, "num_decode": 2,
                                   "speculative_config": '{"method": "ngram", "num_speculative_tokens": 3}',
                                   "kv_events": {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:5557"},
                                   "prefill_control_port": 9100, "prefill_admin_port": 9200, "decode_port": 9300})
    children = {c.name: c for c in role_configs(cfg, "/m", tmp_path)}
    prefill = load_config(PrefillConfig, children["prefill0"].config)
    decode = load_config(DecodeConfig, children["decode1"].config)
    router = load_config(RouterConfig, children["router"].config)
    for role in (prefill, decode):
        assert role.tiers.remote == cfg.tiers.remote
        assert role.engine.speculative_config == cfg.engine.speculative_config
        assert role.kv_events.on and role.kv_events.endpoint is None
    assert router.kv_events


@pytest.mark.parametrize("name,cls", [("serve", LocalConfig), ("prefill", PrefillConfig), ("decode", DecodeConfig),
                                      ("router", RouterConfig), ("store", StoreConfig)])
def test_example_role_configs_are_valid(name, cls, tmp_path, monkeypatch):
    """As systemd starts them: the credentials they name (LoadCredential=) are there; keys fail closed."""
    from pathlib import Path

    (tmp_path / "trnd_control_secret").write_text("s" * 32)
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path))
    cfg = load_config(cls, Path(__file__).resolve().parents[2] / "configs" / f"{name}.toml")
    if name not in ("serve", "router"):
        assert cfg.secret_file == "${CREDENTIALS_DIRECTORY}/trnd_control_secret"  # what LoadCredential= names it


def test_every_test_file_stands_in_a_layer():
    """tests/unit (no process, no socket), procs (roles on loopback), system (systemd, two hosts, the openai
    client, the wheel), kernels: a test file at the top of tests/ belongs in one of them (README, "Tests")."""
    from pathlib import Path

    top = Path(__file__).resolve().parents[2]
    assert sorted(p.name for p in top.glob("test_*.py")) == []
