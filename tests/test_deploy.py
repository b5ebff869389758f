"""docs/deploy.md deploys: the pre-start check passes on a new host, the systemd units pass systemd's own
checker and enable into the boot, the Kubernetes manifest passes the Kubernetes API schema, a warm
directory the worker may not write names the permission problem, and every /dev/shm size on the page
is the one `tieredkv estimate` gives."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tieredkv import KVSpec, cli
from tieredkv.estimate import estimate

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = (ROOT / "docs" / "deploy.md").read_text()


def fenced(lang: str, text: str = DEPLOY) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.S | re.M)


# ---- `tieredkv verify --repair` before the first start ------------------------------------------------
@pytest.mark.parametrize("state", ["missing", "empty"])
def test_verify_repair_on_a_new_host_lets_the_workers_start(state, tmp_path, capsys):
    """The units run `verify --repair DIR` and the workers only if it succeeds: on a new host the
    directory is missing (no CacheDirectory=) or empty (systemd or an init container just made it).
    Nothing to check is a success there; a plain `verify` of such a path still says so (a typo must not
    pass as a clean scrub)."""
    warm = tmp_path / "warm"
    if state == "empty":
        warm.mkdir()
    assert cli.main(["verify", str(warm), "--repair"]) == 0
    out, err = capsys.readouterr()
    assert "nothing to check" in out + err
    assert cli.main(["verify", str(warm), "--repair", "--json", "-"]) == 0
    import json

    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is True and doc["tiers"] == []
    assert cli.main(["verify", str(warm)]) in (1, 2)   # without --repair: still an error
    assert not warm.exists() or not any(warm.iterdir())  # --repair created nothing


# ---- systemd ------------------------------------------------------------------------------------------
def units() -> dict[str, str]:
    """unit file name -> text, from the ```ini blocks (each starts with a comment naming its path)."""
    found = {}
    for block in fenced("ini"):
        m = re.match(r"# /etc/systemd/system/(\S+)", block)
        if m:
            found[m.group(1)] = block
    return found


def test_the_page_has_the_three_units():
    assert set(units()) == {"tieredkv-verify.service", "kv-worker@.service", "tieredkv-metrics.service"}


def _unit_dir(tmp_path: Path) -> Path:
    """The units with the venv paths pointing at this venv (systemd-analyze checks ExecStart exists)."""
    venv_bin = Path(sys.prefix) / "bin"
    d = tmp_path / "etc" / "systemd" / "system"
    d.mkdir(parents=True)
    for name, text in units().items():
        (d / name).write_text(text.replace("/opt/llm/.venv/bin/", f"{venv_bin}/"))
    return d


def _systemd_tool(name: str) -> str:
    tool = shutil.which(name)
    if tool is None:
        pytest.skip(f"{name} is not installed (.ci/setup installs the systemd package)")
    return tool


def test_systemd_units_pass_systemd_analyze_verify(tmp_path):
    """systemd's own offline checker: every directive known, every dependency resolvable, every
    ExecStart executable. Any message is a failure (systemd only warns about unknown keys)."""
    tool = _systemd_tool("systemd-analyze")
    d = _unit_dir(tmp_path)
    proc = subprocess.run([tool, "verify", "--man=no", str(d / "tieredkv-verify.service"),
                           str(d / "kv-worker@3.service"), str(d / "tieredkv-metrics.service")],
                          capture_output=True, text=True, timeout=120, cwd=d)
    assert proc.returncode == 0 and not proc.stdout.strip() and not proc.stderr.strip(), proc.stdout + proc.stderr
    # The checker catches what it is meant to catch: a misspelt directive.
    (d / "kv-worker@.service").write_text((d / "kv-worker@.service").read_text().replace("Requires=", "Require="))
    bad = subprocess.run([tool, "verify", "--man=no", str(d / "kv-worker@3.service")],
                         capture_output=True, text=True, timeout=120, cwd=d)
    assert "Unknown key" in bad.stderr + bad.stdout


def test_systemd_units_enable_into_the_boot_and_chain_the_check(tmp_path):
    """`systemctl enable` (into a scratch root) links the workers and the exporter into
    multi-user.target: they come back after a reboot. The workers require the check and start after it;
    both create the warm directory with the workers' user and mode 0700."""
    tool = _systemd_tool("systemctl")
    d = _unit_dir(tmp_path)
    proc = subprocess.run([tool, f"--root={tmp_path}", "enable", "kv-worker@0.service", "kv-worker@1.service",
                           "tieredkv-metrics.service"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    wants = d / "multi-user.target.wants"
    assert sorted(p.name for p in wants.iterdir()) == ["kv-worker@0.service", "kv-worker@1.service",
                                                        "tieredkv-metrics.service"]
    u = units()
    worker, check = u["kv-worker@.service"], u["tieredkv-verify.service"]
    assert "Requires=tieredkv-verify.service" in worker and "After=tieredkv-verify.service" in worker
    assert "Type=oneshot" in check and "RemainAfterExit=yes" in check and "--repair" in check
    for text in (worker, check):
        assert "CacheDirectory=tieredkv" in text and "CacheDirectoryMode=0700" in text
        assert re.search(r"^User=llm$", text, re.M)
    assert "/var/cache/tieredkv" in check  # CacheDirectory=tieredkv is /var/cache/tieredkv


# ---- Kubernetes -------------------------------------------------------------------------------------
def test_kubernetes_manifest_passes_the_api_schema():
    """The Pod validates against the Kubernetes API's OpenAPI schema (kubernetes-validate, strict:
    an unknown or misplaced field fails), and the check is real: a misspelt field fails it."""
    yaml = pytest.importorskip("yaml")
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (.ci/setup does)")
    (block,) = [b for b in fenced("yaml") if "kind: Pod" in b]
    pod = yaml.safe_load(block)
    kv.validate(pod, kv.latest_version(), strict=True)
    bad = yaml.safe_load(block.replace("sizeLimit:", "sizelimit:"))
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, kv.latest_version(), strict=True)
    init = {c["name"]: c for c in pod["spec"]["initContainers"]}
    worker_uid = pod["spec"]["containers"][0]["securityContext"]["runAsUser"]
    assert f"chown {worker_uid}:" in " ".join(init["warm-dir-owner"]["command"])
    assert init["warm-dir-owner"]["securityContext"]["runAsUser"] == 0
    assert init["warm-verify"]["command"][-1] == "--repair"


def test_a_warm_dir_the_worker_cannot_write_gets_a_permission_hint(tmp_path):
    """Kubernetes' hostPath DirectoryOrCreate makes the directory root's (0755) while the worker runs as
    another user: the cache starts hot-only, and the warning names the permission problem (owner, mode,
    this process's uid, chown), not `verify --repair`, which cannot fix it. Reproduced as root without
    the capabilities that bypass file permissions, on a directory owned by another uid."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv (util-linux) to run a process that file permissions apply to")
    warm = tmp_path / "warm"
    warm.mkdir(mode=0o755)
    os.chown(warm, 4242, 4242)
    os.chmod(warm, 0o755)
    os.chmod(tmp_path, 0o755)
    code = f"""
import warnings, numpy as np
from tieredkv import KVSpec, TieredCache
spec = KVSpec(model_id="perm-{os.getpid()}", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", chunk_tokens=4)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with TieredCache(spec, hot_bytes=4 << 20, hot_name="/tieredkv-permtest-{os.getpid()}", warm_dir={str(warm)!r},
                     warm_bytes=8 << 20) as cache:
        assert cache.warm is None
        cache.hot.unlink()
print("\\n".join(str(w.message) for w in caught))
"""
    proc = subprocess.run(["setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search,-fowner",
                           sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    message = proc.stdout
    assert "hot-only" in message
    assert "uid 4242" in message and "0755" in message and "uid 0" in message and "chown" in message, message
    assert "verify --repair" not in message, message


# ---- /dev/shm sizes -------------------------------------------------------------------------------------
def test_every_shm_size_on_the_page_is_what_estimate_gives():
    """Section 1's example (Qwen2.5-7B geometry, the command's numbers) through `estimate`; the Docker
    `--shm-size` and the Kubernetes `sizeLimit` on the page are that size, which follows the page's
    rule (twice hot_bytes, rounded up to 64 MiB)."""
    cmd = re.search(r"tieredkv estimate --config \S+ (.*)", DEPLOY).group(1)
    args = dict(re.findall(r"--([\w-]+) (\d+)", cmd))
    spec = KVSpec(model_id="Qwen/Qwen2.5-7B-Instruct", num_layers=28, num_kv_heads=4, head_dim=128,
                  dtype="bfloat16")
    sizes = estimate(spec, prompt_tokens=int(args["prompt-tokens"]), prefix_tokens=int(args["prefix-tokens"]),
                     concurrency=int(args["concurrency"]), workers=int(args["workers"]))
    mib = sizes["shm_size_bytes"] >> 20
    assert sizes["shm_size_bytes"] == -(-2 * sizes["hot_bytes"] // (64 << 20)) * (64 << 20)
    shown = re.findall(r"--shm-size=(\d+)m", DEPLOY) + re.findall(r"sizeLimit: (\d+)Mi", DEPLOY)
    assert shown and all(int(v) == mib for v in shown), (shown, mib)
