import json
from test_sharding import _mesh_check, _assert_mesh_equals_single_device

def test_new(tmp_path, tiny_neox_dir):
    report = _mesh_check(tmp_path, tiny_neox_dir, ["mistral", "gemma2", "gemma3_text"])
    print(json.dumps({k: {"stats": max(v["stats"].values()), "condll": v["condll"], "mope": v["mope"]} for k, v in report.items()}))
    _assert_mesh_equals_single_device(report)
