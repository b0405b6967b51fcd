from pathlib import Path

import pytest

from asyncsync import ConfigError, WeightSync, WeightSyncConfig

ROOT = Path(__file__).resolve().parent.parent


def test_default_yaml_documents_every_field_and_loads():
    cfg = WeightSyncConfig.from_yaml(ROOT / "configs" / "default.yaml")
    text = (ROOT / "configs" / "default.yaml").read_text()
    for name in WeightSyncConfig.__dataclass_fields__:
        assert f"{name}:" in text, f"configs/default.yaml does not document {name}"
    assert cfg.async_weight_update is False
    assert cfg.bucket_bytes == 512 * 1024 * 1024


def test_sizes_servers_and_nested_deadlines():
    cfg = WeightSyncConfig.from_dict({
        "bucket_bytes": "64MiB",
        "servers": ["http://127.0.0.1:8000", {"url": "http://127.0.0.1:8001", "kind": "reference", "token": "t"}],
        "deadlines": {"http_s": 5},
    })
    assert cfg.bucket_bytes == 64 * 2**20
    assert [s.base_url for s in cfg.servers] == ["http://127.0.0.1:8000", "http://127.0.0.1:8001"]
    assert cfg.servers[1].token == "t"
    assert cfg.deadlines.http_s == 5 and cfg.deadlines.collective_s == 120.0


@pytest.mark.parametrize(
    "data, key",
    [
        ({"bucket_size": 1}, "bucket_size"),
        ({"bucket_bytes": "lots"}, "bucket_bytes"),
        ({"bucket_bytes": -1}, "bucket_bytes"),
        ({"backend": "mpi"}, "backend"),
        ({"async_weight_update": "yes"}, "async_weight_update"),
        ({"checksum": 1}, "checksum"),
        ({"max_staleness": -1}, "max_staleness"),
        ({"master_port": 70000}, "master_port"),
        ({"deadlines": {"http_s": 0}}, "deadlines.http_s"),
        ({"deadlines": {"rpc_s": 1}}, "deadlines.rpc_s"),
        ({"servers": [{"url": "http://a:1", "kind": "tgi"}]}, "servers[0].kind"),
        ({"servers": [{"kind": "reference"}]}, "servers[0].url"),
        ({"servers": [{"url": "localhost:8000"}]}, "servers[0].url"),
        ({"servers": [{"url": "http://a:1", "colour": "red"}]}, "servers[0].colour"),
        ({"servers": "http://a:1"}, "servers"),
        ({"servers": ["http://a:1", "http://a:1/"]}, "servers"),
    ],
)
def test_bad_values_name_the_key(data, key):
    with pytest.raises(ConfigError) as err:
        WeightSyncConfig.from_dict(data)
    assert str(err.value).startswith(key), str(err.value)


def test_yaml_section_and_missing_section(tmp_path):
    path = tmp_path / "trainer.yaml"
    path.write_text("weight_sync:\n  checksum: false\n  servers: [http://127.0.0.1:9000]\n")
    assert WeightSyncConfig.from_yaml(path, section="weight_sync").checksum is False
    with pytest.raises(ConfigError, match="no 'sync' section"):
        WeightSyncConfig.from_yaml(path, section="sync")


def test_weight_sync_needs_servers():
    with pytest.raises(ValueError, match="servers is empty"):
        WeightSync(WeightSyncConfig())



def test_a_bare_off_in_yaml_is_the_off_mode(tmp_path):
    """PyYAML reads ``delta: off`` as false (YAML 1.1): it still means ``off``."""
    path = tmp_path / "sync.yaml"
    path.write_text("servers: [{url: 'http://127.0.0.1:1'}]\ndelta: off\n")
    assert WeightSyncConfig.from_yaml(path).delta == "off"
